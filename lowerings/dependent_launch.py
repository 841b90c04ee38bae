"""Programmatic dependent launch (Hopper and later): each of tqkv's kernels of an attention call (kv_write,
the query preparation, the decode kernel, the merge) launched so that the GPU may start it before the kernel
before it has finished; it waits (``griddepcontrol.wait``) for that kernel's completion and memory before it
reads anything, and lets the next one be launched (``griddepcontrol.launch_dependents``) as it starts. What it
saves is the launch gap between dependent kernels, ~1-2 us each at a decode step of one sequence.

Off unless ``TQKV_PDL=1`` (:func:`enabled`): a few percent faster in the kernel benchmark, no change end to end
(docs/performance-history.md). Never under the interpreter (CPU), and not where Inductor traces a launcher
(``torch.library.wrap_triton`` takes no launch options).
"""

from __future__ import annotations

import os

import torch
import triton.language as tl
from triton import jit


def enabled(device: torch.device) -> bool:
    """Whether to launch with PDL on ``device``: ``TQKV_PDL=1``, CUDA, compute capability 9.0 or later."""
    if os.environ.get("TQKV_PDL", "0") != "1" or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def options(device: torch.device, traced: bool = False) -> dict:
    """The kernel keywords for a launch: ``GDC`` (the kernel waits for the kernel before it, and lets the next
    one launch) and Triton's ``launch_pdl``; both off where PDL is not :func:`enabled` or the launch is traced."""
    on = enabled(device) and not traced
    return {"GDC": on, **({"launch_pdl": True} if on else {})}


@jit
def wait_and_release(GDC: tl.constexpr):
    """At a kernel's start, before its first read of anything an earlier kernel wrote: wait for the kernel
    before (its completion and its memory), and let the next kernel be launched. Nothing without GDC."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
