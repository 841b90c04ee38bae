"""The ops the graph pass writes into vLLM's graph: ``tqkv::vllm_kv_cache_update`` and
``tqkv::vllm_unified_attention_with_output``.

They take exactly the graph values vLLM's own ops take (same schema, layer name included), fetch the
layer's cache and metadata from vLLM's forward context at run time and call ``tqkv::kv_write`` /
``tqkv::attention``; a layer that does not fit goes to vLLM's own op.
"""

import torch

from tqkv_compile.vllm import adapter, serving

_registered = False


def register() -> None:
    """Define the wrapper ops once per process (needs vLLM: the layer-name type is vLLM's)."""
    global _registered
    if _registered:
        return
    LayerNameType = adapter.layer_name_type()

    def vllm_kv_cache_update(key: torch.Tensor, value: torch.Tensor, layer_name: LayerNameType) -> torch.Tensor:
        context = adapter.layer_context(adapter.layer_name_str(layer_name))
        if not serving.serves(context.layer):
            return torch.ops.vllm.unified_kv_cache_update(key, value, layer_name)
        serving.write_kv(context.layer, key, value, context.kv_cache, context.slot_mapping, path="compiled")
        return key.new_empty(0)

    def vllm_kv_cache_update_fake(key: torch.Tensor, value: torch.Tensor, layer_name: LayerNameType) -> torch.Tensor:
        return torch.empty(0, device=key.device, dtype=key.dtype)

    def vllm_unified_attention_with_output(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        layer_name: LayerNameType,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
        kv_cache_dummy_dep: torch.Tensor | None = None,
    ) -> None:
        context = adapter.layer_context(adapter.layer_name_str(layer_name))
        if serving.vllm_attends(context.layer, output_scale, output_block_scale):
            torch.ops.vllm.unified_attention_with_output(
                query, key, value, output, layer_name, output_scale, output_block_scale, kv_cache_dummy_dep
            )
            return
        serving.attend(context.layer, query, context.kv_cache, context.metadata, output, path="compiled", key=key,
                       value=value)

    def vllm_unified_attention_with_output_fake(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        layer_name: LayerNameType,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
        kv_cache_dummy_dep: torch.Tensor | None = None,
    ) -> None:
        return None

    adapter.register_layer_name_op("vllm_kv_cache_update", vllm_kv_cache_update, vllm_kv_cache_update_fake, [])
    adapter.register_layer_name_op(
        "vllm_unified_attention_with_output",
        vllm_unified_attention_with_output,
        vllm_unified_attention_with_output_fake,
        ["output", "output_block_scale"],
        cudagraph_unsafe=True,
    )
    _registered = True
