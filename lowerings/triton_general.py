"""Triton kernels for the presets of ours (``tqkv_compile.codec.OWN_PRESETS``): any Lloyd-Max layout.

The presets of ours code keys *and* values like vLLM's Lloyd-Max keys (rotated unit vector, centroid codes,
fp16 norm), with options vLLM's kernels do not know: widths of 2 to 5 bits, a leading run of "wide"
coordinates at one bit more (fractional widths), and the key's largest channel stored apart (uint8 index,
fp8 value). These kernels read and write that layout in one generic way:

- ``kv_write``: norm, rotation (tf32x3 dot, in 16-column chunks so that no chunk straddles the wide / narrow
  boundary), codes by counting midpoints, packed in groups of 8 codes; the outlier channel is found, stored and
  zeroed before the key is coded. Bytes equal :meth:`Preset.encode` (same IEEE-rounded divisions as
  ``triton_kv_write``).
- ``attention`` (split-KV + the shared merge kernel): every code is read through a 16-bit window at its own bit
  offset and looked up by a gather in one concatenated centroid table; scores are ``norm * <q H, unit>``, plus,
  for an outlier channel ``i``, ``q_i * (stored value - the rest's reconstruction at i)`` (the codec *replaces*
  that channel); values accumulate in the rotated basis and the merged output is rotated back once.
- ``kv_dot``: the same scores, fp32.
- ``decode_slots``: the prefill path's dense keys (rotated basis x norm, outlier put back) and values (rotated
  back by a dot in 16-column chunks), as the codec decodes them.

They are written for correctness and coverage (tests run them under ``TRITON_INTERPRET=1`` against the
reference backend). On a GPU the write, attention and kv_dot kernels agreed with the reference at heads 64 and
128, slowly (untuned; docs/performance-history.md); ``decode_slots`` has not run on a GPU yet.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tqkv_compile import lloyd_max
from tqkv_compile.codec import FP8_MAX, Preset
from tqkv_compile.lowerings.decode_merge import merge
from tqkv_compile.lowerings.device_helpers import LOG2E, load_fp16, softmax_step, split_span, tile_base
from tqkv_compile.lowerings.launch_choices import num_splits
from tqkv_compile.lowerings.triton_dequant import dense_outputs
from tqkv_compile.lowerings.triton_kv_dot import _logit_tile, _store_logits
from tqkv_compile.lowerings.triton_kv_write import _fp8e4m3_bits, _store_fp16, _store_packed, _write_rows, few_rows

CHUNK = 16  # rotation / packing chunk: divides every wide run (a multiple of 16 coordinates at head >= 64)


def supports(preset: Preset) -> bool:
    """Lloyd-Max keys and values, at most one outlier channel, wide runs in whole chunks."""
    return (not preset.key_fp8 and preset.value_lloyd_max and preset.norm_correction and preset.key_outliers <= 1
            and preset.key_wide_coords % CHUNK == 0 and preset.value_wide_coords % CHUNK == 0
            and max(preset.key_bits, preset.value_bits) + 1 <= 8)


def tables(preset: Preset, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(centroids, midpoints, offsets): fp32 tables concatenated as [key b | key b+1 | value b | value b+1]
    and the constexpr offsets of each part."""
    d = preset.head_dim
    kb, vb = preset.key_bits, preset.value_bits
    cents = [lloyd_max.centroids(d, b) for b in (kb, kb + 1, vb, vb + 1)]
    mids = [lloyd_max.midpoints(d, b) for b in (kb, kb + 1, vb, vb + 1)]
    c_off = [0, *torch.tensor([c.numel() for c in cents]).cumsum(0).tolist()[:-1]]
    m_off = [0, *torch.tensor([m.numel() for m in mids]).cumsum(0).tolist()[:-1]]
    offsets = dict(KC=c_off[0], KCW=c_off[1], VC=c_off[2], VCW=c_off[3],
                   KM=m_off[0], KMW=m_off[1], VM=m_off[2], VMW=m_off[3])
    return torch.cat(cents).float().to(device), torch.cat(mids).float().to(device), offsets


