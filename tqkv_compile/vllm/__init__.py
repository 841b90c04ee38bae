"""tqkv in vLLM: ``LLM(..., compilation_config=tqkv_compile.vllm.compilation_config())``.

Or, with no code change, set ``TQKV_ENABLE=1`` for ``vllm serve``: our ``vllm.general_plugins`` entry
point (tqkv_compile.vllm.plugin) then does the same in every vLLM process.
"""

from __future__ import annotations

import os
from typing import Any

ENABLE_ENV = "TQKV_ENABLE"


def _pass_class():
    from tqkv_compile.passes.attention_rewrite import TqkvAttentionRewritePass

    return TqkvAttentionRewritePass


def compilation_config(base: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """What to pass as ``LLM(compilation_config=...)``: our post-grad pass, plus on GPU
    ``use_inductor_graph_partition=True`` (without it vLLM splits the graph at the attention ops and the
    pass sees none). Also enables tqkv's attention impl in this process and in the worker processes it
    starts (through ``TQKV_ENABLE``), so that eager and unrewritten layers run the same ops."""
    from tqkv_compile.vllm import adapter

    enable()
    config = dict(base or {})
    config.update(extra)
    inductor = dict(config.get("inductor_compile_config") or {})
    inductor["post_grad_custom_post_pass"] = _pass_class()()
    config["inductor_compile_config"] = inductor
    if adapter.on_cuda():
        config.setdefault("use_inductor_graph_partition", True)
    return config


def enable() -> None:
    """Serve TurboQuant layers with tqkv in this process and the vLLM processes it starts."""
    os.environ[ENABLE_ENV] = "1"
    from tqkv_compile.vllm import plugin

    plugin.register()


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "0") not in ("", "0", "false", "False")
