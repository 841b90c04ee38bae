"""The general write kernel: ``kv_write`` for the presets of ours (the layout:
:mod:`~tqkv_compile.lowerings.general_fields`). One program codes ``BLOCK_M`` (token, kv head) rows: norm,
rotation (tf32x3 dot, in 16-column chunks so that no chunk straddles the wide / narrow boundary), codes by
counting midpoints, packed in groups of 8 codes; the outlier channel is found, stored and zeroed before the key
is coded. Bytes equal :meth:`Preset.encode` (same IEEE-rounded divisions as ``triton_kv_write``). Few rows (a
decode step): keys and values in programs of their own (:func:`~tqkv_compile.lowerings.triton_kv_write.few_rows`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import FP8_MAX, Preset
from tqkv_compile.lowerings.device_helpers import fp8e4m3_bits, store_fp16, store_packed, write_rows
from tqkv_compile.lowerings.triton_kv_write import few_rows


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
            store_packed(cache_ptr, base + (START + c0 * (BITS + 1) // 8) * s_byte, s_byte, codes, keep,
                         BITS + 1, BLOCK_M, 16)
        else:
            codes = _code_chunk(y, mid_ptr, MID_OFF, BITS, BLOCK_M)
            store_packed(cache_ptr, base + (START + WIDE * (BITS + 1) // 8 + (c0 - WIDE) * BITS // 8) * s_byte,
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
    tok, head, keep, base = write_rows(slot_ptr, n_rows, num_kv_heads, s_blk, s_pos, s_head, BLOCK_SIZE, BLOCK_M)
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
    store_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, norm, keep)
    if OUTLIERS:
        tl.store(cache_ptr + base + (KEY_CODE_BYTES + 2) * s_byte, index.to(tl.uint8), mask=keep)
        fp8 = fp8e4m3_bits(tl.minimum(tl.maximum(outlier, -FP8_MAX), FP8_MAX)).to(tl.uint8)
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
    store_fp16(cache_ptr, base + (VALUE_OFFSET + VALUE_CODE_BYTES) * s_byte, vnorm, keep)
    if PAD:
        tl.store(cache_ptr + base + (VALUE_OFFSET + VALUE_CODE_BYTES + 2) * s_byte, tl.zeros_like(tok).to(tl.uint8),
                 mask=keep)


def kv_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             preset: Preset, rotation: torch.Tensor, midpoints: torch.Tensor, offsets: dict) -> None:
    """As ``triton_kv_write.kv_write`` for a preset of ours (``midpoints`` / ``offsets`` from
    :func:`~tqkv_compile.lowerings.general_fields.tables`)."""
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
