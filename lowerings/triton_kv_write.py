"""Triton ``kv_write``: quantize, pack and scatter K/V into the packed TurboQuant cache (vLLM's bytes).

One program quantizes ``BLOCK_M`` (token, kv head) rows. Keys (Lloyd-Max presets): ``||k||``, the unit key
rotated by a dot with the fp32 Hadamard matrix (tf32x3: fp32-accurate on the tensor cores, chunked
over output columns), each coordinate's
code = the number of midpoints <= it (a tie takes the upper centroid), codes packed little-endian, then
``||k||`` as fp16. Keys (fp8 preset): the key clamped to +-448 and rounded to e4m3. Values: asymmetric
uniform codes, packed, then scale and min as fp16. Divisions and square roots are IEEE-rounded
(``div_rn`` / ``sqrt_rn``) so the bytes match :meth:`tqkv_compile.codec.Preset.encode`.

Rows whose slot is negative are skipped. The cache is addressed by its four strides (any view).

Launch shape (:func:`launch_shape`): many rows, one program per block of 32 rows writes whole slots. Few rows
(a decode step: one token is 8 rows at 8 kv heads), Lloyd-Max presets: each block of 16 rows is spread over
programs that each write 32 key coordinates or half the value codes (each computes the row's norm, or its
minimum and maximum, itself). A decode step's write is one program's latency, not bandwidth: whole-slot
programs run 13,720 SASS instructions straight-line per thread with 1.9 KB of spills at 32 rows; a split
program is at most 4,927 (both branches; 154 registers, no spills). Timings: docs/performance-history.md.

Norms corrected at the write (``norm_at_write``, tqkv_4bit_pc) need the whole row's codes for one value. Few
rows: each key part stores its rows' sums of squared centroids, and the last key part of a row block to
arrive (an atomic count) adds them up and writes the norm. Many rows: 16 rows a program instead of 32 (32
spill already). Each coordinate's centroid is gathered from the table. (The alternatives timed against this
scheme, all slower: docs/performance-history.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import FP8_MAX, Preset
from tqkv_compile.lowerings import dependent_launch
from tqkv_compile.lowerings.arrivals import arrival_counts
from tqkv_compile.lowerings.cache_tables import require_vllm_layout
from tqkv_compile.lowerings.dependent_launch import wait_and_release
from tqkv_compile.lowerings.device_helpers import fp8e4m3_bits, store_fp16, store_packed, write_rows


@triton.jit
def _write_keys(key_ptr, cache_ptr, rot_ptr, mid_ptr, cent_ptr, tok, head, keep, base, s_kt, s_kh, s_kd, s_byte,
                c_start, FP8_MAX: tl.constexpr, D: tl.constexpr, KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr,
                KEY_CODE_BYTES: tl.constexpr, WIDTH: tl.constexpr, with_norm, BLOCK_M: tl.constexpr,
                BLOCK_R: tl.constexpr, NORM_AT_WRITE: tl.constexpr):
    """The key bytes of coordinates [c_start, c_start + WIDTH) of this program's rows (the norm too where
    ``with_norm``): fp8 bytes, or the Lloyd-Max codes of the rotated unit key (the norm is over the whole row).
    NORM_AT_WRITE: the norm stored is ||k|| / ||c|| (c the centroids the codes select); a program of the whole
    row (WIDTH == D) stores it, one of a part returns (||k||, its coordinates' sum of c^2) for the caller to
    finish. Returns (||k||, sum of c^2) (zeros for fp8 keys)."""
    rows_k = key_ptr + tok[:, None].to(tl.int64) * s_kt + head[:, None] * s_kh
    if KEY_FP8:
        w = tl.arange(0, WIDTH)
        k = tl.load(rows_k + (c_start + w)[None, :] * s_kd, mask=keep[:, None], other=0.0).to(tl.float32)
        k8 = fp8e4m3_bits(tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)).to(tl.uint8)
        tl.store(cache_ptr + base[:, None] + (c_start + w)[None, :] * s_byte, k8, mask=keep[:, None])
        norm = tl.zeros((BLOCK_M,), dtype=tl.float32)
        csq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    else:
        d = tl.arange(0, D)
        k = tl.load(rows_k + d[None, :] * s_kd, mask=keep[:, None], other=0.0).to(tl.float32)
        norm = tl.sqrt_rn(tl.sum(k * k, axis=1))
        unit = tl.div_rn(k, (norm + 1e-8)[:, None])
        r = tl.arange(0, BLOCK_R)
        csq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for c in tl.static_range(0, WIDTH, BLOCK_R):
            rot = tl.load(rot_ptr + d[:, None] * D + (c_start + c + r)[None, :])
            y = tl.dot(unit, rot, input_precision="tf32x3")
            codes = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.int32)
            for i in tl.static_range((1 << KEY_BITS) - 1):
                codes += (y >= tl.load(mid_ptr + i)).to(tl.int32)
            if NORM_AT_WRITE:
                cent = tl.load(cent_ptr + codes)
                csq += tl.sum(cent * cent, axis=1)
            store_packed(cache_ptr, base + ((c_start + c) * KEY_BITS // 8) * s_byte, s_byte, codes, keep,
                         KEY_BITS, BLOCK_M, BLOCK_R)
        if NORM_AT_WRITE and WIDTH == D:
            store_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, tl.div_rn(norm, tl.sqrt_rn(csq + 1e-16)),
                       keep & with_norm)
        elif not NORM_AT_WRITE:
            store_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, norm, keep & with_norm)
    return norm, csq


@triton.jit
def _write_values(value_ptr, cache_ptr, tok, head, keep, base, s_vt, s_vh, s_vd, s_byte, c_start,
                  D: tl.constexpr, VALUE_BITS: tl.constexpr, VALUE_OFFSET: tl.constexpr,
                  VALUE_CODE_BYTES: tl.constexpr, PAD: tl.constexpr, WIDTH: tl.constexpr, with_scale,
                  BLOCK_M: tl.constexpr):
    """The value codes of coordinates [c_start, c_start + WIDTH) of this program's rows (scale, minimum and pad
    too where ``with_scale``); scale and minimum are over the whole row."""
    rows_v = value_ptr + tok[:, None].to(tl.int64) * s_vt + head[:, None] * s_vh
    d = tl.arange(0, D)
    v = tl.load(rows_v + d[None, :] * s_vd, mask=keep[:, None], other=0.0).to(tl.float32)
    top: tl.constexpr = (1 << VALUE_BITS) - 1
    low = tl.min(v, axis=1)
    scale = tl.div_rn(tl.max(v, axis=1) - low, top * 1.0)
    scale = tl.where(scale > 1e-8, scale, 1e-8)
    if WIDTH < D:  # this program's coordinates only (the row again, from L1 / L2)
        w = tl.arange(0, WIDTH)
        v = tl.load(rows_v + (c_start + w)[None, :] * s_vd, mask=keep[:, None], other=0.0).to(tl.float32)
    vcodes = (tl.div_rn(v - low[:, None], scale[:, None]) + 0.5).to(tl.int32)
    vcodes = tl.minimum(tl.maximum(vcodes, 0), top)
    vbase = base + VALUE_OFFSET * s_byte
    store_packed(cache_ptr, vbase + (c_start * VALUE_BITS // 8) * s_byte, s_byte, vcodes, keep, VALUE_BITS,
                 BLOCK_M, WIDTH)
    first = keep & with_scale
    store_fp16(cache_ptr, vbase + VALUE_CODE_BYTES * s_byte, scale, first)
    store_fp16(cache_ptr, vbase + (VALUE_CODE_BYTES + 2) * s_byte, low, first)
    if PAD:
        tl.store(cache_ptr + vbase + (VALUE_CODE_BYTES + 4) * s_byte, tl.zeros_like(tok).to(tl.uint8), mask=first)


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, rot_ptr, mid_ptr, cent_ptr, partial_ptr, arrived_ptr,
    n_rows, num_kv_heads,
    s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
    s_blk, s_pos, s_head, s_byte,
    FP8_MAX: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr, VALUE_OFFSET: tl.constexpr, VALUE_CODE_BYTES: tl.constexpr, PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, KEY_PARTS: tl.constexpr, VALUE_PARTS: tl.constexpr,
    NORM_AT_WRITE: tl.constexpr, GDC: tl.constexpr,
):
    """Grid (row blocks, parts). KEY_PARTS == 0: one program writes its rows' whole slots. Else program
    (i, p) writes key coordinates [p * D / KEY_PARTS, ...) for p < KEY_PARTS and value coordinates of part
    p - KEY_PARTS after: a few rows (a decode step) spread over several programs, whose latency, not the
    bandwidth, is the kernel's time there. Key part 0 writes the norm; with NORM_AT_WRITE (the norm needs the
    whole row's codes) each key part stores its rows' sums of c^2 in ``partial`` [rows, KEY_PARTS] and counts
    itself in ``arrived`` [row blocks] (zeros), and the last to arrive adds them up in part order, writes
    the norm and puts the count back to zero (:mod:`~tqkv_compile.lowerings.arrivals`)."""
    wait_and_release(GDC)
    tok, head, keep, base = write_rows(slot_ptr, n_rows, num_kv_heads, s_blk, s_pos, s_head, BLOCK_SIZE, BLOCK_M)
    part = tl.program_id(1)
    part_rows = tl.zeros_like(tok) + part  # per row: a mask of scalar & row-vector is not a bool (interpreter)
    if KEY_PARTS == 0:  # (a grid of one part: part == 0)
        _write_keys(key_ptr, cache_ptr, rot_ptr, mid_ptr, cent_ptr, tok, head, keep, base, s_kt, s_kh, s_kd,
                    s_byte, 0, FP8_MAX, D, KEY_FP8, KEY_BITS, KEY_CODE_BYTES, D, part_rows == 0, BLOCK_M, BLOCK_R,
                    NORM_AT_WRITE)
        _write_values(value_ptr, cache_ptr, tok, head, keep, base, s_vt, s_vh, s_vd, s_byte, 0, D, VALUE_BITS,
                      VALUE_OFFSET, VALUE_CODE_BYTES, PAD, D, part_rows == 0, BLOCK_M)
    else:
        KEY_W: tl.constexpr = D // KEY_PARTS
        VALUE_W: tl.constexpr = D // VALUE_PARTS
        if part < KEY_PARTS:
            norm, csq = _write_keys(key_ptr, cache_ptr, rot_ptr, mid_ptr, cent_ptr, tok, head, keep, base, s_kt,
                                    s_kh, s_kd, s_byte, part * KEY_W, FP8_MAX, D, KEY_FP8, KEY_BITS, KEY_CODE_BYTES,
                                    KEY_W, part_rows == 0, BLOCK_M, BLOCK_R, NORM_AT_WRITE)
            if NORM_AT_WRITE:
                block = tl.program_id(0)
                rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
                tl.store(partial_ptr + rows * KEY_PARTS + part, csq)
                # every thread's partials stored before the one thread's arrival (acq_rel: visible to the
                # last program to arrive, whose loads are volatile)
                tl.debug_barrier()
                if tl.atomic_add(arrived_ptr + block, 1) == KEY_PARTS - 1:
                    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
                    for p in tl.static_range(KEY_PARTS):
                        total += tl.load(partial_ptr + rows * KEY_PARTS + p, volatile=True)
                    store_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte,
                               tl.div_rn(norm, tl.sqrt_rn(total + 1e-16)), keep)
                    tl.atomic_xchg(arrived_ptr + block, 0)  # zero again for the next launch (arrivals.py)
        else:
            vpart = part - KEY_PARTS
            _write_values(value_ptr, cache_ptr, tok, head, keep, base, s_vt, s_vh, s_vd, s_byte, vpart * VALUE_W,
                          D, VALUE_BITS, VALUE_OFFSET, VALUE_CODE_BYTES, PAD, VALUE_W, part_rows == KEY_PARTS,
                          BLOCK_M)


def few_rows(rows: int, device: torch.device) -> bool:
    """Whether ``rows`` (token, kv head) rows make fewer 16-row blocks than the GPU has SMs: a decode step's
    write, whose time is one program's latency; both write launchers then spread a block over more programs."""
    from tqkv_compile.lowerings.launch_choices import sm_count

    return triton.cdiv(rows, 16) < sm_count(device)


