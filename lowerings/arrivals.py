"""Arrival counts that put themselves back to zero, for kernels whose last program to arrive finishes the
others' work (the split-KV merge in the decode kernel, the corrected key norm in kv_write).

A per-call ``torch.zeros`` of the counts is a memset of its own in every launch (a node of its own in a CUDA
graph, ~1-2 us at a decode step). These counts are zeroed once and kept for the process: the program that
arrives last sets its count back to 0 after its work, so the buffer is all zeros again when the launch ends.

Assumptions, kept by the callers: the launches that count in one buffer run one after another (on one stream:
vLLM's forward does); a buffer grows only outside CUDA-graph capture, where the zeroing really runs (vLLM's
warm-up and profile runs, which come before capture, size it), and during capture a call that needs more than
the buffer holds gets None and falls back to a per-call buffer or a launch of its own; nothing is created while
Inductor traces a launcher (fake tensors), so traced launches do not use them.

Off unless ``TQKV_LAST_ARRIVER=1`` (:func:`enabled`): not yet timed or checked on a GPU, where the memory
ordering they rely on is real (the interpreter runs programs one after another).
"""

from __future__ import annotations

import os

import torch

_COUNTS: dict[tuple[str, str], torch.Tensor] = {}
# buffers replaced by larger ones: kept, since a CUDA graph captured earlier still counts in them
_RETIRED: list[torch.Tensor] = []


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def enabled() -> bool:
    """Whether kernels finish their work in the last program to arrive, counting in kept buffers
    (``TQKV_LAST_ARRIVER=1``): the decode kernel's split merge in its own launch, kv_write's corrected norms
    without a memset."""
    return os.environ.get("TQKV_LAST_ARRIVER", "0") == "1"


def arrival_counts(purpose: str, n: int, device: torch.device) -> torch.Tensor | None:
    """At least ``n`` int32 arrival counts on ``device`` for ``purpose`` (one buffer per purpose), all zero
    between launches; None when not :func:`enabled`, or during CUDA-graph capture when the buffer would have
    to grow."""
    if not enabled():
        return None
    key = (purpose, str(device))
    counts = _COUNTS.get(key)
    if counts is None or counts.numel() < n:
        if _capturing(device):
            return None
        size = max(n, 2 * counts.numel() if counts is not None else 1024)
        if counts is not None:
            _RETIRED.append(counts)
        counts = _COUNTS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return counts
