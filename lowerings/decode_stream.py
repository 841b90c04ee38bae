"""The stream kernel: split-KV decode attention over vLLM's four slot layouts (fp8, 4-bit or 3-bit Lloyd-Max keys;
4-bit or 3-bit uniform values), every field read as 16- or 32-bit words and unpacked in registers. It reads
every cache vLLM allocates (:func:`stream_words` says which views it can read; the byte kernel,
:mod:`~tqkv_compile.lowerings.decode_bytes`, serves the others).

Its dots are turned around against the byte kernel's (scores^T = K . q^T, acc^T += V^T . P^T): the query group
is their N side, padded to 8 rather than 16. On the GPU 4-bit and 3-bit key codes are looked up by byte permutes
from an fp16 table in registers (:func:`~tqkv_compile.lowerings.cache_tables.key_lut`), fp8 keys converted two
at a time, uniform value codes turned into exact fp16 subnormals; interpreted, by select trees and plain
unpacking (:mod:`~tqkv_compile.lowerings.device_helpers`). Several query rows of a sequence (speculative
verification) can share one program and one read of the cache (``ROWS``). The programs can prepare the query
themselves (:func:`_stream_query`: scaled, and rotated by the Hadamard signs of :func:`rotation_signs`; by
default for fp8 keys, :func:`~tqkv_compile.lowerings.launch_choices.query_in_stream_kernel`), else
:func:`~tqkv_compile.lowerings.triton_query.prepare_query`'s launch does. The grid, the partials and their merge
are :mod:`~tqkv_compile.lowerings.triton_attention`'s contract.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import Preset
from tqkv_compile.lowerings import dependent_launch
from tqkv_compile.lowerings.cache_tables import halves_span, key_lut
from tqkv_compile.lowerings.dependent_launch import wait_and_release
from tqkv_compile.lowerings.device_helpers import (LOG2E, centroids_sym16, codes4_fp16_odd16, fp8x4_fp16, keys3,
                                                   load_field_h, load_half_h, lut4_fp16, odd16_codes, operand,
                                                   rows_span, softmax_step, split_plan, split_span, tile_base,
                                                   unpack, values3_f16)
from tqkv_compile.lowerings.launch_choices import query_in_stream_kernel
from tqkv_compile.lowerings.triton_query import prepare_query
from tqkv_compile.rotation import hadamard


@triton.jit
def _stream_query(q_ptr, signs_ptr, q_off, head_ok, s_qd, D: tl.constexpr,
                  BLOCK_H: tl.constexpr, ROTATE: tl.constexpr, Q_PRE: tl.constexpr, Q_POST: tl.constexpr,
                  DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """The query columns [BLOCK_H, D] (each at ``q_off``: its row and head) as the tile loop's dot needs them,
    from the model's query: times Q_PRE (a
    power of two: exact), rotated by the Hadamard signs (+-1 in fp16 [D, D]: exact products, fp32 sums) where
    ROTATE, times Q_POST, in DTYPE. Q_PRE x Q_POST is the softmax scale x log2(e) (/ sqrt(D) with the
    rotation), so this equals :func:`~tqkv_compile.lowerings.triton_query.prepare_query`'s query but for the
    order of the fp32 sums, and it costs no launch of its own."""
    rows = q_ptr + q_off[:, None]
    d = tl.arange(0, D)
    if ROTATE:
        ROT_K: tl.constexpr = 32 if D >= 32 else D
        acc = tl.zeros((BLOCK_H, D), tl.float32)
        for k0 in tl.static_range(0, D, ROT_K):
            k = k0 + tl.arange(0, ROT_K)
            x = tl.load(rows + k[None, :] * s_qd, mask=head_ok[:, None], other=0.0).to(tl.float32) * Q_PRE
            h = tl.load(signs_ptr + k[:, None] * D + d[None, :])
            acc = tl.dot(x.to(DTYPE), h.to(DTYPE), acc, input_precision=PRECISION)
    else:
        acc = tl.load(rows + d[None, :] * s_qd, mask=head_ok[:, None], other=0.0).to(tl.float32) * Q_PRE
    return operand(acc * Q_POST, DTYPE)


@triton.jit
def _stream_fields(kptr, vptr, hptr, base, valid, KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr,
                   KEY_CODE_BYTES: tl.constexpr, KEY_WORD: tl.constexpr, VALUE_BITS: tl.constexpr,
                   VALUE_OFFSET: tl.constexpr, VALUE_CODE_BYTES: tl.constexpr, VALUE_WORD: tl.constexpr):
    """One tile's loads for the stream kernel: (key words, value words, value scale, value zero, key norm) of
    the slots at ``base`` (fp8 keys have no norm of their own: the value scale stands in, unused)."""
    kw = load_field_h(kptr, base, 0, KEY_CODE_BYTES, KEY_WORD, KEY_BITS == 3)
    vw = load_field_h(vptr, base, VALUE_OFFSET, VALUE_CODE_BYTES, VALUE_WORD, VALUE_BITS == 3)
    vscale = load_half_h(hptr, base, valid, VALUE_OFFSET + VALUE_CODE_BYTES)
    vzero = load_half_h(hptr, base, valid, VALUE_OFFSET + VALUE_CODE_BYTES + 2)
    if KEY_FP8:
        knorm = vscale
    else:
        knorm = load_half_h(hptr, base, valid, KEY_CODE_BYTES)
    return kw, vw, vscale, vzero, knorm


@triton.jit
def _decode_stream_kernel(
    q_ptr, signs_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, cent_ptr, key_lut_ptr, part_out_ptr,
    part_lse_ptr,
    num_seqs, max_len, plan_slots, plan_wanted,
    s_qt, s_qh, s_qd, s_bt, s_bm,
    h_blk, h_pos, h_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    VALUE_BITS: tl.constexpr, VALUE_OFFSET: tl.constexpr, VALUE_CODE_BYTES: tl.constexpr,
    DOT_FP32: tl.constexpr, KEY_WORD: tl.constexpr, VALUE_WORD: tl.constexpr, PREFETCH: tl.constexpr,
    ASM: tl.constexpr, INDEX32: tl.constexpr,
    QUERY_IN_KERNEL: tl.constexpr, ROTATE_QUERY: tl.constexpr, Q_PRE: tl.constexpr, Q_POST: tl.constexpr,
    ROWS: tl.constexpr = 1, LENGTH_AWARE: tl.constexpr = False, GDC: tl.constexpr = False,
):
    """The decode kernels' contract (:mod:`~tqkv_compile.lowerings.triton_attention`) for fp8, 4-bit or 3-bit Lloyd-Max
    keys with 4-bit or 3-bit uniform values (vLLM's four presets), a cache whose last stride is 1 and whose fields are
    WORD-byte aligned, its strides given in 2-byte units (h_blk, h_pos, h_head; int32 indexing with INDEX32, when the
    view spans fewer than 2^31 such units): every field is read as WORD-byte words and unpacked into natural coordinate
    order (no query permutation). Its dots are turned around against the other kernels': scores^T = K . q^T and acc^T +=
    V^T . P^T, so the query group is the dots' N side (``BLOCK_H`` >= 8) and the tile's positions their M side (mma.sync
    m16n8k16 as triton 3.6 compiles it for the H200; wgmma with 3.9): a group of 4 pads to 8 instead of 16, which halves
    the softmax, scaling and accumulator work. With PREFETCH, the next tile's words and the tile after's block ids are
    loaded before the current tile is computed (software pipelining by hand: the loads are in flight during the math).
    With QUERY_IN_KERNEL, ``q_ptr`` is the model's query and :func:`_stream_query` rotates and scales it (no launch of
    :func:`prepare_query`); otherwise it is prepare_query's. ROWS > 1: a program serves that many consecutive query rows
    of a sequence (:func:`rows_span`; grid axis 0 counts row blocks), each column masked at its own causal length.
    LENGTH_AWARE: a row block's split count from the batch's lengths (:func:`row_splits`, at most NUM_SPLITS)."""
    wait_and_release(GDC)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    DTYPE: tl.constexpr = tl.float32 if DOT_FP32 else tl.float16
    PRECISION: tl.constexpr = "ieee" if DOT_FP32 else None
    kptr = cache_ptr.to(tl.pointer_type(tl.int32 if KEY_WORD == 4 else tl.int16), bitcast=True)
    vptr = cache_ptr.to(tl.pointer_type(tl.int32 if VALUE_WORD == 4 else tl.int16), bitcast=True)
    hptr = cache_ptr.to(tl.pointer_type(tl.float16), bitcast=True)

    at_mean = num_seqs * 0
    mean = at_mean + 1
    if LENGTH_AWARE:  # the batch's plan first: its loads need nothing of this program's row
        at_mean, mean = split_plan(qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted, BLOCK_N,
                                   NUM_SPLITS, ROWS)
    if ROWS == 1:
        seq, begin, end, q_heads, part, head_ok = split_span(row, kv_head, split, qsl_ptr, seq_lens_ptr,
                                                             num_seqs, max_len, GROUP, BLOCK_H, BLOCK_N,
                                                             NUM_SPLITS, SEARCH_STEPS, at_mean, mean,
                                                             LENGTH_AWARE)
        q_off = row * s_qt + q_heads * s_qh
        limit = end
    else:
        seq, begin, end, q_off, part, head_ok, limit = rows_span(row, kv_head, split, qsl_ptr, seq_lens_ptr,
                                                                 num_seqs, max_len, s_qt, s_qh, GROUP, BLOCK_H,
                                                                 BLOCK_N, NUM_SPLITS, SEARCH_STEPS, ROWS,
                                                                 at_mean, mean, LENGTH_AWARE)
    if begin >= end:
        tl.store(part_lse_ptr + part, tl.full((BLOCK_H,), float("-inf"), tl.float32), mask=head_ok)
        return

    d = tl.arange(0, D)
    if QUERY_IN_KERNEL:
        q = _stream_query(q_ptr, signs_ptr, q_off, head_ok, s_qd, D, BLOCK_H, ROTATE_QUERY, Q_PRE, Q_POST, DTYPE,
                          PRECISION)
    else:
        q = tl.load(q_ptr + q_off[:, None] + d[None, :] * s_qd, mask=head_ok[:, None], other=0.0)
        q = operand(q, DTYPE)
    if NORM_CORRECTION:
        ones = tl.full((D, BLOCK_H), 1.0, DTYPE)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((D, BLOCK_H), tl.float32)  # transposed: the query group is the dots' N side
    zsum = tl.zeros((BLOCK_H,), tl.float32)  # sum of P * zero: the affine part of P.V
    bt_row = block_table_ptr + seq.to(tl.int64) * s_bt
    n = tl.arange(0, BLOCK_N)

    base, valid = tile_base(bt_row, s_bm, begin, end, n, kv_head, h_blk, h_pos, h_head, BLOCK_SIZE,
                            INDEX32)
    kw, vw, vscale, vzero, knorm = _stream_fields(kptr, vptr, hptr, base, valid, KEY_FP8, KEY_BITS, KEY_CODE_BYTES,
                                                  KEY_WORD, VALUE_BITS, VALUE_OFFSET, VALUE_CODE_BYTES, VALUE_WORD)
    if PREFETCH:
        base_next, valid_next = tile_base(bt_row, s_bm, begin + BLOCK_N, end, n, kv_head, h_blk, h_pos, h_head,
                                          BLOCK_SIZE, INDEX32)
    for start in range(begin, end, BLOCK_N):
        if PREFETCH:
            # issue the next tile's loads and the block ids after it; the math below runs while they fly
            kw_n, vw_n, vscale_n, vzero_n, knorm_n = _stream_fields(
                kptr, vptr, hptr, base_next, valid_next, KEY_FP8, KEY_BITS, KEY_CODE_BYTES, KEY_WORD, VALUE_BITS,
                VALUE_OFFSET, VALUE_CODE_BYTES, VALUE_WORD)
            base_after, valid_after = tile_base(bt_row, s_bm, start + 2 * BLOCK_N, end, n, kv_head, h_blk, h_pos,
                                                h_head, BLOCK_SIZE, INDEX32)
        valid = start + n < end

        # ---- keys -> scores^T [BLOCK_N, BLOCK_H] = K . q^T: the positions are the dot's M side, the query group
        # its N side (>= 8: a group of 4 pads to 8 columns, where q . K^T padded it to 16 rows)
        if KEY_FP8:
            if ASM:
                keys = fp8x4_fp16(kw)
            else:
                keys = unpack(kw, 8, KEY_WORD).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
            scores = tl.dot(keys, tl.trans(q), input_precision=PRECISION)
        else:
            if KEY_BITS == 3:
                cent = keys3(kw, key_lut_ptr, cent_ptr, ASM, DTYPE)
            elif ASM:
                cent = lut4_fp16(kw, key_lut_ptr)
            else:
                cent = centroids_sym16(unpack(kw, 4, KEY_WORD), cent_ptr, DTYPE)  # the table in DTYPE, selected
            scores = tl.dot(cent, tl.trans(q), input_precision=PRECISION)
            if NORM_CORRECTION:  # ||c||^2 by a dot with ones: on the tensor cores, in the scores' layout
                sumsq = tl.dot(operand(cent * cent, DTYPE), ones, input_precision=PRECISION)
                scores = scores * (knorm[:, None] / tl.sqrt(sumsq + 1e-16))
            else:
                scores = scores * knorm[:, None]
        if ROWS == 1:
            scores = tl.where(valid[:, None], scores, float("-inf"))
        else:  # each column its own row's causal length (<= end)
            scores = tl.where((start + n)[:, None] < limit[None, :], scores, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(scores, m_i, l_i, 0, ROWS > 1)

        # ---- values: P.V = (P * scale) . code + P . zero, the codes as fp16 f * code * 2^-24 with f = 1 in even
        # columns and 16 in odd ones (the cheapest exact unpacking); 2^-24 and f come out after the loop.
        # acc^T [D, BLOCK_H] += V^T . (P * scale)^T
        ps = operand(p * vscale[:, None], DTYPE)
        zsum = zsum * alpha + tl.sum(p * vzero[:, None], axis=0)
        if VALUE_BITS == 3:
            vcodes = values3_f16(vw).to(DTYPE)
        elif ASM:
            vcodes = codes4_fp16_odd16(vw)
        else:
            vcodes = odd16_codes(unpack(vw, 4, VALUE_WORD), D).to(DTYPE)
        # each tile's P.V from a zero accumulator, added to acc in fp32 (an FMA with the rescale, as the multiply
        # was): the tensor cores' accumulation does not round to nearest, and carried over a whole split its
        # loss grows with the tiles, then shows through the code / zero-point cancellation (docs/kernels.md).
        # (tl.fma, not +: Triton folds dot(a, b, 0) + c back into dot(a, b, c).)
        rescale = tl.broadcast_to(alpha[None, :], acc.shape)
        acc = tl.fma(acc, rescale, tl.dot(tl.trans(vcodes), ps, input_precision=PRECISION))

        if PREFETCH:
            kw, vw, vscale, vzero, knorm = kw_n, vw_n, vscale_n, vzero_n, knorm_n
            base_next, valid_next = base_after, valid_after
        else:
            base, valid_t = tile_base(bt_row, s_bm, start + BLOCK_N, end, n, kv_head, h_blk, h_pos, h_head,
                                      BLOCK_SIZE, INDEX32)
            kw, vw, vscale, vzero, knorm = _stream_fields(kptr, vptr, hptr, base, valid_t, KEY_FP8, KEY_BITS,
                                                          KEY_CODE_BYTES, KEY_WORD, VALUE_BITS, VALUE_OFFSET,
                                                          VALUE_CODE_BYTES, VALUE_WORD)

    if ROWS == 1:
        inv = 1.0 / l_i
    else:  # a column without a position in this split: its partial 0 (its -inf log-sum-exp drops it anyway)
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    if VALUE_BITS == 3:
        f = tl.full((D,), 1.0, tl.float32)
    else:
        f = tl.where((d & 1) == 1, 1.0 / 16.0, 1.0)  # exact: a power of two
    out = acc * ((f * 16777216.0)[:, None] * inv[None, :]) + (zsum * inv)[None, :]  # 2^24: the codes' unit
    tl.store(part_out_ptr + part[None, :] * D + d[:, None], out, mask=head_ok[None, :])
    tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=head_ok)


def _base_offset(t: torch.Tensor) -> int:
    """Byte offset of the view into its storage. Alignment is judged from it, not from data_ptr(), so that the
    launchers also run on fake tensors (Inductor tracing a ``triton_op``): storages themselves are at least
    16-byte aligned (CUDA's caching allocator: 512)."""
    return t.storage_offset() * t.element_size()


def stream_words(preset: Preset, kv_cache: torch.Tensor, asm: bool) -> tuple[int, int, bool] | None:
    """(key word bytes, value word bytes, asm) the stream kernel reads this cache with, or None where it
    cannot: it takes vLLM's four layouts (fp8, 4-bit or 3-bit Lloyd-Max keys; 4-bit or 3-bit uniform values),
    from byte-contiguous slots whose fields and strides are multiples of the word. The asm lookups (GPU) read
    4-bit codes as 16-bit words (four codes each) and fp8 keys as 32-bit words; 3-bit fields are always read
    as 16-bit words (three to 16 codes)."""
    if not (preset.key_fp8 or preset.key_bits in (3, 4)) or preset.value_bits not in (3, 4) or not preset.vllm_layout:
        return None
    if kv_cache.dtype != torch.uint8 or kv_cache.stride(3) != 1:
        return None
    common = (_base_offset(kv_cache), *kv_cache.stride()[:3])

    def fits(word: int, *offsets: int) -> bool:
        return all(o % word == 0 for o in (*common, *offsets))

    if not fits(2, preset.key_code_bytes, preset.key_bytes, preset.value_code_bytes):
        return None
    key_word = 4 if fits(4, preset.key_code_bytes) and preset.key_bits != 3 else 2
    value_word = 4 if fits(4, preset.key_bytes, preset.value_code_bytes) and preset.value_bits != 3 else 2
    asm = asm and (key_word == 4 or not preset.key_fp8)
    if asm:
        value_word = 2
        key_word = 4 if preset.key_fp8 else 2
    return key_word, value_word, asm


_SIGNS: dict[tuple[int, str], torch.Tensor] = {}


def rotation_signs(dim: int, device: torch.device) -> torch.Tensor:
    """The Hadamard rotation's signs, sqrt(dim) x H as fp16 [dim, dim] (+-1, exact) on ``device``, built once:
    the stream kernel rotates the query with them (:func:`_stream_query`)."""
    key = (dim, str(device))
    if key not in _SIGNS:
        _SIGNS[key] = torch.sign(hadamard(dim)).to(torch.float16).to(device)
    return _SIGNS[key]



def fill_partials(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, scale: float, preset: Preset, rotation: torch.Tensor,
                  centroids: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, *, block_n: int,
                  search_steps: int, plan: tuple[int, int], rows_per_program: int = 1, length_aware: bool = False,
                  num_warps: int | None = None, num_stages: int | None = None, prefetch: bool | None = None,
                  asm: bool = True, maxnreg: int | None = None, lut: torch.Tensor | None = None,
                  index32: bool | None = None, signs: torch.Tensor | None = None,
                  query_in_kernel: bool | None = None, launch=None) -> None:
    """Fill ``part_out`` [T, Hq, splits, D] fp32 (each split's normalised output) and ``part_lse`` [T, Hq, splits] fp32
    (its base-2 log-sum-exp) for ``query`` [T, Hq, D], on a grid of (T, kv heads, splits), or of (T //
    rows_per_program + sequences, kv heads, splits) row blocks where a program serves ``rows_per_program`` > 1 rows
    (rows past the last sequence get no program: ``part_lse`` must then come filled with -inf). ``search_steps``:
    the bisection steps over ``query_start_loc``, ceil(log2(sequences + 1)); ``plan``: (resident programs, the
    ~4-an-SM cap) for ``length_aware``'s split counts (:func:`~tqkv_compile.lowerings.device_helpers.row_splits`).
    The tuning keywords are :func:`~tqkv_compile.lowerings.triton_attention.decode_attention`'s, ``maxnreg`` taken
    as given (None: no cap). ``launch``: wraps each kernel before its launch (``torch.library.wrap_triton`` when
    traced; None: plain)."""
    rows, heads, dim = query.shape
    kv_heads = kv_cache.shape[2]
    group = heads // kv_heads
    splits = part_out.shape[2]
    num_seqs = seq_lens.shape[0]
    max_len = block_table.shape[1] * kv_cache.shape[1]
    interpret = query.device.type == "cpu"
    packed = rows_per_program
    plan_slots, plan_wanted = plan
    words = stream_words(preset, kv_cache, asm=asm and not interpret)
    if words is None:
        raise ValueError(f"the stream kernel cannot read {preset.name} from this cache view")
    rotate = not preset.key_fp8
    if query_in_kernel is None:
        query_in_kernel = query_in_stream_kernel(preset, query.dtype, interpret)
    q_scale = scale * LOG2E / (math.sqrt(dim) if rotate else 1.0)
    q_pre = 2.0 ** math.floor(math.log2(q_scale))
    if query_in_kernel:
        q = query
        signs = signs if signs is not None else rotation_signs(dim, query.device)
    else:
        q = prepare_query(query, rotation if rotate else None, scale * LOG2E, launch)
        signs = q
    lut = lut if lut is not None else key_lut(preset, query.device)
    grid_rows = rows if packed == 1 else rows // packed + num_seqs  # (see rows_span)
    kernel = _decode_stream_kernel if launch is None else launch(_decode_stream_kernel)
    kernel[(grid_rows, kv_heads, splits)](
        q, signs, kv_cache, block_table, seq_lens, query_start_loc, centroids, lut, part_out, part_lse,
        num_seqs, max_len, plan_slots, plan_wanted, *q.stride(), *block_table.stride(),
        *(st // 2 for st in kv_cache.stride()[:3]),
        GROUP=group, BLOCK_H=max(8, triton.next_power_of_2(group * packed)), D=dim, BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_N=block_n, NUM_SPLITS=splits, SEARCH_STEPS=search_steps, KEY_FP8=preset.key_fp8,
        KEY_BITS=preset.key_bits, KEY_CODE_BYTES=preset.key_code_bytes, NORM_CORRECTION=preset.norm_correction,
        VALUE_BITS=preset.value_bits, VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes,
        DOT_FP32=interpret, KEY_WORD=words[0], VALUE_WORD=words[1], ASM=words[2], PREFETCH=bool(prefetch),
        INDEX32=index32 is not False and halves_span(kv_cache) < 2**31,
        QUERY_IN_KERNEL=query_in_kernel, ROTATE_QUERY=rotate and query_in_kernel,
        Q_PRE=q_pre if query_in_kernel else 1.0, Q_POST=q_scale / q_pre if query_in_kernel else 1.0,
        ROWS=packed, LENGTH_AWARE=length_aware, num_warps=num_warps or 4, num_stages=num_stages or 1,
        **dependent_launch.options(query.device, traced=launch is not None),
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
