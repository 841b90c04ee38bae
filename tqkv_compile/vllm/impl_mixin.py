"""Our attention impl: serves TurboQuant layers with the tqkv ops, hands every other layer to vLLM's impl.

vLLM's unified attention ops call ``layer.impl`` in eager mode and in a graph our pass did not rewrite, so
this is what makes eager (the reference for compiled runs) and unrewritten graphs use the same ops.
"""

from tqkv_compile.vllm import serving


class TqkvImplMixin:
    """Mixed in front of a vLLM attention impl class (see cpu_backend / cuda_backend)."""

    def process_weights_after_loading(self, act_dtype):
        parent = getattr(super(), "process_weights_after_loading", None)
        if parent is not None:
            parent(act_dtype)
        serving.prepare(self)  # tables on the GPU before CUDA-graph capture

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if not serving.serves(layer):
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        serving.write_kv(layer, key, value, kv_cache, slot_mapping, path="impl")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        if serving.vllm_attends(layer, output_scale, output_block_scale):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output=output,
                                   output_scale=output_scale, output_block_scale=output_block_scale)
        serving.attend(layer, query, kv_cache, attn_metadata, output, path="impl", key=key, value=value)
        return output
