"""The ``vllm.general_plugins`` entry point. vLLM loads it in every process; it does nothing unless
``TQKV_ENABLE=1`` (set by ``tqkv_compile.vllm.compilation_config()`` / ``enable()``, or by the user for
``vllm serve``), and it is idempotent.

When enabled: TurboQuant layers get tqkv's attention impl (an override of vLLM's backend class path, its
documented plugin point), and on the CPU, where Inductor itself calls ``post_grad_custom_post_pass``, the
graph pass is installed in Inductor's config unless the user set one.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.tqkv_compile")  # vLLM's log handler and format
_done = False


def register() -> None:
    global _done
    if _done or os.environ.get("TQKV_ENABLE", "0") in ("", "0", "false", "False"):
        return
    from tqkv_compile.codec import OWN_PRESETS
    from tqkv_compile.vllm import adapter

    preset = os.environ.get("TQKV_PRESET")
    if preset and preset not in OWN_PRESETS:  # else every layer would fall back, with nothing but an info log
        raise ValueError(f"TQKV_PRESET={preset!r} is not a preset of tqkv's; choose one of "
                         f"{', '.join(OWN_PRESETS)}, or unset it to store the cache dtype's own preset")
    reason = adapter.unsupported_reason()
    if reason:
        logger.warning("tqkv: not enabled: %s", reason)
        _done = True
        return
    note = adapter.unproven_note()
    if note:
        logger.warning("tqkv: %s", note)
    adapter.override_attention_backend()
    from tqkv_compile.vllm import wrapper_ops

    wrapper_ops.register()  # a graph loaded from vLLM's compile cache calls them without the pass running
    from tqkv_compile.vllm import engine_run

    std = os.environ.get(engine_run.DUMMY_WEIGHT_STD_ENV)
    if std:  # harness hook (engine_run, tests): the same scaled dummy weights in every worker process
        engine_run.scaled_dummy_weights(float(std))
    if not adapter.on_cuda():
        import torch._inductor.config as inductor_config

        from tqkv_compile.passes.attention_rewrite import TqkvAttentionRewritePass

        if inductor_config.post_grad_custom_post_pass is None:
            inductor_config.post_grad_custom_post_pass = TqkvAttentionRewritePass()
    _done = True
    logger.info("tqkv: enabled in process %d (vLLM %s)", os.getpid(), adapter.vllm_version())
