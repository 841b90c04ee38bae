"""The byte kernel: split-KV decode attention over vLLM's slot layouts with every field read by byte loads, so
that it reads any view of the cache (the fallback where :mod:`~tqkv_compile.lowerings.decode_stream`'s word
loads cannot: a cache whose slots are not byte-contiguous or whose fields are not 2-byte aligned).

Keys: 4-bit codes unpacked from their bytes as (even, odd) coordinates, 3-bit codes read through 16-bit windows
in :func:`~tqkv_compile.lowerings.device_helpers.order3`'s column order, their centroids chosen by a select
tree; scores = dot(q @ H, centroids) * ||k|| / ||c|| (nc), or dot(q, fp8 keys); the query arrives rotated and
scaled from :func:`~tqkv_compile.lowerings.triton_query.prepare_query`. Values: P.V = (P * scale) . codes +
(P . zero), the codes as exact fp16 subnormals. The grid, the partials and their merge are
:mod:`~tqkv_compile.lowerings.triton_attention`'s contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import Preset
from tqkv_compile.lowerings.device_helpers import (LOG2E, codes_f16, key_scores, load_codes3, load_fp16,
                                                   load_nibbles, load_query, operand, order3, softmax_step,
                                                   split_span, tile_base)
from tqkv_compile.lowerings.triton_query import prepare_query


@triton.jit
def _decode_split_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, cent_ptr, part_out_ptr, part_lse_ptr,
    num_seqs, max_len,
    s_qt, s_qh, s_qd, s_bt, s_bm,
    s_blk, s_pos, s_head, s_byte,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    VALUE_BITS: tl.constexpr, VALUE_OFFSET: tl.constexpr, VALUE_CODE_BYTES: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One (query row, kv head, split) program: the row's query-head group against its split of the context,
    every field read by byte loads at the cache's own strides (``s_byte`` between a slot's bytes), so any view
    of the cache is read; 4-bit keys and values as (even, odd) coordinates, 3-bit ones in :func:`order3`'s
    column order. Partials as :mod:`~tqkv_compile.lowerings.triton_attention` describes them."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    DTYPE: tl.constexpr = tl.float32 if DOT_FP32 else tl.float16

    seq, begin, end, q_heads, part, head_ok = split_span(row, kv_head, split, qsl_ptr, seq_lens_ptr, num_seqs,
                                                         max_len, GROUP, BLOCK_H, BLOCK_N, NUM_SPLITS, SEARCH_STEPS)
    if begin >= end:
        tl.store(part_lse_ptr + part, tl.full((BLOCK_H,), float("-inf"), tl.float32), mask=head_ok)
        return

    q_a, q_b = load_query(q_ptr, row, q_heads, head_ok, s_qt, s_qh, s_qd, D, KEY_FP8, KEY_BITS, DTYPE,
                          tl.float16)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    # Value accumulators: (even, odd) coordinates for 4-bit values, order3 columns for 3-bit (b unused).
    if VALUE_BITS == 4:
        acc_a = tl.zeros((BLOCK_H, D // 2), tl.float32)
        acc_b = tl.zeros((BLOCK_H, D // 2), tl.float32)
    else:
        acc_a = tl.zeros((BLOCK_H, D), tl.float32)
        acc_b = tl.zeros((BLOCK_H, 16), tl.float32)
    shift = tl.zeros((BLOCK_H,), tl.float32)  # sum of P * zero: the affine part of P.V
    bt_row = block_table_ptr + seq.to(tl.int64) * s_bt
    n = tl.arange(0, BLOCK_N)
    for start in range(begin, end, BLOCK_N):
        base, valid = tile_base(bt_row, s_bm, start, end, n, kv_head, s_blk, s_pos, s_head, BLOCK_SIZE, False)

        scores = key_scores(q_a, q_b, cache_ptr, cent_ptr, base, valid, s_byte, D, KEY_FP8, KEY_BITS,
                            KEY_CODE_BYTES, NORM_CORRECTION, DTYPE, "ieee" if DOT_FP32 else None, tl.float16)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(scores, m_i, l_i)

        vbase = base + VALUE_OFFSET * s_byte
        vscale = load_fp16(cache_ptr, vbase + VALUE_CODE_BYTES * s_byte, valid)
        vzero = load_fp16(cache_ptr, vbase + (VALUE_CODE_BYTES + 2) * s_byte, valid)
        ps = operand(p * vscale[None, :], DTYPE)
        # codes enter the dot as code * 2^-24 (:func:`codes_f16`); the zero point beside it, in fp32
        shift = shift * alpha + tl.sum(p * vzero[None, :], axis=1)
        if VALUE_BITS == 4:
            even, odd = load_nibbles(cache_ptr, vbase, valid, s_byte, D)
            # each tile's dot from zero, added in fp32 (decode_stream's kernel says why)
            rescale = tl.broadcast_to(alpha[:, None], acc_a.shape)
            acc_a = tl.fma(acc_a, rescale, tl.dot(ps, codes_f16(even).to(DTYPE)))
            acc_b = tl.fma(acc_b, rescale, tl.dot(ps, codes_f16(odd).to(DTYPE)))
        else:
            codes = load_codes3(cache_ptr, vbase, valid, s_byte, D)
            rescale = tl.broadcast_to(alpha[:, None], acc_a.shape)
            acc_a = tl.fma(acc_a, rescale, tl.dot(ps, codes_f16(codes).to(DTYPE)))

    inv = 1.0 / l_i
    shift = shift * inv
    inv = inv * 16777216.0  # 2^24: the codes' unit (codes_f16)
    rows_out = part_out_ptr + part[:, None] * D
    if VALUE_BITS == 4:
        i = tl.arange(0, D // 2)
        tl.store(rows_out + (2 * i)[None, :], acc_a * inv[:, None] + shift[:, None], mask=head_ok[:, None])
        tl.store(rows_out + (2 * i + 1)[None, :], acc_b * inv[:, None] + shift[:, None], mask=head_ok[:, None])
    else:
        tl.store(rows_out + order3(D)[None, :], acc_a * inv[:, None] + shift[:, None], mask=head_ok[:, None])
    tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=head_ok)


def fill_partials(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, scale: float, preset: Preset, rotation: torch.Tensor,
                  centroids: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, *, block_n: int,
                  search_steps: int, num_warps: int | None = None, num_stages: int | None = None,
                  launch=None) -> None:
    """Fill ``part_out`` [T, Hq, splits, D] fp32 (each split's normalised output) and ``part_lse`` [T, Hq,
    splits] fp32 (its base-2 log-sum-exp) for ``query`` [T, Hq, D]: a :func:`prepare_query` launch (the query
    rotated for Lloyd-Max keys, scaled by ``scale`` x log2(e)), then the kernel on a grid of (T, kv heads,
    splits). ``search_steps``: the bisection steps over ``query_start_loc``, ceil(log2(sequences + 1)).
    ``launch``: wraps each kernel before its launch (``torch.library.wrap_triton`` when traced; None: plain)."""
    rows, heads, dim = query.shape
    kv_heads = kv_cache.shape[2]
    group = heads // kv_heads
    splits = part_out.shape[2]
    q = prepare_query(query, None if preset.key_fp8 else rotation, scale * LOG2E, launch)
    kernel = _decode_split_kernel if launch is None else launch(_decode_split_kernel)
    kernel[(rows, kv_heads, splits)](
        q, kv_cache, block_table, seq_lens, query_start_loc, centroids, part_out, part_lse,
        seq_lens.shape[0], block_table.shape[1] * kv_cache.shape[1],
        *q.stride(), *block_table.stride(), *kv_cache.stride(),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_N=block_n, NUM_SPLITS=splits, SEARCH_STEPS=search_steps,
        KEY_FP8=preset.key_fp8, KEY_BITS=preset.key_bits, KEY_CODE_BYTES=preset.key_code_bytes,
        NORM_CORRECTION=preset.norm_correction, VALUE_BITS=preset.value_bits,
        VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes,
        DOT_FP32=query.device.type == "cpu", num_warps=num_warps or 4, num_stages=num_stages or 2,
    )
