"""Readable, normalised text of one attention block of an FX graph (for snapshots and ``tqkv inspect``).

The block is the KV-cache update, the attention op and the read of its output. Node names are renumbered
in order of appearance and user counts dropped, so a snapshot diff shows a change of ops or wiring only.
"""

from __future__ import annotations

import re

_NODE = re.compile(r"^\s*%(\w+) : \[num_users=\d+\] = (.*)$")
_NAME = re.compile(r"%(\w+)")
_UPDATE_OPS = ("vllm.unified_kv_cache_update", "tqkv.vllm_kv_cache_update")


def attention_blocks(graph_text: str) -> list[str]:
    """Every attention block in the graph, normalised, in graph order."""
    nodes = []
    for line in graph_text.splitlines():
        match = _NODE.match(line)
        if match:
            nodes.append((match.group(1), match.group(2)))
    blocks = []
    for i, (name, body) in enumerate(nodes):
        if not any(op in body for op in _UPDATE_OPS):
            continue
        block = [(name, body)]
        attention = next(
            ((n, b) for n, b in nodes[i + 1 :] if "auto_functionalized" in b and f"kv_cache_dummy_dep: %{name}" in b),
            None,
        )
        if attention:
            block.append(attention)
            block += [(n, b) for n, b in nodes if b.startswith("call_function[target=operator.getitem]")
                      and f"(%{attention[0]}, " in b]
        blocks.append(_normalise(block))
    return blocks


def _normalise(block: list[tuple[str, str]]) -> str:
    names: dict[str, str] = {}

    def rename(match: re.Match) -> str:
        return "%" + names.setdefault(match.group(1), f"v{len(names)}")

    lines = []
    for name, body in block:
        left = rename(re.match(r"(\w+)", name))
        lines.append(f"{left} = {_NAME.sub(rename, body)}")
    return "\n".join(lines)
