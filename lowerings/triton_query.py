"""The decode kernels' query: rotated (Lloyd-Max keys), scaled by the softmax scale x log2(e), in fp32, in one
launch (:func:`prepare_query`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile.lowerings import dependent_launch
from tqkv_compile.lowerings.dependent_launch import wait_and_release


@triton.jit
def _prepare_query_kernel(q_ptr, rot_ptr, out_ptr, pairs, heads, s_qt, s_qh, s_qd,
                          D: tl.constexpr, SCALE: tl.constexpr, ROTATE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                          GDC: tl.constexpr = False):
    """out[t, h, :] = (q[t, h, :] @ rot) * SCALE in fp32, BLOCK_M (token, head) pairs and BLOCK_D output
    columns a program; without ROTATE, q[t, h, :] * SCALE. The decode kernels' query in one launch
    (it was a cast, a matmul and a multiply: three launches). The product is an fp32
    FMA dot ("ieee"), as precise as the fp32 matmul it replaces."""
    wait_and_release(GDC)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = m < pairs
    row = (m // heads) * s_qt + (m % heads) * s_qh
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if ROTATE:
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for k0 in tl.static_range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            q = tl.load(q_ptr + row[:, None] + k[None, :] * s_qd, mask=ok[:, None], other=0.0).to(tl.float32)
            r = tl.load(rot_ptr + k[:, None] * D + d[None, :])
            acc = tl.dot(q, r, acc, input_precision="ieee")
    else:
        acc = tl.load(q_ptr + row[:, None] + d[None, :] * s_qd, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + m[:, None] * D + d[None, :], acc * SCALE, mask=ok[:, None])


def prepare_query(query: torch.Tensor, rotation: torch.Tensor | None, scale: float, launch=None) -> torch.Tensor:
    """The decode kernels' query [T, Hq, D] fp32: rotated (``rotation``, [D, D] fp32, None for fp8 keys),
    times ``scale`` (softmax scale x log2 e). The scale is a compile-time constant of the kernel: a float
    argument would be fp64 where Inductor launches it. Programs of 16 pairs x 64 columns: a decode step of one
    sequence still spreads over a few SMs."""
    rows, heads, dim = query.shape
    if rotation is not None and (rotation.dtype != torch.float32 or tuple(rotation.shape) != (dim, dim)):
        raise ValueError(f"rotation: expected float32 [{dim}, {dim}], got {rotation.dtype} {list(rotation.shape)}")
    out = torch.empty(rows, heads, dim, dtype=torch.float32, device=query.device)
    if rows == 0:
        return out
    pairs, block_m, block_d = rows * heads, 16, min(64, dim)
    (launch or (lambda kernel: kernel))(_prepare_query_kernel)[(triton.cdiv(pairs, block_m), dim // block_d)](
        query, rotation.contiguous() if rotation is not None else query, out, pairs, heads, *query.stride(),
        D=dim, SCALE=float(scale), ROTATE=rotation is not None,
        BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_K=min(32, dim), num_warps=4,
        **dependent_launch.options(query.device, traced=launch is not None),
    )
    return out