def launch_shape(rows: int, preset: Preset, device: torch.device) -> tuple[int, int, int, int]:
    """(rows per program, rotation columns per dot, key parts, value parts) for ``rows`` (token, kv head) rows;
    0 key parts: one program writes a row block's whole slots."""
    from tqkv_compile.lowerings.launch_choices import sm_count

    dim = preset.head_dim
    if preset.key_fp8:
        # no dot on fp8 keys, so any row count per program works: few rows (a decode step's 64 tokens x 8 kv
        # heads) get programs of 4 rows, enough to spread over the GPU; many rows keep 16
        return int(min(16, max(4, triton.next_power_of_2(max(rows // (2 * sm_count(device)), 1))))), min(dim, 64), 0, 0
    if few_rows(rows, device):
        # a program's latency is the kernel's time (one token: 32 rows a program were slow), so each 16-row
        # block is spread over 32-coordinate key parts and two value parts (the dot needs 16 rows)
        width = min(dim, 32)
        return 16, width, dim // width, 2
    # the rotation is a tf32 dot: at least 16 rows; 32 spill already (1.9 KB), and the corrected norm's
    # centroids would add to them
    return (16 if preset.norm_at_write else 32), min(dim, 64), 0, 0


def kv_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             preset: Preset, rotation: torch.Tensor, midpoints: torch.Tensor, launch=None,
             centroids: torch.Tensor | None = None) -> None:
    """key, value [T, Hk, D]; kv_cache u8 [NB, BS, Hk, S] (any strides); slot_mapping int [T].
    rotation: fp32 [D, D] contiguous; midpoints: fp32 [2^key_bits - 1] (unused for fp8 keys); centroids: fp32
    [2^key_bits], needed where the preset corrects key norms at the write (``norm_at_write``).
    launch: wraps the kernel before its launch (``torch.library.wrap_triton`` when traced for Inductor)."""
    require_vllm_layout(preset)
    if preset.norm_at_write and (centroids is None or centroids.numel() != 1 << preset.key_bits):
        raise ValueError(f"{preset.name} corrects key norms at the write: pass its {1 << preset.key_bits} centroids")
    tokens, heads, dim = key.shape
    rows = tokens * heads
    if rows == 0:
        return
    block_m, block_r, key_parts, value_parts = launch_shape(rows, preset, key.device)
    pad = preset.slot_bytes - preset.key_bytes - preset.value_bytes
    grid = (triton.cdiv(rows, block_m), max(1, key_parts + value_parts))
    if preset.norm_at_write and key_parts:  # the key parts' sums of c^2 and their arrival counts
        partial = torch.empty(grid[0] * block_m * key_parts, dtype=torch.float32, device=key.device)
        # counts kept zero between launches (no memset a call) except where Inductor traces this launcher or
        # they cannot grow (CUDA-graph capture)
        arrived = arrival_counts("kv_write_norm", grid[0], key.device) if launch is None else None
        if arrived is None:
            arrived = torch.zeros(grid[0], dtype=torch.int32, device=key.device)
    else:
        partial, arrived = midpoints, slot_mapping  # (not read)
    kernel = _kv_write_kernel if launch is None else launch(_kv_write_kernel)
    kernel[grid](
        key, value, kv_cache, slot_mapping, rotation, midpoints, midpoints if centroids is None else centroids,
        partial, arrived,
        rows, heads,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        FP8_MAX=FP8_MAX, D=dim, BLOCK_SIZE=kv_cache.shape[1],
        KEY_FP8=preset.key_fp8, KEY_BITS=preset.key_bits, KEY_CODE_BYTES=preset.key_code_bytes,
        VALUE_BITS=preset.value_bits, VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes,
        PAD=pad,
        BLOCK_M=block_m, BLOCK_R=block_r, KEY_PARTS=key_parts, VALUE_PARTS=max(1, value_parts),
        NORM_AT_WRITE=preset.norm_at_write,
        num_warps=4, **dependent_launch.options(key.device, traced=launch is not None),
    )