# -- write ------------------------------------------------------------------------------------------------


@triton.jit
def _code_chunk(y, mid_ptr, MID_OFF: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Codes of y [BLOCK_M, CHUNK]: the number of midpoints <= y (a tie takes the upper centroid)."""
    codes = tl.zeros((BLOCK_M, 16), dtype=tl.int32)
    for i in tl.static_range((1 << BITS) - 1):
        codes += (y >= tl.load(mid_ptr + MID_OFF + i)).to(tl.int32)
    return codes


@triton.jit
def _encode_lloyd_max(x, rot_ptr, mid_ptr, cache_ptr, base, s_byte, keep,
                      START: tl.constexpr, BITS: tl.constexpr, WIDE: tl.constexpr, MID_OFF: tl.constexpr,
                      MIDW_OFF: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Code x [BLOCK_M, D] at byte START of each slot: wide codes, narrow codes; returns ||x|| (stored by
    the caller after the codes)."""
    norm = tl.sqrt_rn(tl.sum(x * x, axis=1))
    unit = tl.div_rn(x, (norm + 1e-8)[:, None])
    d = tl.arange(0, D)
    r = tl.arange(0, 16)
    for c0 in tl.static_range(0, D, 16):
        rot = tl.load(rot_ptr + d[:, None] * D + (c0 + r)[None, :])
        y = tl.dot(unit, rot, input_precision="tf32x3")
        if c0 < WIDE:
            codes = _code_chunk(y, mid_ptr, MIDW_OFF, BITS + 1, BLOCK_M)
            _store_packed(cache_ptr, base + (START + c0 * (BITS + 1) // 8) * s_byte, s_byte, codes, keep,
                          BITS + 1, BLOCK_M, 16)
        else:
            codes = _code_chunk(y, mid_ptr, MID_OFF, BITS, BLOCK_M)
            _store_packed(cache_ptr, base + (START + WIDE * (BITS + 1) // 8 + (c0 - WIDE) * BITS // 8) * s_byte,
                          s_byte, codes, keep, BITS, BLOCK_M, 16)
    return norm


@triton.jit
def _general_kv_write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, rot_ptr, mid_ptr,
    n_rows, num_kv_heads,
    s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
    s_blk, s_pos, s_head, s_byte,
    FP8_MAX: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KEY_BITS: tl.constexpr, KEY_WIDE: tl.constexpr, KEY_CODE_BYTES: tl.constexpr, OUTLIERS: tl.constexpr,
    VALUE_BITS: tl.constexpr, VALUE_WIDE: tl.constexpr, VALUE_OFFSET: tl.constexpr,
    VALUE_CODE_BYTES: tl.constexpr, PAD: tl.constexpr,
    KM: tl.constexpr, KMW: tl.constexpr, VM: tl.constexpr, VMW: tl.constexpr,
    BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
):
    """SPLIT: grid (row blocks, 2), program (i, 0) writes the keys, (i, 1) the values (few rows: a program's
    latency is the kernel's time); else grid (row blocks, 1), whole slots."""
    tok, head, keep, base = _write_rows(slot_ptr, n_rows, num_kv_heads, s_blk, s_pos, s_head, BLOCK_SIZE, BLOCK_M)
    if not SPLIT or tl.program_id(1) == 0:
        _general_write_keys(key_ptr, cache_ptr, rot_ptr, mid_ptr, tok, head, keep, base, s_kt, s_kh, s_kd, s_byte,
                            FP8_MAX, D, KEY_BITS, KEY_WIDE, KEY_CODE_BYTES, OUTLIERS, KM, KMW, BLOCK_M)
    if not SPLIT or tl.program_id(1) == 1:
        _general_write_values(value_ptr, cache_ptr, rot_ptr, mid_ptr, tok, head, keep, base, s_vt, s_vh, s_vd,
                              s_byte, D, VALUE_BITS, VALUE_WIDE, VALUE_OFFSET, VALUE_CODE_BYTES, PAD, VM, VMW,
                              BLOCK_M)


@triton.jit
def _general_write_keys(key_ptr, cache_ptr, rot_ptr, mid_ptr, tok, head, keep, base, s_kt, s_kh, s_kd, s_byte,
                        FP8_MAX: tl.constexpr, D: tl.constexpr, KEY_BITS: tl.constexpr, KEY_WIDE: tl.constexpr,
                        KEY_CODE_BYTES: tl.constexpr, OUTLIERS: tl.constexpr, KM: tl.constexpr,
                        KMW: tl.constexpr, BLOCK_M: tl.constexpr):
    d = tl.arange(0, D)
    k = tl.load(key_ptr + tok[:, None].to(tl.int64) * s_kt + head[:, None] * s_kh + d[None, :] * s_kd,
                mask=keep[:, None], other=0.0).to(tl.float32)
    if OUTLIERS:
        # the largest-magnitude channel (the first of equals), stored apart and zeroed before coding
        mag = tl.abs(k)
        top = tl.max(mag, axis=1)
        index = tl.min(tl.where(mag == top[:, None], d[None, :], D), axis=1)
        hit = d[None, :] == index[:, None]
        outlier = tl.sum(tl.where(hit, k, 0.0), axis=1)
        k = tl.where(hit, 0.0, k)
    norm = _encode_lloyd_max(k, rot_ptr, mid_ptr, cache_ptr, base, s_byte, keep, 0, KEY_BITS, KEY_WIDE, KM, KMW,
                             D, BLOCK_M)
    _store_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, norm, keep)
    if OUTLIERS:
        tl.store(cache_ptr + base + (KEY_CODE_BYTES + 2) * s_byte, index.to(tl.uint8), mask=keep)
        fp8 = _fp8e4m3_bits(tl.minimum(tl.maximum(outlier, -FP8_MAX), FP8_MAX)).to(tl.uint8)
        tl.store(cache_ptr + base + (KEY_CODE_BYTES + 3) * s_byte, fp8, mask=keep)


@triton.jit
def _general_write_values(value_ptr, cache_ptr, rot_ptr, mid_ptr, tok, head, keep, base, s_vt, s_vh, s_vd, s_byte,
                          D: tl.constexpr, VALUE_BITS: tl.constexpr, VALUE_WIDE: tl.constexpr,
                          VALUE_OFFSET: tl.constexpr, VALUE_CODE_BYTES: tl.constexpr, PAD: tl.constexpr,
                          VM: tl.constexpr, VMW: tl.constexpr, BLOCK_M: tl.constexpr):
    d = tl.arange(0, D)
    v = tl.load(value_ptr + tok[:, None].to(tl.int64) * s_vt + head[:, None] * s_vh + d[None, :] * s_vd,
                mask=keep[:, None], other=0.0).to(tl.float32)
    vnorm = _encode_lloyd_max(v, rot_ptr, mid_ptr, cache_ptr, base, s_byte, keep, VALUE_OFFSET, VALUE_BITS,
                              VALUE_WIDE, VM, VMW, D, BLOCK_M)
    _store_fp16(cache_ptr, base + (VALUE_OFFSET + VALUE_CODE_BYTES) * s_byte, vnorm, keep)
    if PAD:
        tl.store(cache_ptr + base + (VALUE_OFFSET + VALUE_CODE_BYTES + 2) * s_byte, tl.zeros_like(tok).to(tl.uint8),
                 mask=keep)


def kv_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             preset: Preset, rotation: torch.Tensor, midpoints: torch.Tensor, offsets: dict) -> None:
    """As ``triton_kv_write.kv_write`` for a preset of ours (``midpoints`` / ``offsets`` from :func:`tables`)."""
    tokens, heads, dim = key.shape
    rows = tokens * heads
    if rows == 0:
        return
    block_m = 16
    split = few_rows(rows, key.device)  # keys and values in programs of their own
    _general_kv_write_kernel[(triton.cdiv(rows, block_m), 2 if split else 1)](
        key, value, kv_cache, slot_mapping, rotation, midpoints, rows, heads,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        FP8_MAX=FP8_MAX, D=dim, BLOCK_SIZE=kv_cache.shape[1],
        KEY_BITS=preset.key_bits, KEY_WIDE=preset.key_wide_coords, KEY_CODE_BYTES=preset.key_code_bytes,
        OUTLIERS=preset.key_outliers, VALUE_BITS=preset.value_bits, VALUE_WIDE=preset.value_wide_coords,
        VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes,
        PAD=preset.slot_bytes - preset.key_bytes - preset.value_bytes,
        KM=offsets["KM"], KMW=offsets["KMW"], VM=offsets["VM"], VMW=offsets["VMW"], BLOCK_M=block_m, SPLIT=split,
        num_warps=4,
    )


