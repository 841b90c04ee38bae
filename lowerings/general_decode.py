"""The general decode kernel: split-KV decode attention for the presets of ours (the layout:
:mod:`~tqkv_compile.lowerings.general_fields`), then :mod:`~tqkv_compile.lowerings.decode_merge`'s merge.

Every code is read through a 16-bit window at its own bit offset and looked up by a gather in one concatenated
centroid table; scores are ``norm * <q H, unit>``, plus, for an outlier channel ``i``, ``q_i * (stored value -
the rest's reconstruction at i)`` (the codec *replaces* that channel); values accumulate in the rotated basis
and the merged output is rotated back once. The grid and the partials are
:mod:`~tqkv_compile.lowerings.triton_attention`'s contract.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import Preset
from tqkv_compile.lowerings.decode_merge import merge
from tqkv_compile.lowerings.device_helpers import LOG2E, load_fp16, softmax_step, split_span, tile_base
from tqkv_compile.lowerings.general_fields import general_scores, unit_vectors
from tqkv_compile.lowerings.launch_choices import num_splits


@triton.jit
def _general_decode_kernel(
    q_ptr, q_raw_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, cent_ptr, rot_ptr, part_out_ptr,
    part_lse_ptr, num_seqs, max_len,
    s_bt, s_bm, s_blk, s_pos, s_head, s_byte,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    KEY_BITS: tl.constexpr, KEY_WIDE: tl.constexpr, KEY_CODE_BYTES: tl.constexpr, OUTLIERS: tl.constexpr,
    VALUE_BITS: tl.constexpr, VALUE_WIDE: tl.constexpr, VALUE_OFFSET: tl.constexpr,
    VALUE_CODE_BYTES: tl.constexpr, KC: tl.constexpr, KCW: tl.constexpr, VC: tl.constexpr, VCW: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Split-KV decode for a preset of ours; the split kernel's contract (queries ``[T, Hq, D]`` contiguous,
    rows q_ptr + (row * Hq + head) * D), partial outputs in the rotated basis."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    DTYPE: tl.constexpr = tl.float32 if DOT_FP32 else tl.float16
    PRECISION: tl.constexpr = "ieee" if DOT_FP32 else None

    seq, begin, end, q_heads, part, head_ok = split_span(row, kv_head, split, qsl_ptr, seq_lens_ptr, num_seqs,
                                                         max_len, GROUP, BLOCK_H, BLOCK_N, NUM_SPLITS, SEARCH_STEPS)
    heads = GROUP * tl.num_programs(1)
    if begin >= end:
        tl.store(part_lse_ptr + part, tl.full((BLOCK_H,), float("-inf"), tl.float32), mask=head_ok)
        return

    d = tl.arange(0, D)
    rows = row * heads + q_heads
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0).to(DTYPE)
    q_raw_row = q_raw_ptr + row * heads * D
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * s_bt
    n = tl.arange(0, BLOCK_N)
    for start in range(begin, end, BLOCK_N):
        base, valid = tile_base(bt_row, s_bm, start, end, n, kv_head, s_blk, s_pos, s_head, BLOCK_SIZE, False)
        scores = general_scores(q, q_raw_row, q_heads, head_ok, cache_ptr, cent_ptr, rot_ptr, base, valid, s_byte, D,
                                KEY_BITS, KEY_WIDE, KEY_CODE_BYTES, OUTLIERS, KC, KCW, DTYPE, PRECISION)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(scores, m_i, l_i)
        unit = unit_vectors(cache_ptr, cent_ptr, base, valid, s_byte, VALUE_OFFSET, VALUE_BITS, VALUE_WIDE, VC,
                            VCW, D)
        vnorm = load_fp16(cache_ptr, base + (VALUE_OFFSET + VALUE_CODE_BYTES) * s_byte, valid)
        acc = tl.dot((p * vnorm[None, :]).to(DTYPE), unit.to(DTYPE), acc * alpha[:, None],
                     input_precision=PRECISION)
    tl.store(part_out_ptr + part[:, None] * D + d[None, :], acc / l_i[:, None], mask=head_ok[:, None])
    tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=head_ok)


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, preset: Preset,
                     rotation: torch.Tensor, centroids: torch.Tensor, offsets: dict,
                     block_n: int | None = None) -> torch.Tensor:
    """As ``triton_attention.decode_attention`` for a preset of ours (tables from
    :func:`~tqkv_compile.lowerings.general_fields.tables`)."""
    rows, heads, dim = query.shape
    kv_heads = kv_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(query)
    if rows == 0:
        return out
    interpret = query.device.type == "cpu"
    block_n = block_n or (16 if interpret else 32)
    max_len = block_table.shape[1] * kv_cache.shape[1]  # positions the block table can address
    splits = num_splits(rows, kv_heads, max_len, query.device, block_n)
    q_raw = (query.float() * (scale * LOG2E)).contiguous()
    q = torch.matmul(q_raw, rotation).contiguous()
    part_out = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=query.device)
    num_seqs = seq_lens.shape[0]
    _general_decode_kernel[(rows, kv_heads, splits)](
        q, q_raw, kv_cache, block_table, seq_lens, query_start_loc, centroids, rotation, part_out, part_lse,
        num_seqs, max_len, *block_table.stride(), *kv_cache.stride(),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_N=block_n, NUM_SPLITS=splits, SEARCH_STEPS=max(1, math.ceil(math.log2(num_seqs + 1))),
        KEY_BITS=preset.key_bits, KEY_WIDE=preset.key_wide_coords, KEY_CODE_BYTES=preset.key_code_bytes,
        OUTLIERS=preset.key_outliers, VALUE_BITS=preset.value_bits, VALUE_WIDE=preset.value_wide_coords,
        VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes,
        KC=offsets["KC"], KCW=offsets["KCW"], VC=offsets["VC"], VCW=offsets["VCW"], DOT_FP32=interpret,
        num_warps=4,
    )
    rotated = torch.empty(rows, heads, dim, dtype=torch.float32, device=query.device)
    merge(part_out, part_lse, rotated)
    return torch.matmul(rotated, rotation).to(query.dtype)  # back from the rotated basis (H is symmetric)
