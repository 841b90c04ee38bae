"""The general dequantization kernel: the prefill path's dense keys and values for the presets of ours (the
layout: :mod:`~tqkv_compile.lowerings.general_fields`), as :mod:`~tqkv_compile.lowerings.triton_dequant` is for
vLLM's layouts: keys in the rotated basis times their norm (the outlier channel put back), values rotated back
to the original basis by a dot in 16-column chunks, as the codec decodes them. Not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import Preset
from tqkv_compile.lowerings.device_helpers import load_fp16, write_rows
from tqkv_compile.lowerings.general_fields import unit_vectors
from tqkv_compile.lowerings.triton_dequant import dense_outputs


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
    tok, head, keep, base = write_rows(slot_ptr, n_rows, num_kv_heads, s_blk, s_pos, s_head, BLOCK_SIZE, BLOCK_M)
    d = tl.arange(0, D)
    row = tok.to(tl.int64) * num_kv_heads + head

    unit = unit_vectors(cache_ptr, cent_ptr, base, keep, s_byte, 0, KEY_BITS, KEY_WIDE, KC, KCW, D)
    norm = load_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, keep)
    keys = unit * norm[:, None]
    if OUTLIERS:
        index = tl.load(cache_ptr + base + (KEY_CODE_BYTES + 2) * s_byte, mask=keep, other=0).to(tl.int32) & (D - 1)
        raw = tl.load(cache_ptr + base + (KEY_CODE_BYTES + 3) * s_byte, mask=keep, other=0)
        stored = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        column = tl.load(rot_ptr + index[:, None] * D + d[None, :])  # row i of H (symmetric: its column i)
        keys += (stored - tl.sum(keys * column, axis=1))[:, None] * column
    tl.store(key_ptr + row[:, None] * D + d[None, :], keys.to(key_ptr.dtype.element_ty), mask=keep[:, None])

    unit = unit_vectors(cache_ptr, cent_ptr, base, keep, s_byte, VALUE_OFFSET, VALUE_BITS, VALUE_WIDE, VC, VCW, D)
    stored_basis = unit * load_fp16(cache_ptr, base + (VALUE_OFFSET + VALUE_CODE_BYTES) * s_byte, keep)[:, None]
    r = tl.arange(0, 16)
    for c0 in tl.static_range(0, D, 16):
        rot = tl.load(rot_ptr + d[:, None] * D + (c0 + r)[None, :])
        values = tl.dot(stored_basis, rot, input_precision=PRECISION)
        tl.store(value_ptr + row[:, None] * D + (c0 + r)[None, :], values.to(value_ptr.dtype.element_ty),
                 mask=keep[:, None])


def decode_slots(kv_cache: torch.Tensor, slots: torch.Tensor, preset: Preset, rotation: torch.Tensor,
                 centroids: torch.Tensor, offsets: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``triton_dequant.decode_slots`` for a preset of ours (tables from
    :func:`~tqkv_compile.lowerings.general_fields.tables`): keys in the stored
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
