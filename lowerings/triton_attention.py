"""Triton decode attention straight from the packed TurboQuant cache: split-KV, then a log-sum-exp merge.

Grid ``(query rows, kv heads, NUM_SPLITS)``, fixed by tensor shapes alone (CUDA-graph safe). One program
serves one query row's whole query-head group (padded to ``BLOCK_H`` >= 16, the M side of ``tl.dot``; the
stream kernel turns its dots around: >= 8, their N side) over one split of that row's causal context, in tiles
of ``BLOCK_N`` positions:

- keys: codes unpacked in registers, centroids chosen by a select tree over the code bits, or on the GPU by
  byte permutes from an fp16 table in registers (no memory gather); scores = dot(q @ H, centroids) * ||k|| /
  ||c|| (nc), or dot(q, fp8 keys). The query is rotated and scaled by ``scale * log2(e)`` once, in a launch
  before the kernel (:mod:`triton_query`); for fp8 keys (scaled, not rotated) the stream kernel's programs do it
  themselves (``_stream_query``, which can also rotate by vLLM's Hadamard: measured slower, so off);
- softmax in base 2 (``exp2``), online over the tiles;
- values: integer codes are exact in fp16, so ``P.V = (P * scale) . codes + (P . zero)`` per column.

Each program writes its partial output (normalised) and its base-2 log-sum-exp; the merge kernel combines
the splits. A row's sequence and causal length come from ``query_start_loc`` inside the kernel (the
one-token-per-sequence case is recognised in two loads; other rows binary-search), so any mix of decode and
multi-token rows is served: each row attends to positions ``0 .. seq_len - n_new + j``.

Two split kernels share that contract: ``_decode_stream_kernel`` (fields read as 16- or 32-bit words,
vLLM's four layouts, the one every engine cache takes) and ``_decode_split_kernel`` (byte loads: any view,
the fallback); :func:`default_kernel` picks. A third, :mod:`gluon_decode`'s fragment kernel (4-bit or fp8 keys
with 4-bit values, Gluon: each thread loads its own mma fragments' codes), takes their place on CUDA where it
is the faster one. Several query rows of a sequence (speculative verification) share one stream-kernel program
and one read of the cache (``ROWS``). The launch choices (kernel, tile, splits, rows a program) are
:mod:`~tqkv_compile.lowerings.launch_choices`'s; how they were measured: docs/performance-history.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import Preset
from tqkv_compile.lowerings import dependent_launch, gluon_decode
from tqkv_compile.lowerings.cache_tables import halves_span, key_lut
from tqkv_compile.lowerings.dependent_launch import wait_and_release
from tqkv_compile.lowerings.launch_choices import (merge_chunk, merge_warps, num_splits, packed_rows,
                                                   plan_capacity, programs_per_sm, query_in_stream_kernel,
                                                   split_grid, stream_block_n, stream_maxnreg)
from tqkv_compile.lowerings.triton_query import prepare_query
from tqkv_compile.rotation import hadamard

LOG2E = 1.4426950408889634


@triton.jit
def _select8(code, c0, c1, c2, c3, c4, c5, c6, c7):
    """Pick c[code & 7] by a select tree over the low three bits of int32 code."""
    b0 = (code & 1) != 0
    b1 = (code & 2) != 0
    b2 = (code & 4) != 0
    x01 = tl.where(b0, c1, c0)
    x23 = tl.where(b0, c3, c2)
    x45 = tl.where(b0, c5, c4)
    x67 = tl.where(b0, c7, c6)
    return tl.where(b2, tl.where(b1, x67, x45), tl.where(b1, x23, x01))


@triton.jit
def _centroids(code, cent_ptr, BITS: tl.constexpr):
    """int32 codes -> fp32 Lloyd-Max centroids: the table held in registers (scalars) and selected (a gather
    from the cached table was slower)."""
    values = _select8(code, tl.load(cent_ptr + 0), tl.load(cent_ptr + 1), tl.load(cent_ptr + 2),
                      tl.load(cent_ptr + 3), tl.load(cent_ptr + 4), tl.load(cent_ptr + 5), tl.load(cent_ptr + 6),
                      tl.load(cent_ptr + 7))
    if BITS == 4:
        upper = _select8(code, tl.load(cent_ptr + 8), tl.load(cent_ptr + 9), tl.load(cent_ptr + 10),
                         tl.load(cent_ptr + 11), tl.load(cent_ptr + 12), tl.load(cent_ptr + 13),
                         tl.load(cent_ptr + 14), tl.load(cent_ptr + 15))
        values = tl.where((code & 8) != 0, upper, values)
    return values


@triton.jit
def _load_nibbles(cache_ptr, base, valid, s_byte, D: tl.constexpr):
    """4-bit codes of BLOCK_N slots at byte offsets base -> (even, odd) int32 [BLOCK_N, D/2]: coordinates
    2i and 2i+1, the low and high nibble of byte i. Each byte is loaded once; no interleave."""
    i = tl.arange(0, D // 2)
    packed = tl.load(cache_ptr + base[:, None] + i[None, :] * s_byte, mask=valid[:, None], other=0).to(tl.int32)
    return packed & 15, packed >> 4


@triton.jit
def _order3(D: tl.constexpr):
    """The column order of 3-bit code tiles: column c holds coordinate 8 * (c % (D/8)) + c // (D/8), so
    that each eighth of the columns reads one bit offset (a plane) of the 3-byte groups."""
    c = tl.arange(0, D)
    return 8 * (c % (D // 8)) + c // (D // 8)


@triton.jit
def _load_codes3(cache_ptr, base, valid, s_byte, D: tl.constexpr):
    """3-bit codes of BLOCK_N slots -> int32 [BLOCK_N, D] in :func:`_order3` column order, each read through
    a 16-bit window (the second byte only where a code straddles two bytes)."""
    bit = 3 * _order3(D)
    byte = bit >> 3
    shift = bit & 7
    addr = cache_ptr + base[:, None] + byte[None, :] * s_byte
    lo = tl.load(addr, mask=valid[:, None], other=0).to(tl.int32)
    hi = tl.load(addr + s_byte, mask=valid[:, None] & (shift > 5)[None, :], other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> shift[None, :]) & 7


# Value codes enter the P.V dot as fp16 *subnormals*: the bits of code c read as fp16 are c * 2^-24, exactly,
# with no conversion instruction, and the accumulator holds only the signal; the 2^24 comes out once per program.
# (An offset encoding such as fp16 1024 + c, subtracted after the loop, makes the accumulator ~100x larger than
# its signal and loses it over long splits: docs/kernels.md, "Long-context error".)


@triton.jit
def _codes_f16(codes):
    """int32 codes in [0, 1024) -> fp16 code * 2^-24, exactly (the code's bits read as an fp16 subnormal);
    callers multiply by 2^24 after the dot."""
    return codes.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _operand(x, DTYPE: tl.constexpr, OPERAND: tl.constexpr = tl.float16):
    """A dot operand as the GPU's dot takes it: rounded to OPERAND (the attention kernels' fp16; kv_dot's fp32),
    then in DTYPE (fp32 when interpreted: the interpreter's fp16 dots are wrong, so it upcasts, but only after
    the GPU's rounding, so that interpreted tests see the GPU's numerics; on the GPU this is no instruction)."""
    return x.to(OPERAND).to(DTYPE)


@triton.jit
def _load_fp16(cache_ptr, addr, valid):
    """Little-endian fp16 at byte offsets addr [BLOCK_N] -> fp32."""
    lo = tl.load(cache_ptr + addr, mask=valid, other=0).to(tl.int32)
    hi = tl.load(cache_ptr + addr + 1, mask=valid, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_query(q_ptr, row, q_heads, head_ok, s_qt, s_qh, s_qd,
                D: tl.constexpr, KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, DTYPE: tl.constexpr,
                OPERAND: tl.constexpr):
    """The query group [BLOCK_H, ...] in the column order the key tiles use: (q, q) for fp8 keys (natural
    order; the second is unused), (even, odd) coordinates for 4-bit keys, (:func:`_order3`, unused) for 3-bit."""
    rows = q_ptr + row * s_qt + q_heads[:, None] * s_qh
    if KEY_FP8:
        first = tl.load(rows + tl.arange(0, D)[None, :] * s_qd, mask=head_ok[:, None], other=0.0)
        second = first
    elif KEY_BITS == 4:
        i = tl.arange(0, D // 2)
        first = tl.load(rows + (2 * i)[None, :] * s_qd, mask=head_ok[:, None], other=0.0)
        second = tl.load(rows + (2 * i + 1)[None, :] * s_qd, mask=head_ok[:, None], other=0.0)
    else:
        first = tl.load(rows + _order3(D)[None, :] * s_qd, mask=head_ok[:, None], other=0.0)
        second = first
    return _operand(first, DTYPE, OPERAND), _operand(second, DTYPE, OPERAND)


@triton.jit
def _key_scores(q_a, q_b, cache_ptr, cent_ptr, base, valid, s_byte,
                D: tl.constexpr, KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr,
                NORM_CORRECTION: tl.constexpr, DTYPE: tl.constexpr,
                PRECISION: tl.constexpr, OPERAND: tl.constexpr):
    """Scores [BLOCK_H, BLOCK_N] = <q, k> of the query group (from :func:`_load_query`) against BLOCK_N keys
    read straight from their slots; the query is already rotated (Lloyd-Max keys) and scaled. Operands are
    rounded to OPERAND (see :func:`_operand`), the dots run in DTYPE at PRECISION."""
    if KEY_FP8:
        raw = tl.load(cache_ptr + base[:, None] + tl.arange(0, D)[None, :] * s_byte, mask=valid[:, None], other=0)
        keys = raw.to(tl.float8e4nv, bitcast=True).to(DTYPE)
        scores = tl.dot(q_a, tl.trans(keys), input_precision=PRECISION)
    else:
        if KEY_BITS == 4:
            even, odd = _load_nibbles(cache_ptr, base, valid, s_byte, D)
            c_even = _centroids(even, cent_ptr, 4)
            c_odd = _centroids(odd, cent_ptr, 4)
            scores = tl.dot(q_a, tl.trans(_operand(c_even, DTYPE, OPERAND)), input_precision=PRECISION)
            scores = tl.dot(q_b, tl.trans(_operand(c_odd, DTYPE, OPERAND)), scores, input_precision=PRECISION)
            if NORM_CORRECTION:
                sumsq = tl.sum(c_even * c_even, axis=1) + tl.sum(c_odd * c_odd, axis=1)
        else:
            cent = _centroids(_load_codes3(cache_ptr, base, valid, s_byte, D), cent_ptr, 3)
            scores = tl.dot(q_a, tl.trans(_operand(cent, DTYPE, OPERAND)), input_precision=PRECISION)
            if NORM_CORRECTION:
                sumsq = tl.sum(cent * cent, axis=1)
        factor = _load_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, valid)
        if NORM_CORRECTION:
            factor = factor / tl.sqrt(sumsq + 1e-16)
        scores = scores * factor[None, :]
    return scores


@triton.jit
def _row_context(row, qsl_ptr, seq_lens_ptr, num_seqs, SEARCH_STEPS: tl.constexpr):
    """Query row -> (its sequence, its causal context length); length 0 for rows past the last sequence."""
    in_batch = row < num_seqs
    start = tl.load(qsl_ptr + row, mask=in_batch, other=0)
    stop = tl.load(qsl_ptr + row + 1, mask=in_batch, other=0)
    seq = row
    if not ((start <= row) & (row < stop)):  # not one token per sequence: bisect query_start_loc
        lo = row * 0
        hi = lo + num_seqs
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go = tl.load(qsl_ptr + 1 + mid, mask=mid < num_seqs, other=0) <= row
            active = lo < hi
            lo = tl.where(active & go, mid + 1, lo)
            hi = tl.where(active & (go == 0), mid, hi)
        seq = tl.minimum(lo, num_seqs - 1)
        start = tl.load(qsl_ptr + seq)
        stop = tl.load(qsl_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    length = seq_len - (stop - start) + (row - start) + 1
    length = tl.where((start <= row) & (row < stop), length, 0)
    return seq, length


@triton.jit
def _row_splits(tiles, qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted, BLOCK_N: tl.constexpr,
                NUM_SPLITS: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr = 128):
    """Splits for a row block whose context is ``tiles`` tiles, from the batch's real lengths (length-aware
    splits: :func:`~tqkv_compile.lowerings.launch_choices.row_splits` is this rule on the host, with the why).
    Every program computes the same plan: the batch's mean tiles a row block (the sequences' lengths clamped to
    ``max_len``, ceil(rows / ROWS) row blocks a sequence, read CHUNK sequences at a time), the split count the
    wave model rates best for a batch of that mean (``launch_choices.num_splits``'s model: ``plan_slots``
    programs resident, ``plan_wanted`` the ~4-an-SM cap, candidates up to NUM_SPLITS), then this block's share:
    that count scaled by tiles / mean, rounded, in [1, min(NUM_SPLITS, tiles)]. int32 scalar."""
    total = num_seqs * 0
    blocks = num_seqs * 0
    for first in range(0, num_seqs, CHUNK):
        s = first + tl.arange(0, CHUNK)
        ok = s < num_seqs
        n = tl.load(qsl_ptr + s + 1, mask=ok, other=0) - tl.load(qsl_ptr + s, mask=ok, other=0)
        row_blocks = (n + ROWS - 1) // ROWS
        length = tl.minimum(tl.load(seq_lens_ptr + s, mask=ok, other=0), max_len)
        total += tl.sum(row_blocks * ((length + BLOCK_N - 1) // BLOCK_N), axis=0)
        blocks += tl.sum(row_blocks, axis=0)
    blocks = tl.maximum(blocks, 1)
    mean = tl.maximum((total + blocks - 1) // blocks, 1)
    pairs = blocks * tl.num_programs(1)
    SPLITS_P2: tl.constexpr = triton.next_power_of_2(NUM_SPLITS)
    c = tl.arange(0, SPLITS_P2) + 1
    most = tl.minimum(tl.minimum(mean, (plan_wanted + pairs - 1) // pairs), NUM_SPLITS)
    cost = ((pairs * c + plan_slots - 1) // plan_slots) * ((mean + c - 1) // c + 2)
    cost = tl.where(c <= tl.maximum(most, 1), cost, 2147483647)
    best = tl.min(cost, axis=0)
    at_mean = tl.max(tl.where(cost == best, c, 0), axis=0)
    count = (2 * at_mean * tiles + mean) // (2 * mean)
    return tl.maximum(tl.minimum(tl.minimum(count, NUM_SPLITS), tiles), 1)


@triton.jit
def _split_count(split, length, qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted,
                 BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, ROWS: tl.constexpr, LENGTH_AWARE: tl.constexpr):
    """The split count a row block of context ``length`` is cut into: NUM_SPLITS, or with LENGTH_AWARE
    :func:`_row_splits`'s (only computed where this program's split can have positions: split < its tiles)."""
    count = length * 0 + NUM_SPLITS
    if LENGTH_AWARE:
        tiles = (length + BLOCK_N - 1) // BLOCK_N
        if split < tiles:
            count = _row_splits(tiles, qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted, BLOCK_N,
                                NUM_SPLITS, ROWS)
    return count


@triton.jit
def _split_span(row, kv_head, split, qsl_ptr, seq_lens_ptr, num_seqs, max_len, GROUP: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                plan_slots=0, plan_wanted=0, LENGTH_AWARE: tl.constexpr = False):
    """One split program's work: (seq, begin, end, q_heads [BLOCK_H], part [BLOCK_H], head_ok [BLOCK_H]) —
    its sequence, the positions [begin, end) of its split (whole tiles), its query heads and their rows in
    the partial outputs. Callers store -inf partials and return when begin >= end. The context is clamped to
    ``max_len`` (the block table's width in positions): a sequence length the host did not check (CUDA-graph
    replay, TQKV_CHECK_VALUES=0) cannot make the tile loop run past the table, or for ever. A row's context is
    cut into NUM_SPLITS splits, or with LENGTH_AWARE into :func:`_split_count`'s (the grid's NUM_SPLITS the most)."""
    seq, length = _row_context(row, qsl_ptr, seq_lens_ptr, num_seqs, SEARCH_STEPS)
    length = tl.minimum(length, max_len)
    count = _split_count(split, length, qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted, BLOCK_N,
                         NUM_SPLITS, 1, LENGTH_AWARE)
    per_split = tl.cdiv(tl.cdiv(length, count), BLOCK_N) * BLOCK_N
    begin = split * per_split
    end = tl.minimum(begin + per_split, length)
    h = tl.arange(0, BLOCK_H)
    q_heads = kv_head * GROUP + h
    part = (row * (GROUP * tl.num_programs(1)) + q_heads) * NUM_SPLITS + split
    return seq, begin, end, q_heads, part, h < GROUP


@triton.jit
def _rows_span(block, kv_head, split, qsl_ptr, seq_lens_ptr, num_seqs, max_len, s_qt, s_qh, GROUP: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
               SEARCH_STEPS: tl.constexpr, ROWS: tl.constexpr, plan_slots=0, plan_wanted=0,
               LENGTH_AWARE: tl.constexpr = False):
    """:func:`_split_span` for a program that serves ROWS consecutive query rows of one sequence at once (their
    GROUP query heads each: ROWS x GROUP columns), so the rows share one read of the keys and values: (seq, begin,
    end, q_off, part, head_ok, limit), ``q_off`` each column's offset in the query, ``limit`` [BLOCK_H] each
    column's causal length (its row's; ``end`` is the longest's, so a column may have no position in a split).
    Programs are numbered as vLLM's unified attention numbers its query blocks: sequence s's first is
    ``qsl[s] // ROWS + s`` (ceil(n / ROWS) blocks fit before the next sequence's first), so the grid of
    ``rows // ROWS + num_seqs`` programs is fixed by shapes; a program past its sequence's rows has no column."""
    lo = block * 0  # the sequences after the first whose first program is <= block, by bisection
    hi = lo + num_seqs - 1
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(qsl_ptr + 1 + mid, mask=mid < num_seqs - 1, other=0) // ROWS + mid + 1 <= block
        active = lo < hi
        lo = tl.where(active & go, mid + 1, lo)
        hi = tl.where(active & (go == 0), mid, hi)
    seq = lo
    start = tl.load(qsl_ptr + seq)
    stop = tl.load(qsl_ptr + seq + 1)
    first_row = start + (block - (start // ROWS + seq)) * ROWS
    h = tl.arange(0, BLOCK_H)
    row = first_row + h // GROUP
    q_heads = kv_head * GROUP + h % GROUP
    head_ok = (h < ROWS * GROUP) & (row >= start) & (row < stop)  # (rows before qsl[0]: none of sequence 0's)
    limit = tl.load(seq_lens_ptr + seq) - (stop - start) + (row - start) + 1
    limit = tl.where(head_ok, tl.minimum(limit, max_len), 0)
    longest = tl.max(limit, axis=0)
    count = _split_count(split, longest, qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted, BLOCK_N,
                         NUM_SPLITS, ROWS, LENGTH_AWARE)
    per_split = tl.cdiv(tl.cdiv(longest, count), BLOCK_N) * BLOCK_N
    begin = split * per_split
    end = tl.minimum(begin + per_split, longest)
    part = (row * (GROUP * tl.num_programs(1)) + q_heads) * NUM_SPLITS + split
    return seq, begin, end, row * s_qt + q_heads * s_qh, part, head_ok, limit


@triton.jit
def _tile_base(bt_row, s_bm, start, end, n, kv_head, s_blk, s_pos, s_head, BLOCK_SIZE: tl.constexpr,
               INDEX32: tl.constexpr):
    """Offset of each slot of the tile at start (0 past end), in the strides' unit (bytes; the stream
    kernel's 2-byte units), and its validity. int32 arithmetic with ``INDEX32`` (the host found the cache
    view spans fewer than 2^31 units), int64 otherwise. The block-id loads are the only loads here: one per
    block where whole blocks tile the tile (``start`` is then a multiple of the block size), else one per
    position."""
    pos = start + n
    valid = pos < end
    BLOCKS: tl.constexpr = n.shape[0] // BLOCK_SIZE
    if BLOCKS * BLOCK_SIZE == n.shape[0]:  # (BLOCK_SIZE a power of two: it divides the tile's)
        # one load per block (a tile of 64 reads 4 ids, not 64 replicated over the threads: fewer SASS
        # instructions in the tile loop)
        b = start // BLOCK_SIZE + tl.arange(0, BLOCKS)
        block = tl.load(bt_row + b * s_bm, mask=b * BLOCK_SIZE < end, other=0)
        if not INDEX32:
            block = block.to(tl.int64)
        slots = (block * s_blk + kv_head * s_head)[:, None] + (tl.arange(0, BLOCK_SIZE) * s_pos)[None, :]
        return tl.reshape(slots, (n.shape[0],)), valid
    upos = pos.to(tl.uint32)  # >= 0: unsigned division by the block size is a shift, not a signed fix-up
    block = tl.load(bt_row + (upos // BLOCK_SIZE).to(tl.int32) * s_bm, mask=valid, other=0)
    if not INDEX32:
        block = block.to(tl.int64)
    return block * s_blk + (upos % BLOCK_SIZE).to(tl.int32) * s_pos + kv_head * s_head, valid


@triton.jit
def _softmax_step(scores, m_i, l_i, AXIS: tl.constexpr = 1, EMPTY: tl.constexpr = False):
    """Online softmax in base 2 over one tile of scores, the positions along AXIS ([BLOCK_H, N]: 1; the stream
    kernel's transposed [N, BLOCK_H]: 0): (p, alpha, new max, new sum). EMPTY: a column may have no position yet
    (all -inf so far): its p and alpha are 0, not NaN, and its max stays -inf."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=AXIS))
    if EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - tl.expand_dims(m_use, AXIS))
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - tl.expand_dims(m_new, AXIS))
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=AXIS)


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
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    DTYPE: tl.constexpr = tl.float32 if DOT_FP32 else tl.float16

    seq, begin, end, q_heads, part, head_ok = _split_span(row, kv_head, split, qsl_ptr, seq_lens_ptr, num_seqs,
                                                          max_len, GROUP, BLOCK_H, BLOCK_N, NUM_SPLITS, SEARCH_STEPS)
    if begin >= end:
        tl.store(part_lse_ptr + part, tl.full((BLOCK_H,), float("-inf"), tl.float32), mask=head_ok)
        return

    q_a, q_b = _load_query(q_ptr, row, q_heads, head_ok, s_qt, s_qh, s_qd, D, KEY_FP8, KEY_BITS, DTYPE,
                           tl.float16)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    # Value accumulators: (even, odd) coordinates for 4-bit values, _order3 columns for 3-bit (b unused).
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
        base, valid = _tile_base(bt_row, s_bm, start, end, n, kv_head, s_blk, s_pos, s_head, BLOCK_SIZE, False)

        scores = _key_scores(q_a, q_b, cache_ptr, cent_ptr, base, valid, s_byte, D, KEY_FP8, KEY_BITS,
                             KEY_CODE_BYTES, NORM_CORRECTION, DTYPE, "ieee" if DOT_FP32 else None, tl.float16)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i)

        vbase = base + VALUE_OFFSET * s_byte
        vscale = _load_fp16(cache_ptr, vbase + VALUE_CODE_BYTES * s_byte, valid)
        vzero = _load_fp16(cache_ptr, vbase + (VALUE_CODE_BYTES + 2) * s_byte, valid)
        ps = _operand(p * vscale[None, :], DTYPE)
        # codes enter the dot as code * 2^-24 (:func:`_codes_f16`); the zero point beside it, in fp32
        shift = shift * alpha + tl.sum(p * vzero[None, :], axis=1)
        if VALUE_BITS == 4:
            even, odd = _load_nibbles(cache_ptr, vbase, valid, s_byte, D)
            # each tile's dot from zero, added in fp32 (_decode_stream_kernel says why)
            rescale = tl.broadcast_to(alpha[:, None], acc_a.shape)
            acc_a = tl.fma(acc_a, rescale, tl.dot(ps, _codes_f16(even).to(DTYPE)))
            acc_b = tl.fma(acc_b, rescale, tl.dot(ps, _codes_f16(odd).to(DTYPE)))
        else:
            codes = _load_codes3(cache_ptr, vbase, valid, s_byte, D)
            rescale = tl.broadcast_to(alpha[:, None], acc_a.shape)
            acc_a = tl.fma(acc_a, rescale, tl.dot(ps, _codes_f16(codes).to(DTYPE)))

    inv = 1.0 / l_i
    shift = shift * inv
    inv = inv * 16777216.0  # 2^24: the codes' unit (_codes_f16)
    rows_out = part_out_ptr + part[:, None] * D
    if VALUE_BITS == 4:
        i = tl.arange(0, D // 2)
        tl.store(rows_out + (2 * i)[None, :], acc_a * inv[:, None] + shift[:, None], mask=head_ok[:, None])
        tl.store(rows_out + (2 * i + 1)[None, :], acc_b * inv[:, None] + shift[:, None], mask=head_ok[:, None])
    else:
        tl.store(rows_out + _order3(D)[None, :], acc_a * inv[:, None] + shift[:, None], mask=head_ok[:, None])
    tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=head_ok)


@triton.jit
def _centroids_sym16(code, cent_ptr, OUT: tl.constexpr):
    """4-bit codes -> fp32 centroids, using the table's sign symmetry c[15 - i] = -c[i]: an 8-way select on
    the folded index, then the sign."""
    upper = code >= 8
    folded = tl.where(upper, 15 - code, code)
    ty: tl.constexpr = OUT
    mag = _select8(folded, _operand(tl.load(cent_ptr + 0), ty), _operand(tl.load(cent_ptr + 1), ty),
                   _operand(tl.load(cent_ptr + 2), ty), _operand(tl.load(cent_ptr + 3), ty),
                   _operand(tl.load(cent_ptr + 4), ty), _operand(tl.load(cent_ptr + 5), ty),
                   _operand(tl.load(cent_ptr + 6), ty), _operand(tl.load(cent_ptr + 7), ty))
    return tl.where(upper, -mag, mag)


@triton.jit
def _load_field_h(eptr, base_h, offset: tl.constexpr, nbytes: tl.constexpr, WORD: tl.constexpr,
                  THIRDS: tl.constexpr = False):
    """The nbytes-byte field at byte offset ``offset`` of the slots at ``base_h`` (2-byte units) as WORD-byte
    little-endian words, int32 [N, nbytes / WORD] (zero-extended); unmasked. With THIRDS (3-bit codes, 2-byte
    words): int32 [N, nbytes / 6, 2], each group of 16 codes (three words w0, w1, w2) as (w0 | w1 << 16, w2),
    its three loads in one layout so that each thread holds a whole group (no exchange between lanes)."""
    if WORD == 2:
        word = base_h + offset // 2
    else:  # 4-byte words: base_h + offset / 2 is even (the host checked the alignment), >= 0
        word = ((base_h + offset // 2).to(tl.uint32 if base_h.dtype == tl.int32 else tl.uint64) // 2).to(base_h.dtype)
    # not masked: past the end a position's block id loads as 0 (_tile_base), so its address is a slot of
    # block 0, inside the cache; what it reads there is dropped (its score is -inf, its p is 0, and code
    # lookups are finite, fp8 keys' NaN included: the score is replaced)
    if THIRDS:
        tl.static_assert(WORD == 2, "3-bit fields are read as 16-bit words")
        # each load built as [groups, N] and transposed: its lanes then run along the groups first, and the
        # fp16 tile unpacked from it reaches shared memory in 16-byte stores instead of 2-byte ones (3bit_nc:
        # 16 STS.128 a tile instead of 128 STS.U16)
        g = tl.arange(0, nbytes // 6) * 3
        w0 = tl.trans(tl.load(eptr + g[:, None] + word[None, :])).to(tl.int32) & 0xFFFF
        w1 = tl.trans(tl.load(eptr + (g + 1)[:, None] + word[None, :])).to(tl.int32) & 0xFFFF
        w2 = tl.trans(tl.load(eptr + (g + 2)[:, None] + word[None, :])).to(tl.int32) & 0xFFFF
        raw = tl.join(w0 | (w1 << 16), w2)
    else:
        j = tl.arange(0, nbytes // WORD)
        raw = tl.load(eptr + word[:, None] + j[None, :])
        if WORD == 2:
            raw = raw.to(tl.int32) & 0xFFFF
    return raw


@triton.jit
def _load_half_h(hptr, base_h, valid, offset: tl.constexpr):
    """The fp16 at byte offset ``offset`` of the slots at ``base_h`` (2-byte units) -> fp32 [N], 0 where not
    valid."""
    return tl.load(hptr + base_h + offset // 2, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _unpack(words, BITS: tl.constexpr, WORD: tl.constexpr):
    """int32 words [N, W] of BITS-bit fields -> int32 [N, W * 8 * WORD / BITS] in natural order (field k of
    word j is column j * per + k: little-endian fields are consecutive coordinates)."""
    PER: tl.constexpr = 8 * WORD // BITS
    k = tl.arange(0, PER)
    fields = (words[:, :, None] >> (k * BITS)[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(fields, (words.shape[0], words.shape[1] * PER))


@triton.jit
def _join4(a, b, c, d):
    """Four [N, W] tensors -> [N, 4 W]: column 4 j + k holds the k-th tensor's column j."""
    x = tl.join(tl.join(a, c), tl.join(b, d))  # [N, W, 2, 2]: [.., i, j] is the (2 i + j)-th tensor
    return tl.reshape(x, (a.shape[0], a.shape[1] * 4))


@triton.jit
def _pair_columns(low, high):
    """The asm converters' outputs (pack=2: [N, W, 2] each, low[n, j, :] = fp16 columns 4 j, 4 j + 1 and
    high[n, j, :] = columns 4 j + 2, 4 j + 3, as the pairs the asm built) -> fp16 [N, 4 W] in column order."""
    x = tl.permute(tl.join(low, high), (0, 1, 3, 2))  # [N, W, (low, high), pair]
    return tl.reshape(x, (low.shape[0], low.shape[1] * 4))


@triton.jit
def _lut4_fp16(words, lut_ptr):
    """int32 [N, W] holding four 4-bit codes each (low 16 bits, little-endian) -> fp16 [N, 4 W] in natural
    order, each code looked up in a 16-entry fp16 table by byte permutes (PTX ``prmt``; GPU only). The table
    is 8 int32 at lut_ptr: the low bytes of entries 0-3, 4-7, 8-11, 12-15, then the high bytes likewise.
    11 instructions per four codes: prmt picks the low and high bytes from the lower- and upper-half
    tables (the code's low 3 bits index 8 bytes), a byte mask from bit 3 of each code (prmt's sign-replicate
    mode) chooses between the halves, and two prmt interleave low and high bytes into fp16 pairs. The pairs
    leave the asm as they are (pack=2: each output register holds two fp16 of one word), not as four 16-bit
    values to be paired again."""
    t0, t1, t2, t3 = tl.load(lut_ptr + 0), tl.load(lut_ptr + 1), tl.load(lut_ptr + 2), tl.load(lut_ptr + 3)
    t4, t5, t6, t7 = tl.load(lut_ptr + 4), tl.load(lut_ptr + 5), tl.load(lut_ptr + 6), tl.load(lut_ptr + 7)
    low, high = tl.inline_asm_elementwise(
        """{
        .reg .b32 f, s, m, ll, lu, hl, hu, lo, hi;
        and.b32 f, $2, 0x7777;
        prmt.b32 ll, $4, $6, f;
        prmt.b32 lu, $8, $10, f;
        prmt.b32 hl, $12, $14, f;
        prmt.b32 hu, $16, $18, f;
        shl.b32 s, $2, 4;
        prmt.b32 m, $2, s, 0x9D8C;
        lop3.b32 lo, ll, lu, m, 0xD8;
        lop3.b32 hi, hl, hu, m, 0xD8;
        prmt.b32 $0, lo, hi, 0x5140;
        prmt.b32 $1, lo, hi, 0x7362;
        }""",
        "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        [tl.join(words, words), t0, t1, t2, t3, t4, t5, t6, t7],  # pack=2: the asm reads the first copy of each
        dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    return _pair_columns(low, high)


@triton.jit
def _codes4_fp16_odd16(words):
    """int32 [N, W] holding four 4-bit uniform codes each (low 16 bits, little-endian) -> fp16 [N, 4 W] in
    natural order: code * 2^-24 in even columns, 16 * code * 2^-24 in odd ones (fp16 subnormals, exact; see
    :func:`_codes_f16`), by two byte permutes and two ands per four codes (PTX; GPU only). A code byte's two
    nibbles go to the two halves of an fp16 pair as they are, the high one 4 bits up: that is the factor 16,
    which the caller takes out of the odd columns once per program instead of shifting every code
    (:func:`_odd16_codes` is the same without asm). Emulated bit-exactly in Python for all 2^16 words."""
    low, high = tl.inline_asm_elementwise(
        """{
        .reg .b32 x, y;
        prmt.b32 x, $2, 0, 0x4040;
        prmt.b32 y, $2, 0, 0x4141;
        and.b32 $0, x, 0x00F0000F;
        and.b32 $1, y, 0x00F0000F;
        }""",
        "=r,=r,r,r",
        [tl.join(words, words)],  # pack=2: both copies of a word reach the asm, it reads the first
        dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    return _pair_columns(low, high)


@triton.jit
def _odd16_codes(codes, D: tl.constexpr):
    """int32 codes [N, D] in [0, 16) -> fp16 code * 2^-24 (even columns), 16 * code * 2^-24 (odd columns):
    what :func:`_codes4_fp16_odd16` returns, without asm."""
    return _codes_f16(codes << ((tl.arange(0, D) & 1) * 4)[None, :])


@triton.jit
def _fp8x4_fp16(words):
    """int32 [N, W] holding four fp8 e4m3 bytes each -> fp16 [N, 4 W] in natural order by the hardware's
    two-at-a-time conversion (``cvt.rn.f16x2.e4m3x2``; GPU only)."""
    low, high = tl.inline_asm_elementwise(
        """{
        .reg .b16 l, h;
        mov.b32 {l, h}, $2;
        cvt.rn.f16x2.e4m3x2 $0, l;
        cvt.rn.f16x2.e4m3x2 $1, h;
        }""",
        "=r,=r,r,r", [tl.join(words, words)], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    return _pair_columns(low, high)


@triton.jit
def _quads3(words):
    """:func:`_load_field_h`'s THIRDS tile [N, G, 2] -> four int32 [N, G] whose low 12 bits hold codes 4 q ..
    4 q + 3 of each group of 16 (48 bits, little-endian: code k at bit 3 k); register-local."""
    lo, hi = tl.split(words)  # bits 0-31, bits 32-47
    return lo, lo >> 12, ((lo >> 24) & 0xFF) | (hi << 8), hi >> 4


@triton.jit
def _join16(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """Sixteen [N, G] tensors -> [N, 16 G]: column 16 g + k holds the k-th tensor's column g (tl.join adds a
    last axis; the flattening takes the innermost join's axis as the most significant)."""
    even = tl.join(tl.join(tl.join(c0, c8), tl.join(c4, c12)), tl.join(tl.join(c2, c10), tl.join(c6, c14)))
    odd = tl.join(tl.join(tl.join(c1, c9), tl.join(c5, c13)), tl.join(tl.join(c3, c11), tl.join(c7, c15)))
    x = tl.join(even, odd)
    return tl.reshape(x, (c0.shape[0], c0.shape[1] * 16))


@triton.jit
def _join_quads(y0, y1, y2, y3):
    """Four [N, 4 G] tensors (quad q of each group of 16 codes: column 4 g + k is code 4 q + k of group g)
    -> [N, 16 G] in natural order (column 16 g + 4 q + k)."""
    shape: tl.constexpr = (y0.shape[0], y0.shape[1] // 4, 4)
    x = tl.join(tl.join(tl.reshape(y0, shape), tl.reshape(y2, shape)),
                tl.join(tl.reshape(y1, shape), tl.reshape(y3, shape)))  # [N, G, 4 (k), 2 (i), 2 (j)]: quad 2 i + j
    return tl.reshape(tl.permute(x, (0, 1, 3, 4, 2)), (y0.shape[0], y0.shape[1] * 4))


@triton.jit
def _codes3(x, k: tl.constexpr):
    return (x >> (3 * k)) & 7


@triton.jit
def _centroids3x4(x, cent_ptr, DTYPE: tl.constexpr):
    """The four 3-bit codes in the low 12 bits of x -> their centroids in DTYPE, by a select tree (the
    interpreter's path of :func:`_keys3`)."""
    return (_operand(_centroids(_codes3(x, 0), cent_ptr, 3), DTYPE),
            _operand(_centroids(_codes3(x, 1), cent_ptr, 3), DTYPE),
            _operand(_centroids(_codes3(x, 2), cent_ptr, 3), DTYPE),
            _operand(_centroids(_codes3(x, 3), cent_ptr, 3), DTYPE))


@triton.jit
def _keys3(words, lut_ptr, cent_ptr, ASM: tl.constexpr, DTYPE: tl.constexpr):
    """3-bit Lloyd-Max key codes (a THIRDS tile) -> their centroids [N, D] in natural order, in DTYPE: by byte
    permutes on the GPU (:func:`_lut3_fp16`), by a select tree otherwise."""
    x0, x1, x2, x3 = _quads3(words)
    if ASM:
        cent = _join_quads(_pair_columns(*_lut3_fp16(x0, lut_ptr)), _pair_columns(*_lut3_fp16(x1, lut_ptr)),
                           _pair_columns(*_lut3_fp16(x2, lut_ptr)), _pair_columns(*_lut3_fp16(x3, lut_ptr)))
    else:
        a0, a1, a2, a3 = _centroids3x4(x0, cent_ptr, DTYPE)
        b0, b1, b2, b3 = _centroids3x4(x1, cent_ptr, DTYPE)
        c0, c1, c2, c3 = _centroids3x4(x2, cent_ptr, DTYPE)
        d0, d1, d2, d3 = _centroids3x4(x3, cent_ptr, DTYPE)
        cent = _join16(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3)
    return cent


@triton.jit
def _codes3x4_f16(x):
    """The four 3-bit codes in the low 12 bits of x -> fp16 code * 2^-24 each (exact)."""
    return (_codes_f16(_codes3(x, 0)), _codes_f16(_codes3(x, 1)), _codes_f16(_codes3(x, 2)),
            _codes_f16(_codes3(x, 3)))


@triton.jit
def _values3_f16(words):
    """3-bit uniform value codes (a THIRDS tile) -> fp16 code * 2^-24 [N, D] in natural order (exact)."""
    x0, x1, x2, x3 = _quads3(words)
    a0, a1, a2, a3 = _codes3x4_f16(x0)
    b0, b1, b2, b3 = _codes3x4_f16(x1)
    c0, c1, c2, c3 = _codes3x4_f16(x2)
    d0, d1, d2, d3 = _codes3x4_f16(x3)
    return _join16(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3)


@triton.jit
def _lut3_fp16(words, lut_ptr):
    """int32 [N, G] whose low 12 bits hold four 3-bit codes -> their fp16 centroids as :func:`_pair_columns`
    takes them (two [N, G, 2]: codes 0, 1 and codes 2, 3), each code looked up in an 8-entry fp16 table by
    byte permutes (PTX ``prmt``; GPU only): the codes spread into the nibbles of a selector (three shifts,
    three lop3), then prmt picks the low and the high bytes from the table's halves and two prmt pair them.
    The table: :func:`key_lut`'s words 0, 1 (low bytes of entries 0-3, 4-7) and 4, 5 (high bytes)."""
    t0, t1, t2, t3 = tl.load(lut_ptr + 0), tl.load(lut_ptr + 1), tl.load(lut_ptr + 4), tl.load(lut_ptr + 5)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 s, a, lo, hi;
        and.b32 s, $2, 7;
        shl.b32 a, $2, 1;
        lop3.b32 s, s, a, 0x70, 0xF8;
        shl.b32 a, $2, 2;
        lop3.b32 s, s, a, 0x700, 0xF8;
        shl.b32 a, $2, 3;
        lop3.b32 s, s, a, 0x7000, 0xF8;
        prmt.b32 lo, $4, $6, s;
        prmt.b32 hi, $8, $10, s;
        prmt.b32 $0, lo, hi, 0x5140;
        prmt.b32 $1, lo, hi, 0x7362;
        }""",
        "=r,=r,r,r,r,r,r,r,r,r,r,r",
        [tl.join(words, words), t0, t1, t2, t3],  # pack=2: the asm reads the first copy of each
        dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


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
    return _operand(acc * Q_POST, DTYPE)


@triton.jit
def _stream_fields(kptr, vptr, hptr, base, valid, KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr,
                   KEY_CODE_BYTES: tl.constexpr, KEY_WORD: tl.constexpr, VALUE_BITS: tl.constexpr,
                   VALUE_OFFSET: tl.constexpr, VALUE_CODE_BYTES: tl.constexpr, VALUE_WORD: tl.constexpr):
    """One tile's loads for the stream kernel: (key words, value words, value scale, value zero, key norm) of
    the slots at ``base`` (fp8 keys have no norm of their own: the value scale stands in, unused)."""
    kw = _load_field_h(kptr, base, 0, KEY_CODE_BYTES, KEY_WORD, KEY_BITS == 3)
    vw = _load_field_h(vptr, base, VALUE_OFFSET, VALUE_CODE_BYTES, VALUE_WORD, VALUE_BITS == 3)
    vscale = _load_half_h(hptr, base, valid, VALUE_OFFSET + VALUE_CODE_BYTES)
    vzero = _load_half_h(hptr, base, valid, VALUE_OFFSET + VALUE_CODE_BYTES + 2)
    if KEY_FP8:
        knorm = vscale
    else:
        knorm = _load_half_h(hptr, base, valid, KEY_CODE_BYTES)
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
    """The split kernel's contract (see :func:`_decode_split_kernel`) for fp8, 4-bit or 3-bit Lloyd-Max keys with
    4-bit or 3-bit uniform values (vLLM's four presets), a cache whose last stride is 1 and whose fields are WORD-
    byte aligned, its strides given in 2-byte units (h_blk, h_pos, h_head; int32 indexing with INDEX32, when the
    view spans fewer than 2^31 such units): every field is read as WORD-byte words and unpacked into natural
    coordinate order (no query permutation). Its dots are turned around against the other kernels': scores^T = K .
    q^T and acc^T += V^T . P^T, so the query group is the dots' N side (``BLOCK_H`` >= 8) and the tile's positions
    their M side (mma.sync m16n8k16 as triton 3.6 compiles it for the H200; wgmma with 3.9): a group of 4 pads to 8
    instead of 16, which halves the softmax, scaling and accumulator work. With
    PREFETCH, the next tile's words and the tile after's block ids are loaded before the current tile is computed
    (software pipelining by hand: the loads are in flight during the math). With QUERY_IN_KERNEL, ``q_ptr`` is the
    model's query and :func:`_stream_query` rotates and scales it (no launch of :func:`prepare_query`); otherwise it
    is prepare_query's. ROWS > 1: a program serves that many consecutive query rows of a sequence
    (:func:`_rows_span`; grid axis 0 counts row blocks), each column masked at its own causal length.
    LENGTH_AWARE: a row block's split count from the batch's lengths (:func:`_row_splits`, at most NUM_SPLITS)."""
    wait_and_release(GDC)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    DTYPE: tl.constexpr = tl.float32 if DOT_FP32 else tl.float16
    PRECISION: tl.constexpr = "ieee" if DOT_FP32 else None
    kptr = cache_ptr.to(tl.pointer_type(tl.int32 if KEY_WORD == 4 else tl.int16), bitcast=True)
    vptr = cache_ptr.to(tl.pointer_type(tl.int32 if VALUE_WORD == 4 else tl.int16), bitcast=True)
    hptr = cache_ptr.to(tl.pointer_type(tl.float16), bitcast=True)

    if ROWS == 1:
        seq, begin, end, q_heads, part, head_ok = _split_span(row, kv_head, split, qsl_ptr, seq_lens_ptr,
                                                              num_seqs, max_len, GROUP, BLOCK_H, BLOCK_N,
                                                              NUM_SPLITS, SEARCH_STEPS, plan_slots, plan_wanted,
                                                              LENGTH_AWARE)
        q_off = row * s_qt + q_heads * s_qh
        limit = end
    else:
        seq, begin, end, q_off, part, head_ok, limit = _rows_span(row, kv_head, split, qsl_ptr, seq_lens_ptr,
                                                                  num_seqs, max_len, s_qt, s_qh, GROUP, BLOCK_H,
                                                                  BLOCK_N, NUM_SPLITS, SEARCH_STEPS, ROWS,
                                                                  plan_slots, plan_wanted, LENGTH_AWARE)
    if begin >= end:
        tl.store(part_lse_ptr + part, tl.full((BLOCK_H,), float("-inf"), tl.float32), mask=head_ok)
        return

    d = tl.arange(0, D)
    if QUERY_IN_KERNEL:
        q = _stream_query(q_ptr, signs_ptr, q_off, head_ok, s_qd, D, BLOCK_H, ROTATE_QUERY, Q_PRE, Q_POST, DTYPE,
                          PRECISION)
    else:
        q = tl.load(q_ptr + q_off[:, None] + d[None, :] * s_qd, mask=head_ok[:, None], other=0.0)
        q = _operand(q, DTYPE)
    if NORM_CORRECTION:
        ones = tl.full((D, BLOCK_H), 1.0, DTYPE)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((D, BLOCK_H), tl.float32)  # transposed: the query group is the dots' N side
    zsum = tl.zeros((BLOCK_H,), tl.float32)  # sum of P * zero: the affine part of P.V
    bt_row = block_table_ptr + seq.to(tl.int64) * s_bt
    n = tl.arange(0, BLOCK_N)

    base, valid = _tile_base(bt_row, s_bm, begin, end, n, kv_head, h_blk, h_pos, h_head, BLOCK_SIZE,
                               INDEX32)
    kw, vw, vscale, vzero, knorm = _stream_fields(kptr, vptr, hptr, base, valid, KEY_FP8, KEY_BITS, KEY_CODE_BYTES,
                                                  KEY_WORD, VALUE_BITS, VALUE_OFFSET, VALUE_CODE_BYTES, VALUE_WORD)
    if PREFETCH:
        base_next, valid_next = _tile_base(bt_row, s_bm, begin + BLOCK_N, end, n, kv_head, h_blk, h_pos, h_head,
                                           BLOCK_SIZE, INDEX32)
    for start in range(begin, end, BLOCK_N):
        if PREFETCH:
            # issue the next tile's loads and the block ids after it; the math below runs while they fly
            kw_n, vw_n, vscale_n, vzero_n, knorm_n = _stream_fields(
                kptr, vptr, hptr, base_next, valid_next, KEY_FP8, KEY_BITS, KEY_CODE_BYTES, KEY_WORD, VALUE_BITS,
                VALUE_OFFSET, VALUE_CODE_BYTES, VALUE_WORD)
            base_after, valid_after = _tile_base(bt_row, s_bm, start + 2 * BLOCK_N, end, n, kv_head, h_blk, h_pos,
                                                 h_head, BLOCK_SIZE, INDEX32)
        valid = start + n < end

        # ---- keys -> scores^T [BLOCK_N, BLOCK_H] = K . q^T: the positions are the dot's M side, the query group
        # its N side (>= 8: a group of 4 pads to 8 columns, where q . K^T padded it to 16 rows)
        if KEY_FP8:
            if ASM:
                keys = _fp8x4_fp16(kw)
            else:
                keys = _unpack(kw, 8, KEY_WORD).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
            scores = tl.dot(keys, tl.trans(q), input_precision=PRECISION)
        else:
            if KEY_BITS == 3:
                cent = _keys3(kw, key_lut_ptr, cent_ptr, ASM, DTYPE)
            elif ASM:
                cent = _lut4_fp16(kw, key_lut_ptr)
            else:
                cent = _centroids_sym16(_unpack(kw, 4, KEY_WORD), cent_ptr, DTYPE)  # the table in DTYPE, selected
            scores = tl.dot(cent, tl.trans(q), input_precision=PRECISION)
            if NORM_CORRECTION:  # ||c||^2 by a dot with ones: on the tensor cores, in the scores' layout
                sumsq = tl.dot(_operand(cent * cent, DTYPE), ones, input_precision=PRECISION)
                scores = scores * (knorm[:, None] / tl.sqrt(sumsq + 1e-16))
            else:
                scores = scores * knorm[:, None]
        if ROWS == 1:
            scores = tl.where(valid[:, None], scores, float("-inf"))
        else:  # each column its own row's causal length (<= end)
            scores = tl.where((start + n)[:, None] < limit[None, :], scores, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i, 0, ROWS > 1)

        # ---- values: P.V = (P * scale) . code + P . zero, the codes as fp16 f * code * 2^-24 with f = 1 in even
        # columns and 16 in odd ones (the cheapest exact unpacking); 2^-24 and f come out after the loop.
        # acc^T [D, BLOCK_H] += V^T . (P * scale)^T
        ps = _operand(p * vscale[:, None], DTYPE)
        zsum = zsum * alpha + tl.sum(p * vzero[:, None], axis=0)
        if VALUE_BITS == 3:
            vcodes = _values3_f16(vw).to(DTYPE)
        elif ASM:
            vcodes = _codes4_fp16_odd16(vw)
        else:
            vcodes = _odd16_codes(_unpack(vw, 4, VALUE_WORD), D).to(DTYPE)
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
            base, valid_t = _tile_base(bt_row, s_bm, start + BLOCK_N, end, n, kv_head, h_blk, h_pos, h_head,
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


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, s_ot, s_oh, s_od,
                  NUM_HEADS: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                  CHUNK: tl.constexpr, GDC: tl.constexpr = False):
    """One (row, head): the splits' partial outputs weighted by their log-sum-exps. The partials are read in
    chunks of ``CHUNK`` splits (:func:`merge_chunk`: 128 up to head 128, 64 above), so that a launch of many
    splits at a large head size does not hold them all in registers."""
    wait_and_release(GDC)
    row = tl.program_id(0)
    head = tl.program_id(1)
    base = (row * NUM_HEADS + head) * NUM_SPLITS
    s = tl.arange(0, SPLITS_P2)
    top = tl.max(tl.load(part_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf")), axis=0)
    d = tl.arange(0, D)
    acc = tl.zeros([D], dtype=tl.float32)
    total = 0.0
    for first in tl.static_range(0, SPLITS_P2, CHUNK):
        c = first + tl.arange(0, CHUNK)
        lse = tl.load(part_lse_ptr + base + c, mask=c < NUM_SPLITS, other=float("-inf"))
        live = lse > float("-inf")
        weight = tl.where(live, tl.exp2(lse - top), 0.0)
        parts = tl.load(part_out_ptr + (base + c)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        total += tl.sum(weight, axis=0)
        acc += tl.sum(parts * weight[:, None], axis=0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * s_ot + head * s_oh + d * s_od, out.to(out_ptr.dtype.element_ty))


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


def default_kernel(preset: Preset, kv_cache: torch.Tensor, device: torch.device) -> str:
    """The stream kernel wherever it can read the cache (vLLM's four presets from a byte-contiguous view with
    2-byte-aligned fields and strides: every cache vLLM allocates), else the byte kernel (any view)."""
    return "stream" if stream_words(preset, kv_cache, asm=device.type == "cuda") is not None else "bytes"


def require_vllm_layout(preset: Preset) -> None:
    """These kernels (and triton_kv_write's, triton_kv_dot's) read vLLM's four slot layouts only: a preset of
    ours given to them would be read as garbage (or past the cache's end), so it is refused;
    :mod:`tqkv_compile.lowerings.triton_general` serves those."""
    if not preset.vllm_layout:
        raise ValueError(f"{preset.name}: not one of vLLM's slot layouts; presets of ours run on triton_general's "
                         "kernels (the triton backend picks them)")


def _plain_launch(kernel):
    return kernel


def _traced(launch):
    """``launch`` for a launcher that takes None for a plain launch (prepare_query)."""
    return None if launch is _plain_launch else launch


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, preset: Preset,
                     rotation: torch.Tensor, centroids: torch.Tensor, *, splits: int | None = None,
                     block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     kernel: str | None = None,
                     prefetch: int | None = None, stage: int | None = None, asm: bool = True,
                     maxnreg: int | None = None, lut: torch.Tensor | None = None,
                     index32: bool | None = None, signs: torch.Tensor | None = None,
                     query_in_kernel: bool | None = None, launch=None,
                     out: torch.Tensor | None = None, key_table: int | None = None,
                     rows_per_program: int | None = None, length_aware: bool = False) -> torch.Tensor:
    """query [T, Hq, D] -> out [T, Hq, D] (query dtype); see the module docstring and ops.attention.
    ``kernel``: "stream" or "bytes" (default: :func:`default_kernel`); the other keywords are tuning
    knobs (the measured best by default). ``lut``: the stream kernel's key lookup table (default:
    :func:`key_lut`, built once per preset and device). ``index32``: the stream kernel's int32 indexing
    (default: wherever the cache view spans fewer than 2^31 half-words; False forces int64). ``signs``: the
    stream kernel's rotation as +-1 (default: :func:`rotation_signs`); ``query_in_kernel``: the stream kernel
    rotates and scales the query itself (default: for fp8 keys, whose query is only scaled, with fp16 / bf16
    queries and interpreted; False: a :func:`prepare_query` launch first). ``launch``: wraps
    each kernel before its launch (``torch.library.wrap_triton`` when traced for Inductor, see
    :mod:`tqkv_compile.lowerings.inductor_ops`). ``out``: where the merge stores the answer (the query's shape
    and dtype, any strides; default a new tensor). ``prefetch``: the stream kernel's hand prefetch (a bool,
    default off) or the fragment kernel's PREFETCH (0, 1 or 2, default :func:`gluon_decode.default_prefetch`;
    True is 1 there), whichever kernel runs; ``stage``: the fragment kernel's STAGE (0, 1 or 2; default
    :func:`gluon_decode.default_stage`; the other kernels have none and ignore it).
    ``maxnreg``: the register cap (default: the measured one for the kernel and ``prefetch``). ``key_table``: the
    fragment kernel's 4-bit key lookup (0: byte permutes, 8 / 32: a table of pairs in shared memory with that many
    copies; default :func:`gluon_decode.default_key_table`; the other kernels ignore it). ``rows_per_program``:
    query rows of a sequence the stream kernel serves from one read of the cache (default
    :func:`packed_rows`, which also makes the launcher take the stream kernel where it is above 1; the
    other kernels serve one row a program). ``length_aware``: the stream and fragment kernels cut each row
    block's context into a split count from the batch's lengths (:func:`launch_choices.row_splits`; at most
    ``splits``, the grid's, :func:`launch_choices.split_grid`'s where ``splits`` is not given); False (the
    default until it is timed on a GPU: docs/performance-history.md): every row into ``splits``."""
    require_vllm_layout(preset)
    if launch is None:
        launch = _plain_launch
    rows, heads, dim = query.shape
    kv_heads = kv_cache.shape[2]
    group = heads // kv_heads
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out: expected {tuple(query.shape)} {query.dtype} on {query.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if rows == 0:
        return out
    interpret = query.device.type == "cpu"
    max_len = block_table.shape[1] * kv_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    packed = packed_rows(rows, num_seqs, group) if rows_per_program is None else rows_per_program
    if kernel is None:
        kernel = default_kernel(preset, kv_cache, query.device)
        if kernel == "stream" and packed == 1 and launch is _plain_launch and \
                gluon_decode.wanted(preset, kv_cache, group, rows, max_len, query.device):
            kernel = "fragments"  # where it is faster (not traced by Inductor: launched here)
    elif kernel == "fragments":
        if (why := gluon_decode.supports(preset, kv_cache, group, query.device, stage)) is not None:
            raise ValueError(f"kernel='fragments': {why}")
        if launch is not _plain_launch:
            raise ValueError("kernel='fragments': a Gluon kernel is not launched from Inductor's code (yet)")
    if kernel not in ("stream", "bytes", "fragments"):
        raise ValueError(f"kernel: expected 'stream', 'bytes' or 'fragments', got {kernel!r}")
    if kernel != "stream":
        if rows_per_program not in (None, 1):
            raise ValueError(f"rows_per_program={rows_per_program}: the {kernel} kernel serves one row a program")
        packed = 1
    elif packed < 1 or packed * group > 64:
        raise ValueError(f"rows_per_program: expected 1 .. {64 // group} at a query-head group of {group}, "
                         f"got {packed}")
    if kernel == "fragments":
        block_n, num_warps = gluon_decode.BLOCK_N, gluon_decode.NUM_WARPS
        prefetch, stage = gluon_decode.loop_settings(preset, prefetch, stage)
        maxnreg = maxnreg or gluon_decode.maxnreg(dim, prefetch)
    if block_n is None:
        block_n = stream_block_n(preset, kernel, rows, kv_heads, max_len, query.device)
    if kernel == "stream" and not interpret:
        maxnreg = maxnreg or stream_maxnreg(dim)
    occupancy = programs_per_sm(maxnreg, num_warps or 4) if kernel != "bytes" and maxnreg else None
    length_aware = length_aware and kernel != "bytes"
    if splits is None:
        most = 256 if kernel == "stream" else 128
        splits = num_splits(triton.cdiv(rows, packed), kv_heads, max_len, query.device, block_n, occupancy,
                            most_splits=most)
        if length_aware:
            splits = split_grid(splits, num_seqs, max_len, block_n, most)
    plan_slots, plan_wanted = plan_capacity(query.device, occupancy)
    part_out = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=query.device)
    # row blocks cover the sequences' rows only: rows past the last sequence (a padded batch) get no program, and
    # -inf partials make the merge answer 0 for them, as the one-row programs do
    if packed == 1:
        part_lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=query.device)
    else:
        part_lse = torch.full((rows, heads, splits), float("-inf"), dtype=torch.float32, device=query.device)
    pdl = dependent_launch.options(query.device, traced=launch is not _plain_launch)
    common = dict(GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_SIZE=kv_cache.shape[1],
                  BLOCK_N=block_n, NUM_SPLITS=splits, SEARCH_STEPS=max(1, math.ceil(math.log2(num_seqs + 1))),
                  KEY_FP8=preset.key_fp8, KEY_BITS=preset.key_bits, KEY_CODE_BYTES=preset.key_code_bytes,
                  NORM_CORRECTION=preset.norm_correction, VALUE_BITS=preset.value_bits,
                  VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes, DOT_FP32=interpret)
    if kernel == "stream":
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
            q = prepare_query(query, rotation if rotate else None, scale * LOG2E, _traced(launch))
            signs = q
        lut = lut if lut is not None else key_lut(preset, query.device)
        grid_rows = rows if packed == 1 else rows // packed + num_seqs  # (see _rows_span)
        launch(_decode_stream_kernel)[(grid_rows, kv_heads, splits)](
            q, signs, kv_cache, block_table, seq_lens, query_start_loc, centroids, lut, part_out, part_lse,
            num_seqs, max_len, plan_slots, plan_wanted, *q.stride(), *block_table.stride(),
            *(st // 2 for st in kv_cache.stride()[:3]),
            GROUP=common["GROUP"], BLOCK_H=max(8, triton.next_power_of_2(group * packed)), D=dim, BLOCK_SIZE=kv_cache.shape[1], BLOCK_N=block_n,
            NUM_SPLITS=splits, SEARCH_STEPS=common["SEARCH_STEPS"], KEY_FP8=preset.key_fp8,
            KEY_BITS=preset.key_bits, KEY_CODE_BYTES=preset.key_code_bytes, NORM_CORRECTION=preset.norm_correction,
            VALUE_BITS=preset.value_bits, VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes, DOT_FP32=interpret,
            KEY_WORD=words[0], VALUE_WORD=words[1], ASM=words[2], PREFETCH=bool(prefetch),
            INDEX32=index32 is not False and halves_span(kv_cache) < 2**31,
            QUERY_IN_KERNEL=query_in_kernel, ROTATE_QUERY=rotate and query_in_kernel,
            Q_PRE=q_pre if query_in_kernel else 1.0, Q_POST=q_scale / q_pre if query_in_kernel else 1.0,
            ROWS=packed, LENGTH_AWARE=length_aware, num_warps=num_warps or 4, num_stages=num_stages or 1,
            **pdl,
            **({} if maxnreg is None else {"maxnreg": maxnreg}),
        )
    elif kernel == "fragments":
        q = prepare_query(query, None if preset.key_fp8 else rotation, scale * LOG2E)
        gluon_decode.launch(q, kv_cache, block_table, seq_lens, query_start_loc, part_out, part_lse, preset, group,
                            splits, common["SEARCH_STEPS"], prefetch, stage, maxnreg, key_table,
                            (plan_slots, plan_wanted) if length_aware else None)
    elif kernel == "bytes":
        q = prepare_query(query, None if preset.key_fp8 else rotation, scale * LOG2E, _traced(launch))
        launch(_decode_split_kernel)[(rows, kv_heads, splits)](
            q, kv_cache, block_table, seq_lens, query_start_loc, centroids, part_out, part_lse,
            num_seqs, max_len,
            *q.stride(), *block_table.stride(), *kv_cache.stride(),
            **common, num_warps=num_warps or 4, num_stages=num_stages or 2,
        )
    chunk = merge_chunk(splits, dim)
    launch(_merge_kernel)[(rows, heads)](
        part_out, part_lse, out, *out.stride(),
        NUM_HEADS=heads, D=dim, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), CHUNK=chunk,
        num_warps=merge_warps(chunk), **pdl,
    )
    return out
