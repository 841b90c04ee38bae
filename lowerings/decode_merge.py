"""The merge kernel: the split-KV kernels' partial outputs combined into each (query row, head)'s answer,
weighted by their base-2 log-sum-exps. Every split kernel (the byte, stream and fragment kernels, and
:mod:`~tqkv_compile.lowerings.general_decode`'s) ends in it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile.lowerings.dependent_launch import wait_and_release
from tqkv_compile.lowerings.launch_choices import merge_chunk, merge_warps


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, s_ot, s_oh, s_od,
                  NUM_HEADS: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                  CHUNK: tl.constexpr, GDC: tl.constexpr = False):
    """One (row, head): the splits' partial outputs weighted by their log-sum-exps. The partials are read in
    chunks of ``CHUNK`` splits (:func:`merge_chunk`: 128 up to head 128, 64 above), so that a launch of many
    splits at a large head size does not hold them all in registers."""
    wait_and_release(GDC)
    row = tl.program_id(0)
    head = tl.program_id(1)
    base = (row * NUM_HEADS + head) * NUM_SPLITS
    s = tl.arange(0, SPLITS_P2)
    top = tl.max(tl.load(part_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf")), axis=0)
    d = tl.arange(0, D)
    acc = tl.zeros([D], dtype=tl.float32)
    total = 0.0
    for first in tl.static_range(0, SPLITS_P2, CHUNK):
        c = first + tl.arange(0, CHUNK)
        lse = tl.load(part_lse_ptr + base + c, mask=c < NUM_SPLITS, other=float("-inf"))
        live = lse > float("-inf")
        weight = tl.where(live, tl.exp2(lse - top), 0.0)
        parts = tl.load(part_out_ptr + (base + c)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        total += tl.sum(weight, axis=0)
        acc += tl.sum(parts * weight[:, None], axis=0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * s_ot + head * s_oh + d * s_od, out.to(out_ptr.dtype.element_ty))


def merge(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, *, launch=None,
          pdl: dict | None = None) -> torch.Tensor:
    """``part_out`` [T, H, splits, D] fp32 (each split's normalised output) and ``part_lse`` [T, H, splits] fp32
    (its base-2 log-sum-exp, -inf for a split without positions) -> ``out`` [T, H, D] (any dtype and strides;
    rows whose splits are all empty get 0), in one launch of (T, H) programs. ``launch``: wraps the kernel before
    its launch (``torch.library.wrap_triton`` when traced; None: plain). ``pdl``: the launch's
    :func:`~tqkv_compile.lowerings.dependent_launch.options` (None: none)."""
    rows, heads, splits, dim = part_out.shape
    chunk = merge_chunk(splits, dim)
    kernel = _merge_kernel if launch is None else launch(_merge_kernel)
    kernel[(rows, heads)](
        part_out, part_lse, out, *out.stride(),
        NUM_HEADS=heads, D=dim, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), CHUNK=chunk,
        num_warps=merge_warps(chunk), **(pdl or {}),
    )
    return out
