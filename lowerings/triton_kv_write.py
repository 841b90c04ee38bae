"""Triton ``kv_write``: quantize, pack and scatter K/V into the packed TurboQuant cache (vLLM's bytes).

One program quantizes ``BLOCK_M`` (token, kv head) rows. Keys (Lloyd-Max presets): ``||k||``, the unit key
rotated by a dot with the fp32 Hadamard matrix (tf32x3: fp32-accurate on the tensor cores, chunked
over output columns), each coordinate's
code = the number of midpoints <= it (a tie takes the upper centroid), codes packed little-endian, then
``||k||`` as fp16. Keys (fp8 preset): the key clamped to +-448 and rounded to e4m3. Values: asymmetric
uniform codes, packed, then scale and min as fp16. Divisions and square roots are IEEE-rounded
(``div_rn`` / ``sqrt_rn``) so the bytes match :meth:`tqkv_compile.codec.Preset.encode`.

Rows whose slot is negative are skipped. The cache is addressed by its four strides (any view).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import FP8_MAX, Preset
from tqkv_compile.lowerings.triton_attention import require_vllm_layout


@triton.jit
def _store_fp16(cache_ptr, byte_addr, x, keep):
    """Store fp32 x [BLOCK_M] as little-endian fp16 at byte_addr [BLOCK_M] (two byte stores)."""
    bits = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(cache_ptr + byte_addr, (bits & 0xFF).to(tl.uint8), mask=keep)
    tl.store(cache_ptr + byte_addr + 1, (bits >> 8).to(tl.uint8), mask=keep)


@triton.jit
def _fp8e4m3_bits(x):
    """fp32 x with |x| <= 448 -> e4m3fn bits (int32), round to nearest even, like torch's cast.
    Done in integer arithmetic: the Triton interpreter's own fp8 cast mis-rounds across a binade."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = tl.abs(x)
    mbits = mag.to(tl.int32, bitcast=True)
    mbits = (mbits + 0x7FFFF + ((mbits >> 20) & 1)) & ~0xFFFFF  # keep 3 mantissa bits, ties to even
    normal = (((mbits >> 23) - 120) << 3) | ((mbits >> 20) & 7)
    subnormal = ((mag * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # multiples of 2^-9, ties to even
    return sign | tl.where(mag < 0.015625, subnormal, normal)


@triton.jit
def _store_packed(cache_ptr, byte_addr, s_byte, codes, keep,
                  BITS: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Pack int32 codes [BLOCK_M, WIDTH] (code i at bit i * BITS, BITS <= 8) and store WIDTH * BITS / 8 bytes
    per row."""
    groups = tl.reshape(codes, (BLOCK_M, WIDTH // 8, 8)).to(tl.int64)
    shifts = (tl.arange(0, 8) * BITS).to(tl.int64)
    word = tl.sum(groups << shifts[None, None, :], axis=2)  # 8 codes -> BITS bytes
    BYTES: tl.constexpr = 4 if BITS <= 4 else 8
    j = tl.arange(0, BYTES)
    out = ((word[:, :, None] >> (8 * j).to(tl.int64)[None, None, :]) & 0xFF).to(tl.uint8)
    g = tl.arange(0, WIDTH // 8)
    offs = (g[None, :, None] * BITS + j[None, None, :]) * s_byte
    tl.store(cache_ptr + byte_addr[:, None, None] + offs, out, mask=keep[:, None, None] & (j < BITS)[None, None, :])


@triton.jit
def _write_rows(slot_ptr, n_rows, num_kv_heads, s_blk, s_pos, s_head, BLOCK_SIZE: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """This program's (token, kv head) rows: (token, head, keep, slot byte offset), keep false past the last
    row and for skipped slots (< 0)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = rows < n_rows
    tok = rows // num_kv_heads
    head = rows % num_kv_heads
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (slot >= 0)
    slot = tl.where(keep, slot, 0)
    return tok, head, keep, (slot // BLOCK_SIZE) * s_blk + (slot % BLOCK_SIZE) * s_pos + head.to(tl.int64) * s_head


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, rot_ptr, mid_ptr,
    n_rows, num_kv_heads,
    s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
    s_blk, s_pos, s_head, s_byte,
    FP8_MAX: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr, VALUE_OFFSET: tl.constexpr, VALUE_CODE_BYTES: tl.constexpr, PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
):
    tok, head, keep, base = _write_rows(slot_ptr, n_rows, num_kv_heads, s_blk, s_pos, s_head, BLOCK_SIZE, BLOCK_M)

    d = tl.arange(0, D)
    k = tl.load(key_ptr + tok[:, None].to(tl.int64) * s_kt + head[:, None] * s_kh + d[None, :] * s_kd,
                mask=keep[:, None], other=0.0).to(tl.float32)
    if KEY_FP8:
        k8 = _fp8e4m3_bits(tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)).to(tl.uint8)
        tl.store(cache_ptr + base[:, None] + d[None, :] * s_byte, k8, mask=keep[:, None])
    else:
        norm = tl.sqrt_rn(tl.sum(k * k, axis=1))
        unit = tl.div_rn(k, (norm + 1e-8)[:, None])
        r = tl.arange(0, BLOCK_R)
        for c0 in tl.static_range(0, D, BLOCK_R):
            rot = tl.load(rot_ptr + d[:, None] * D + (c0 + r)[None, :])
            y = tl.dot(unit, rot, input_precision="tf32x3")
            codes = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.int32)
            for i in tl.static_range((1 << KEY_BITS) - 1):
                codes += (y >= tl.load(mid_ptr + i)).to(tl.int32)
            _store_packed(cache_ptr, base + (c0 * KEY_BITS // 8) * s_byte, s_byte, codes, keep,
                          KEY_BITS, BLOCK_M, BLOCK_R)
        _store_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, norm, keep)

    v = tl.load(value_ptr + tok[:, None].to(tl.int64) * s_vt + head[:, None] * s_vh + d[None, :] * s_vd,
                mask=keep[:, None], other=0.0).to(tl.float32)
    top: tl.constexpr = (1 << VALUE_BITS) - 1
    low = tl.min(v, axis=1)
    scale = tl.div_rn(tl.max(v, axis=1) - low, top * 1.0)
    scale = tl.where(scale > 1e-8, scale, 1e-8)
    vcodes = (tl.div_rn(v - low[:, None], scale[:, None]) + 0.5).to(tl.int32)
    vcodes = tl.minimum(tl.maximum(vcodes, 0), top)
    vbase = base + VALUE_OFFSET * s_byte
    _store_packed(cache_ptr, vbase, s_byte, vcodes, keep, VALUE_BITS, BLOCK_M, D)
    _store_fp16(cache_ptr, vbase + VALUE_CODE_BYTES * s_byte, scale, keep)
    _store_fp16(cache_ptr, vbase + (VALUE_CODE_BYTES + 2) * s_byte, low, keep)
    if PAD:
        tl.store(cache_ptr + vbase + (VALUE_CODE_BYTES + 4) * s_byte, tl.zeros_like(tok).to(tl.uint8), mask=keep)


def kv_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             preset: Preset, rotation: torch.Tensor, midpoints: torch.Tensor, launch=None) -> None:
    """key, value [T, Hk, D]; kv_cache u8 [NB, BS, Hk, S] (any strides); slot_mapping int [T].
    rotation: fp32 [D, D] contiguous; midpoints: fp32 [2^key_bits - 1] (unused for fp8 keys).
    launch: wraps the kernel before its launch (``torch.library.wrap_triton`` when traced for Inductor)."""
    require_vllm_layout(preset)
    tokens, heads, dim = key.shape
    rows = tokens * heads
    if rows == 0:
        return
    if preset.key_fp8:
        # no dot on fp8 keys, so any row count per program works: few rows (a decode step's 64 tokens x 8 kv
        # heads) get programs of 4 rows, enough to spread over the GPU; many rows keep 16
        from tqkv_compile.lowerings.triton_attention import _sm_count

        block_m = int(min(16, max(4, triton.next_power_of_2(max(rows // (2 * _sm_count(key.device)), 1)))))
    else:
        block_m = 32  # the rotation is a tf32 dot: at least 16 rows
    block_r = min(dim, 64)
    pad = preset.slot_bytes - preset.key_bytes - preset.value_bytes
    grid = (triton.cdiv(rows, block_m),)
    kernel = _kv_write_kernel if launch is None else launch(_kv_write_kernel)
    kernel[grid](
        key, value, kv_cache, slot_mapping, rotation, midpoints,
        rows, heads,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        FP8_MAX=FP8_MAX, D=dim, BLOCK_SIZE=kv_cache.shape[1],
        KEY_FP8=preset.key_fp8, KEY_BITS=preset.key_bits, KEY_CODE_BYTES=preset.key_code_bytes,
        VALUE_BITS=preset.value_bits, VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes,
        PAD=pad,
        BLOCK_M=block_m, BLOCK_R=block_r,
        num_warps=4,
    )
