"""vLLM's TurboQuant attention backend with its layers served by tqkv (registered over ``TURBOQUANT``)."""

from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend, TurboQuantAttentionImpl

from tqkv_compile.vllm.impl_mixin import TqkvImplMixin


class TqkvTurboQuantImpl(TqkvImplMixin, TurboQuantAttentionImpl):
    pass


class TqkvTurboQuantBackend(TurboQuantAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TqkvTurboQuantImpl
