"""The general path's fields: the presets of ours (``tqkv_compile.codec.OWN_PRESETS``), any Lloyd-Max layout.

The presets of ours code keys *and* values like vLLM's Lloyd-Max keys (rotated unit vector, centroid codes,
fp16 norm), with options vLLM's kernels do not know: widths of 2 to 5 bits, a leading run of "wide"
coordinates at one bit more (fractional widths), and the key's largest channel stored apart (uint8 index,
fp8 value). The general kernels read and write that layout in one generic way, each in a file with its launch:

- :mod:`~tqkv_compile.lowerings.general_kv_write` (``kv_write``): norm, rotation (tf32x3 dot, in 16-column
  chunks so that no chunk straddles the wide / narrow boundary), codes by counting midpoints, packed in groups
  of 8 codes; the outlier channel is found, stored and zeroed before the key is coded. Bytes equal
  :meth:`Preset.encode` (same IEEE-rounded divisions as ``triton_kv_write``).
- :mod:`~tqkv_compile.lowerings.general_decode` (``decode_attention``: split-KV + the shared merge kernel):
  every code is read through a 16-bit window at its own bit offset and looked up by a gather in one
  concatenated centroid table; scores are ``norm * <q H, unit>``, plus, for an outlier channel ``i``,
  ``q_i * (stored value - the rest's reconstruction at i)`` (the codec *replaces* that channel); values
  accumulate in the rotated basis and the merged output is rotated back once.
- :mod:`~tqkv_compile.lowerings.general_kv_dot` (``kv_dot``): the same scores, fp32.
- :mod:`~tqkv_compile.lowerings.general_dequant` (``decode_slots``): the prefill path's dense keys (rotated
  basis x norm, outlier put back) and values (rotated back by a dot in 16-column chunks), as the codec decodes
  them.

This module holds what they share: which presets they serve (:func:`supports`), the concatenated centroid and
midpoint tables (:func:`tables`), and the device functions that read the fields (:func:`unit_vectors`,
:func:`general_scores`). What they share with the kernels of vLLM's layouts (a program's rows and logit tile,
fp16 loads and stores, code packing, the fp8 encoding) is in :mod:`~tqkv_compile.lowerings.device_helpers`.

They are written for correctness and coverage (tests run them under ``TRITON_INTERPRET=1`` against the
reference backend). On a GPU the write, attention and kv_dot kernels agreed with the reference at heads 64 and
128, slowly (untuned; docs/performance-history.md); ``decode_slots`` has not run on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile import lloyd_max
from tqkv_compile.codec import Preset
from tqkv_compile.lowerings.device_helpers import load_fp16

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


# -- reading the fields -----------------------------------------------------------------------------------


@triton.jit
def unit_vectors(cache_ptr, cent_ptr, base, valid, s_byte, START: tl.constexpr, BITS: tl.constexpr,
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
def general_scores(q, q_raw_ptr, q_heads, head_ok, cache_ptr, cent_ptr, rot_ptr, base, valid, s_byte,
                   D: tl.constexpr, KEY_BITS: tl.constexpr, KEY_WIDE: tl.constexpr, KEY_CODE_BYTES: tl.constexpr,
                   OUTLIERS: tl.constexpr, KC: tl.constexpr, KCW: tl.constexpr, DTYPE: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Logits [BLOCK_H, N] of the query group (q: rotated, scaled, DTYPE; q_raw_ptr: the same query scaled, in
    the original basis, rows q_heads * D) against N keys of a preset of ours."""
    unit = unit_vectors(cache_ptr, cent_ptr, base, valid, s_byte, 0, KEY_BITS, KEY_WIDE, KC, KCW, D)
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