# -- read -------------------------------------------------------------------------------------------------


@triton.jit
def _unit_vectors(cache_ptr, cent_ptr, base, valid, s_byte, START: tl.constexpr, BITS: tl.constexpr,
                  WIDE: tl.constexpr, C_OFF: tl.constexpr, CW_OFF: tl.constexpr, D: tl.constexpr):
    """The Lloyd-Max part at byte START -> norm-corrected unit vectors [N, D] (rotated basis): each code read
    through a 16-bit window at its bit offset, its centroid gathered from the concatenated table."""
    c = tl.arange(0, D)
    wide = c < WIDE
    width = tl.where(wide, BITS + 1, BITS)
    bit = tl.where(wide, c * (BITS + 1), WIDE * (BITS + 1) + (c - WIDE) * BITS)
    shift = bit & 7
    addr = cache_ptr + base[:, None] + (START + (bit >> 3))[None, :] * s_byte
    lo = tl.load(addr, mask=valid[:, None], other=0).to(tl.int32)
    hi = tl.load(addr + s_byte, mask=valid[:, None] & (shift + width > 8)[None, :], other=0).to(tl.int32)
    mask = tl.where(wide, (1 << (BITS + 1)) - 1, (1 << BITS) - 1)
    code = ((lo | (hi << 8)) >> shift[None, :]) & mask[None, :]
    unit = tl.load(cent_ptr + code + tl.where(wide, CW_OFF, C_OFF)[None, :])
    return unit / tl.sqrt(tl.sum(unit * unit, axis=1) + 1e-16)[:, None]


