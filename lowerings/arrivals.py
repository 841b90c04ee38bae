"""Arrival counts that put themselves back to zero, for kernels whose last program to arrive finishes the
others' work (kv_write's corrected key norm for tqkv_4bit_pc).

A per-call ``torch.zeros`` of the counts is a memset of its own in every launch (a node of its own in a CUDA
graph, ~1-2 us at a decode step). These counts are zeroed once and kept for the process: the program that
arrives last sets its count back to 0 after its work, so the buffer is all zeros again when the launch ends.

Assumptions, kept by the callers: the launches that count in one buffer run one after another (on one stream:
vLLM's forward does); a buffer grows only outside CUDA-graph capture, where the zeroing really runs (vLLM's
warm-up and profile runs, which come before capture, size it), and during capture a call that needs more than
the buffer holds gets None and falls back to a per-call buffer or a launch of its own; nothing is created while
Inductor traces a launcher (fake tensors), so traced launches do not use them.

Kept counts are on unless ``TQKV_KEPT_COUNTS=0`` (:func:`kept_counts`); they save tqkv_4bit_pc's kv_write its
memset (measurements, and a merge by the last split that was tried and removed: docs/performance-history.md).
"""

from __future__ import annotations

import os

import torch

_COUNTS: dict[tuple[str, str], torch.Tensor] = {}
# buffers replaced by larger ones: kept, since a CUDA graph captured earlier still counts in them
_RETIRED: list[torch.Tensor] = []


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def kept_counts() -> bool:
    """Whether arrival counts are kept zeroed between launches (default; ``TQKV_KEPT_COUNTS=0``: a zeroed
    buffer per launch, e.g. where launches that count could run on two streams at once)."""
    return os.environ.get("TQKV_KEPT_COUNTS", "1") != "0"


def arrival_counts(purpose: str, n: int, device: torch.device) -> torch.Tensor | None:
    """At least ``n`` int32 arrival counts on ``device`` for ``purpose`` (one buffer per purpose), all zero
    between launches; None without :func:`kept_counts`, or during CUDA-graph capture when the buffer would have
    to grow."""
    if not kept_counts():
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
