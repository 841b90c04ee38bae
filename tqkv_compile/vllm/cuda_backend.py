"""vLLM's TurboQuant attention backend with its layers served by tqkv (registered over ``TURBOQUANT``)."""

from dataclasses import replace

from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend, TurboQuantAttentionImpl

from tqkv_compile.vllm import serving
from tqkv_compile.vllm.impl_mixin import TqkvImplMixin


class TqkvTurboQuantImpl(TqkvImplMixin, TurboQuantAttentionImpl):
    pass


class TqkvTurboQuantBackend(TurboQuantAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TqkvTurboQuantImpl

    @classmethod
    def customize_spec(cls, spec):
        """vLLM's slot (``slot_size_aligned``, equal to tqkv's ``slot_bytes`` for vLLM's presets), or a preset
        of ours at its own, smaller slot where tqkv serves the layer (serving.spec_slot_bytes): the spec sizes
        vLLM's allocation. Called by the vLLM versions that size the cache by the spec (the adapter's
        docstring); vLLM 0.20 sizes it by ``get_kv_cache_shape`` and never calls this."""
        slot = None if spec.state_content_bytes is not None else serving.spec_slot_bytes(spec)
        spec = super().customize_spec(spec)
        if slot is None or slot >= spec.state_content_bytes:
            return spec
        return replace(spec, state_content_bytes=slot)