@triton.jit
def _scores(q, q_raw_ptr, q_heads, head_ok, cache_ptr, cent_ptr, rot_ptr, base, valid, s_byte,
            D: tl.constexpr, KEY_BITS: tl.constexpr, KEY_WIDE: tl.constexpr, KEY_CODE_BYTES: tl.constexpr,
            OUTLIERS: tl.constexpr, KC: tl.constexpr, KCW: tl.constexpr, DTYPE: tl.constexpr,
            PRECISION: tl.constexpr):
    """Logits [BLOCK_H, N] of the query group (q: rotated, scaled, DTYPE; q_raw_ptr: the same query scaled, in
    the original basis, rows q_heads * D) against N keys of a preset of ours."""
    unit = _unit_vectors(cache_ptr, cent_ptr, base, valid, s_byte, 0, KEY_BITS, KEY_WIDE, KC, KCW, D)
    norm = load_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, valid)
    scores = tl.dot(q, tl.trans(unit.to(DTYPE)), input_precision=PRECISION) * norm[None, :]
    if OUTLIERS:
        # (& (D - 1): a slot no kv_write filled, e.g. a garbage byte, still indexes inside the tables)
        index = tl.load(cache_ptr + base + (KEY_CODE_BYTES + 2) * s_byte, mask=valid, other=0).to(tl.int32) & (D - 1)
        raw = tl.load(cache_ptr + base + (KEY_CODE_BYTES + 3) * s_byte, mask=valid, other=0)
        stored = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        # the rest's reconstruction at that channel, norm * <unit, H[:, i]>, is replaced by the stored value
        d = tl.arange(0, D)
        column = tl.load(rot_ptr + d[None, :] * D + index[:, None])
        rest = tl.sum(unit * column, axis=1) * norm
        q_i = tl.load(q_raw_ptr + q_heads[:, None] * D + index[None, :], mask=head_ok[:, None], other=0.0)
        scores += q_i * (stored - rest)[None, :]
    return scores


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
        scores = _scores(q, q_raw_row, q_heads, head_ok, cache_ptr, cent_ptr, rot_ptr, base, valid, s_byte, D,
                         KEY_BITS, KEY_WIDE, KEY_CODE_BYTES, OUTLIERS, KC, KCW, DTYPE, PRECISION)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(scores, m_i, l_i)
        unit = _unit_vectors(cache_ptr, cent_ptr, base, valid, s_byte, VALUE_OFFSET, VALUE_BITS, VALUE_WIDE, VC,
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
    """As ``triton_attention.decode_attention`` for a preset of ours (tables from :func:`tables`)."""
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


@triton.jit
def _general_kv_dot_kernel(
    q_ptr, q_raw_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, cent_ptr, rot_ptr, out_ptr, width,
    s_bt, s_bm, s_blk, s_pos, s_head, s_byte, s_ob, s_oh, s_on,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    KEY_BITS: tl.constexpr, KEY_WIDE: tl.constexpr, KEY_CODE_BYTES: tl.constexpr, OUTLIERS: tl.constexpr,
    KC: tl.constexpr, KCW: tl.constexpr,
):
    seq, q_heads, head_ok, pos, valid, base = _logit_tile(block_table_ptr, seq_lens_ptr, s_bt, s_bm, s_blk, s_pos,
                                                          s_head, GROUP, BLOCK_H, BLOCK_SIZE, BLOCK_N)
    heads = GROUP * tl.num_programs(1)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (seq * heads + q_heads)[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0)
    logits = _scores(q, q_raw_ptr + seq * heads * D, q_heads, head_ok, cache_ptr, cent_ptr, rot_ptr, base, valid,
                     s_byte, D, KEY_BITS, KEY_WIDE, KEY_CODE_BYTES, OUTLIERS, KC, KCW, tl.float32, "ieee")
    _store_logits(out_ptr, logits, seq, q_heads, head_ok, pos, valid, width, s_ob, s_oh, s_on)


def kv_dot(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           scale: float, preset: Preset, rotation: torch.Tensor, centroids: torch.Tensor, offsets: dict) -> torch.Tensor:
    """As ``triton_kv_dot.kv_dot`` for a preset of ours."""
    batch, heads, dim = query.shape
    kv_heads = kv_cache.shape[2]
    width = block_table.shape[1] * kv_cache.shape[1]
    out = torch.empty(batch, heads, width, dtype=torch.float32, device=query.device)
    if batch == 0 or width == 0:
        return out
    q_raw = (query.float() * scale).contiguous()
    q = torch.matmul(q_raw, rotation).contiguous()
    block_n = 32
    group = heads // kv_heads
    _general_kv_dot_kernel[(batch, kv_heads, triton.cdiv(width, block_n))](
        q, q_raw, kv_cache, block_table, seq_lens, centroids, rotation, out, width,
        *block_table.stride(), *kv_cache.stride(), *out.stride(),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_N=block_n, KEY_BITS=preset.key_bits, KEY_WIDE=preset.key_wide_coords,
        KEY_CODE_BYTES=preset.key_code_bytes, OUTLIERS=preset.key_outliers,
        KC=offsets["KC"], KCW=offsets["KCW"], num_warps=4,
    )
    return out


# -- dense decode (the prefill path) ----------------------------------------------------------------------


@triton.jit
def _general_dequant_kernel(
    cache_ptr, slot_ptr, cent_ptr, rot_ptr, key_ptr, value_ptr,
    n_rows, num_kv_heads,
    s_blk, s_pos, s_head, s_byte,
    D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KEY_BITS: tl.constexpr, KEY_WIDE: tl.constexpr, KEY_CODE_BYTES: tl.constexpr, OUTLIERS: tl.constexpr,
    VALUE_BITS: tl.constexpr, VALUE_WIDE: tl.constexpr, VALUE_OFFSET: tl.constexpr,
    VALUE_CODE_BYTES: tl.constexpr, KC: tl.constexpr, KCW: tl.constexpr, VC: tl.constexpr, VCW: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """BLOCK_M (position, kv head) slots -> keys in the rotated basis times their norm (the outlier channel put
    back: ``+ (stored - rest) * H[i, :]``) and values rotated back to the original basis (a dot with the
    rotation in 16-column chunks, fp32-accurate), as ``Preset.decode_keys_rotated`` / ``decode_values``."""
    tok, head, keep, base = _write_rows(slot_ptr, n_rows, num_kv_heads, s_blk, s_pos, s_head, BLOCK_SIZE, BLOCK_M)
    d = tl.arange(0, D)
    row = tok.to(tl.int64) * num_kv_heads + head

    unit = _unit_vectors(cache_ptr, cent_ptr, base, keep, s_byte, 0, KEY_BITS, KEY_WIDE, KC, KCW, D)
    norm = load_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, keep)
    keys = unit * norm[:, None]
    if OUTLIERS:
        index = tl.load(cache_ptr + base + (KEY_CODE_BYTES + 2) * s_byte, mask=keep, other=0).to(tl.int32) & (D - 1)
        raw = tl.load(cache_ptr + base + (KEY_CODE_BYTES + 3) * s_byte, mask=keep, other=0)
        stored = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        column = tl.load(rot_ptr + index[:, None] * D + d[None, :])  # row i of H (symmetric: its column i)
        keys += (stored - tl.sum(keys * column, axis=1))[:, None] * column
    tl.store(key_ptr + row[:, None] * D + d[None, :], keys.to(key_ptr.dtype.element_ty), mask=keep[:, None])

    unit = _unit_vectors(cache_ptr, cent_ptr, base, keep, s_byte, VALUE_OFFSET, VALUE_BITS, VALUE_WIDE, VC, VCW, D)
    stored_basis = unit * load_fp16(cache_ptr, base + (VALUE_OFFSET + VALUE_CODE_BYTES) * s_byte, keep)[:, None]
    r = tl.arange(0, 16)
    for c0 in tl.static_range(0, D, 16):
        rot = tl.load(rot_ptr + d[:, None] * D + (c0 + r)[None, :])
        values = tl.dot(stored_basis, rot, input_precision=PRECISION)
        tl.store(value_ptr + row[:, None] * D + (c0 + r)[None, :], values.to(value_ptr.dtype.element_ty),
                 mask=keep[:, None])


def decode_slots(kv_cache: torch.Tensor, slots: torch.Tensor, preset: Preset, rotation: torch.Tensor,
                 centroids: torch.Tensor, offsets: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``triton_dequant.decode_slots`` for a preset of ours (tables from :func:`tables`): keys in the stored
    basis times their norm, values in the original basis, ``dtype`` [T, Hk, D]."""
    keys, values = dense_outputs(kv_cache, slots, preset, dtype)
    rows, heads, dim = keys.shape[0] * keys.shape[1], keys.shape[1], preset.head_dim
    if rows == 0:
        return keys, values
    block_m = 16  # the value rotation is a dot: at least 16 rows
    # the rotation's precision: tf32 (~2^-11) is below bf16's rounding; tf32x3 (fp32-accurate) for fp16 / fp32,
    # at a register cost (sm_90a, Triton 3.9: 255 registers + stack at head 128, 4 KB of stack at 256)
    precision = "ieee" if kv_cache.device.type == "cpu" else ("tf32" if dtype == torch.bfloat16 else "tf32x3")
    _general_dequant_kernel[(triton.cdiv(rows, block_m),)](
        kv_cache, slots.contiguous(), centroids, rotation, keys, values, rows, heads, *kv_cache.stride(),
        D=dim, BLOCK_SIZE=kv_cache.shape[1],
        KEY_BITS=preset.key_bits, KEY_WIDE=preset.key_wide_coords, KEY_CODE_BYTES=preset.key_code_bytes,
        OUTLIERS=preset.key_outliers, VALUE_BITS=preset.value_bits, VALUE_WIDE=preset.value_wide_coords,
        VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes,
        KC=offsets["KC"], KCW=offsets["KCW"], VC=offsets["VC"], VCW=offsets["VCW"],
        PRECISION=precision, BLOCK_M=block_m, num_warps=4,
    )
    return keys, values
