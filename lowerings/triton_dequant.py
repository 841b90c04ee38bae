"""Triton dequantization of cache slots into dense keys and values: the prefill path's input.

A prompt (or a long prefill chunk) attends over its whole context with a tensor-core attention kernel (SDPA /
flash) on dense keys and values, decoded once from the packed cache (:mod:`tqkv_compile.backends.prefill`).
This kernel is that decode for vLLM's four slot layouts: one program turns ``BLOCK_M`` (position, kv head)
slots into keys in the stored basis (rotated unit vector x norm, or the fp8 key as stored) and values, in the
query's dtype, exactly as :func:`tqkv_compile.backends.reference.decoded_keys_values` does in fp32 before its
cast. Every code is read through a 16-bit window at its own bit offset (any width up to 8; the fields are
little-endian runs of ``bits``-bit codes), and key codes are looked up in the centroid table by a gather.

It replaces the codec's PyTorch decode on this path: int64 unpacking, a host-to-device copy of the tables per
call (each a host sync) and a loop over sequences made prefill slower than vLLM's TurboQuant
(docs/performance-history.md). Memory-bound: it reads the slots once and writes 4 bytes per coordinate (bf16
key and value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import Preset
from tqkv_compile.lowerings.cache_tables import require_vllm_layout
from tqkv_compile.lowerings.device_helpers import load_fp16, write_rows


def supports(preset: Preset) -> bool:
    """vLLM's four layouts (Lloyd-Max or fp8 keys, uniform values, no wide runs or outliers), and presets of ours
    laid out as they are (``Preset.vllm_layout``)."""
    return preset.vllm_layout


@triton.jit
def _codes(cache_ptr, base, s_byte, keep, START: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr):
    """int32 codes [BLOCK_M, D] of the BITS-bit field run at byte START of each slot (code d at bit d * BITS)."""
    bit = tl.arange(0, D) * BITS
    byte = bit >> 3
    shift = bit & 7
    addr = cache_ptr + base[:, None] + (START + byte)[None, :] * s_byte
    lo = tl.load(addr, mask=keep[:, None], other=0).to(tl.int32)
    spill = shift + BITS > 8  # the code reaches into the next byte (never past the run: it ends on a code)
    hi = tl.load(addr + s_byte, mask=keep[:, None] & spill[None, :], other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> shift[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _dequant_kernel(
    cache_ptr, slot_ptr, cent_ptr, key_ptr, value_ptr,
    n_rows, num_kv_heads,
    s_blk, s_pos, s_head, s_byte,
    D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    VALUE_BITS: tl.constexpr, VALUE_OFFSET: tl.constexpr, VALUE_CODE_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    tok, head, keep, base = write_rows(slot_ptr, n_rows, num_kv_heads, s_blk, s_pos, s_head, BLOCK_SIZE, BLOCK_M)
    d = tl.arange(0, D)
    out = (tok.to(tl.int64) * num_kv_heads + head)[:, None] * D + d[None, :]  # [T, Hk, D] contiguous

    if KEY_FP8:
        raw = tl.load(cache_ptr + base[:, None] + d[None, :] * s_byte, mask=keep[:, None], other=0)
        keys = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        unit = tl.load(cent_ptr + _codes(cache_ptr, base, s_byte, keep, 0, KEY_BITS, D))
        if NORM_CORRECTION:
            unit = unit / tl.sqrt(tl.sum(unit * unit, axis=1) + 1e-16)[:, None]
        keys = unit * load_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, keep)[:, None]
    tl.store(key_ptr + out, keys.to(key_ptr.dtype.element_ty), mask=keep[:, None])

    codes = _codes(cache_ptr, base, s_byte, keep, VALUE_OFFSET, VALUE_BITS, D)
    scale = load_fp16(cache_ptr, base + (VALUE_OFFSET + VALUE_CODE_BYTES) * s_byte, keep)
    low = load_fp16(cache_ptr, base + (VALUE_OFFSET + VALUE_CODE_BYTES + 2) * s_byte, keep)
    values = codes.to(tl.float32) * scale[:, None] + low[:, None]
    tl.store(value_ptr + out, values.to(value_ptr.dtype.element_ty), mask=keep[:, None])


def dense_outputs(kv_cache: torch.Tensor, slots: torch.Tensor, preset: Preset,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode launchers' (here and ``general_dequant``'s) common start: the cache check (a slot's bytes
    adjacent, as their fp16 fields are read as two adjacent bytes) and the empty contiguous outputs, keys and
    values ``dtype`` [T, Hk, D] (their rows are ``(token, kv head)`` in the kernels' order)."""
    if kv_cache.stride(3) != 1:
        raise ValueError(f"kv_cache: a slot's bytes must be adjacent (last stride 1), got strides {kv_cache.stride()}")
    keys = torch.empty(slots.shape[0], kv_cache.shape[2], preset.head_dim, dtype=dtype, device=kv_cache.device)
    return keys, torch.empty_like(keys)


def decode_slots(kv_cache: torch.Tensor, slots: torch.Tensor, preset: Preset, centroids: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) ``dtype`` [T, Hk, D] of the cache slots ``slots`` (int [T], flat ``block * block_size +
    position``, each >= 0). Keys in the stored basis times their norm (fp8: as stored), values in
    the original basis. kv_cache u8 [NB, BS, Hk, S] (any strides but the last, which must be 1: an fp16 field
    is read as two adjacent bytes); centroids fp32 [2^key_bits] (unused for fp8 keys)."""
    require_vllm_layout(preset)
    keys, values = dense_outputs(kv_cache, slots, preset, dtype)
    rows, heads, dim = keys.shape[0] * keys.shape[1], keys.shape[1], preset.head_dim
    if rows == 0:
        return keys, values
    block_m = 16
    _dequant_kernel[(triton.cdiv(rows, block_m),)](
        kv_cache, slots.contiguous(), centroids, keys, values,
        rows, heads,
        *kv_cache.stride(),
        D=dim, BLOCK_SIZE=kv_cache.shape[1],
        KEY_FP8=preset.key_fp8, KEY_BITS=preset.key_bits, KEY_CODE_BYTES=preset.key_code_bytes,
        NORM_CORRECTION=preset.norm_correction,
        VALUE_BITS=preset.value_bits, VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes,
        BLOCK_M=block_m,
        num_warps=4,
    )
    return keys, values
