"""The Triton device functions the kernels are built from, shared by the kernel files.

- Byte loads and code lookups: a tile's fields read byte by byte from any cache view, Lloyd-Max codes turned
  into centroids by a select tree, a query group's scores against a tile of keys (the byte kernel in
  :mod:`~tqkv_compile.lowerings.decode_bytes`; :mod:`~tqkv_compile.lowerings.triton_kv_dot`,
  :mod:`~tqkv_compile.lowerings.triton_dequant` and the general kernels (``general_*.py``) read with some of
  them).
- A program's share of the work: its query row (or rows) and their causal context, the split of that context it
  serves, each tile's slot offsets, and the online softmax step over a tile (every split-KV kernel: the byte and
  stream kernels, :mod:`~tqkv_compile.lowerings.general_decode`'s); kv_dot's position tile and its logits' store
  (:mod:`~tqkv_compile.lowerings.triton_kv_dot`, :mod:`~tqkv_compile.lowerings.general_kv_dot`).
- A write's rows and byte stores: a program's (token, kv head) rows and their slots (the write kernels, and the
  dequant kernels that read slots the same way), fp16 fields stored as two bytes, codes packed little-endian,
  fp8 e4m3 bits in integer arithmetic (:mod:`~tqkv_compile.lowerings.triton_kv_write`,
  :mod:`~tqkv_compile.lowerings.general_kv_write`).
- Word loads, unpacking and lookups: fields read as 16- or 32-bit words and unpacked in registers, Lloyd-Max
  codes looked up by byte permutes in inline PTX (GPU only; tests/test_asm_emulation.py runs that PTX
  instruction by instruction), uniform codes turned into exact fp16 subnormals (the stream kernel in
  :mod:`~tqkv_compile.lowerings.decode_stream`).

Shapes: a tile is ``BLOCK_N`` cache positions, ``base`` [BLOCK_N] their slots' offsets (bytes for the byte
loads, 2-byte units for the word loads) and ``valid`` [BLOCK_N] which of them lie inside the context; a query
group is ``BLOCK_H`` columns (a kv head's query heads, padded). Codes are int32; ``DTYPE`` is the dots' operand
dtype (fp16 on the GPU, fp32 interpreted: :func:`operand`). The fragment kernel
(:mod:`~tqkv_compile.lowerings.gluon_decode`) is written in Gluon and has its own versions of these.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The query's scale factor that makes the kernels' base-2 softmax (:func:`softmax_step`: exp2) the softmax:
# the launchers scale the query by ``scale * LOG2E``.
LOG2E = 1.4426950408889634


# -- byte loads and code lookups --------------------------------------------------------------------------


@triton.jit
def select8(code, c0, c1, c2, c3, c4, c5, c6, c7):
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
def centroids(code, cent_ptr, BITS: tl.constexpr):
    """int32 codes -> fp32 Lloyd-Max centroids: the table held in registers (scalars) and selected (a gather
    from the cached table was slower)."""
    values = select8(code, tl.load(cent_ptr + 0), tl.load(cent_ptr + 1), tl.load(cent_ptr + 2),
                     tl.load(cent_ptr + 3), tl.load(cent_ptr + 4), tl.load(cent_ptr + 5), tl.load(cent_ptr + 6),
                     tl.load(cent_ptr + 7))
    if BITS == 4:
        upper = select8(code, tl.load(cent_ptr + 8), tl.load(cent_ptr + 9), tl.load(cent_ptr + 10),
                        tl.load(cent_ptr + 11), tl.load(cent_ptr + 12), tl.load(cent_ptr + 13),
                        tl.load(cent_ptr + 14), tl.load(cent_ptr + 15))
        values = tl.where((code & 8) != 0, upper, values)
    return values


@triton.jit
def load_nibbles(cache_ptr, base, valid, s_byte, D: tl.constexpr):
    """4-bit codes of BLOCK_N slots at byte offsets base -> (even, odd) int32 [BLOCK_N, D/2]: coordinates
    2i and 2i+1, the low and high nibble of byte i. Each byte is loaded once; no interleave."""
    i = tl.arange(0, D // 2)
    packed = tl.load(cache_ptr + base[:, None] + i[None, :] * s_byte, mask=valid[:, None], other=0).to(tl.int32)
    return packed & 15, packed >> 4


@triton.jit
def order3(D: tl.constexpr):
    """The column order of 3-bit code tiles: column c holds coordinate 8 * (c % (D/8)) + c // (D/8), so
    that each eighth of the columns reads one bit offset (a plane) of the 3-byte groups."""
    c = tl.arange(0, D)
    return 8 * (c % (D // 8)) + c // (D // 8)


@triton.jit
def load_codes3(cache_ptr, base, valid, s_byte, D: tl.constexpr):
    """3-bit codes of BLOCK_N slots -> int32 [BLOCK_N, D] in :func:`order3` column order, each read through
    a 16-bit window (the second byte only where a code straddles two bytes)."""
    bit = 3 * order3(D)
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
def codes_f16(codes):
    """int32 codes in [0, 1024) -> fp16 code * 2^-24, exactly (the code's bits read as an fp16 subnormal);
    callers multiply by 2^24 after the dot."""
    return codes.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def operand(x, DTYPE: tl.constexpr, OPERAND: tl.constexpr = tl.float16):
    """A dot operand as the GPU's dot takes it: rounded to OPERAND (the attention kernels' fp16; kv_dot's fp32),
    then in DTYPE (fp32 when interpreted: the interpreter's fp16 dots are wrong, so it upcasts, but only after
    the GPU's rounding, so that interpreted tests see the GPU's numerics; on the GPU this is no instruction)."""
    return x.to(OPERAND).to(DTYPE)


@triton.jit
def load_fp16(cache_ptr, addr, valid):
    """Little-endian fp16 at byte offsets addr [BLOCK_N] -> fp32."""
    lo = tl.load(cache_ptr + addr, mask=valid, other=0).to(tl.int32)
    hi = tl.load(cache_ptr + addr + 1, mask=valid, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_query(q_ptr, row, q_heads, head_ok, s_qt, s_qh, s_qd,
               D: tl.constexpr, KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, DTYPE: tl.constexpr,
               OPERAND: tl.constexpr):
    """The query group [BLOCK_H, ...] in the column order the key tiles use: (q, q) for fp8 keys (natural
    order; the second is unused), (even, odd) coordinates for 4-bit keys, (:func:`order3`, unused) for 3-bit."""
    rows = q_ptr + row * s_qt + q_heads[:, None] * s_qh
    if KEY_FP8:
        first = tl.load(rows + tl.arange(0, D)[None, :] * s_qd, mask=head_ok[:, None], other=0.0)
        second = first
    elif KEY_BITS == 4:
        i = tl.arange(0, D // 2)
        first = tl.load(rows + (2 * i)[None, :] * s_qd, mask=head_ok[:, None], other=0.0)
        second = tl.load(rows + (2 * i + 1)[None, :] * s_qd, mask=head_ok[:, None], other=0.0)
    else:
        first = tl.load(rows + order3(D)[None, :] * s_qd, mask=head_ok[:, None], other=0.0)
        second = first
    return operand(first, DTYPE, OPERAND), operand(second, DTYPE, OPERAND)


@triton.jit
def key_scores(q_a, q_b, cache_ptr, cent_ptr, base, valid, s_byte,
               D: tl.constexpr, KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr,
               NORM_CORRECTION: tl.constexpr, DTYPE: tl.constexpr,
               PRECISION: tl.constexpr, OPERAND: tl.constexpr):
    """Scores [BLOCK_H, BLOCK_N] = <q, k> of the query group (from :func:`load_query`) against BLOCK_N keys
    read straight from their slots; the query is already rotated (Lloyd-Max keys) and scaled. Operands are
    rounded to OPERAND (see :func:`operand`), the dots run in DTYPE at PRECISION."""
    if KEY_FP8:
        raw = tl.load(cache_ptr + base[:, None] + tl.arange(0, D)[None, :] * s_byte, mask=valid[:, None], other=0)
        keys = raw.to(tl.float8e4nv, bitcast=True).to(DTYPE)
        scores = tl.dot(q_a, tl.trans(keys), input_precision=PRECISION)
    else:
        if KEY_BITS == 4:
            even, odd = load_nibbles(cache_ptr, base, valid, s_byte, D)
            c_even = centroids(even, cent_ptr, 4)
            c_odd = centroids(odd, cent_ptr, 4)
            scores = tl.dot(q_a, tl.trans(operand(c_even, DTYPE, OPERAND)), input_precision=PRECISION)
            scores = tl.dot(q_b, tl.trans(operand(c_odd, DTYPE, OPERAND)), scores, input_precision=PRECISION)
            if NORM_CORRECTION:
                sumsq = tl.sum(c_even * c_even, axis=1) + tl.sum(c_odd * c_odd, axis=1)
        else:
            cent = centroids(load_codes3(cache_ptr, base, valid, s_byte, D), cent_ptr, 3)
            scores = tl.dot(q_a, tl.trans(operand(cent, DTYPE, OPERAND)), input_precision=PRECISION)
            if NORM_CORRECTION:
                sumsq = tl.sum(cent * cent, axis=1)
        factor = load_fp16(cache_ptr, base + KEY_CODE_BYTES * s_byte, valid)
        if NORM_CORRECTION:
            factor = factor / tl.sqrt(sumsq + 1e-16)
        scores = scores * factor[None, :]
    return scores


# -- a program's rows, split and tiles; the softmax step --------------------------------------------------


@triton.jit
def row_context(row, qsl_ptr, seq_lens_ptr, num_seqs, SEARCH_STEPS: tl.constexpr):
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
def split_plan(qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted, BLOCK_N: tl.constexpr,
               NUM_SPLITS: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr = 128):
    """The batch-wide half of the length-aware split rule (:func:`~tqkv_compile.lowerings.launch_choices.row_splits`
    is the whole rule on the host, with the why): (the count the wave model rates best for a batch of the mean,
    the batch's mean tiles a row block), int32 scalars. The sequences' lengths clamped to ``max_len``,
    ceil(rows / ROWS) row blocks a sequence, read CHUNK sequences at a time; ``launch_choices.num_splits``'s model:
    ``plan_slots`` programs resident, ``plan_wanted`` the ~4-an-SM cap, candidates up to NUM_SPLITS. Every program
    computes the same plan, first thing: it reads nothing of the program's own row, so its loads are in flight
    with the row's (:func:`split_span`)."""
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
    return at_mean, mean


@triton.jit
def split_share(tiles, at_mean, mean, NUM_SPLITS: tl.constexpr):
    """The row half of the length-aware split rule: a row block of ``tiles`` tiles gets the plan's count
    (:func:`split_plan`) scaled by tiles / mean, rounded, in [1, min(NUM_SPLITS, tiles)]. int32 scalar."""
    count = (2 * at_mean * tiles + mean) // (2 * mean)
    return tl.maximum(tl.minimum(tl.minimum(count, NUM_SPLITS), tiles), 1)


@triton.jit
def row_splits(tiles, qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted, BLOCK_N: tl.constexpr,
               NUM_SPLITS: tl.constexpr, ROWS: tl.constexpr):
    """Splits for a row block whose context is ``tiles`` tiles, from the batch's real lengths: :func:`split_plan`
    then :func:`split_share` (the kernels call the two apart)."""
    at_mean, mean = split_plan(qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted, BLOCK_N,
                               NUM_SPLITS, ROWS)
    return split_share(tiles, at_mean, mean, NUM_SPLITS)


@triton.jit
def split_count(length, at_mean, mean, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                LENGTH_AWARE: tl.constexpr):
    """The split count a row block of context ``length`` is cut into: NUM_SPLITS, or with LENGTH_AWARE its
    :func:`split_share` of the batch's plan (``at_mean``, ``mean``: :func:`split_plan`'s; unused otherwise)."""
    count = length * 0 + NUM_SPLITS
    if LENGTH_AWARE:
        count = split_share((length + BLOCK_N - 1) // BLOCK_N, at_mean, mean, NUM_SPLITS)
    return count


@triton.jit
def split_span(row, kv_head, split, qsl_ptr, seq_lens_ptr, num_seqs, max_len, GROUP: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
               at_mean=0, mean=1, LENGTH_AWARE: tl.constexpr = False):
    """One split program's work: (seq, begin, end, q_heads [BLOCK_H], part [BLOCK_H], head_ok [BLOCK_H]) —
    its sequence, the positions [begin, end) of its split (whole tiles), its query heads and their rows in
    the partial outputs. Callers store -inf partials and return when begin >= end. The context is clamped to
    ``max_len`` (the block table's width in positions): a sequence length the host did not check (CUDA-graph
    replay, TQKV_CHECK_VALUES=0) cannot make the tile loop run past the table, or for ever. A row's context is
    cut into NUM_SPLITS splits, or with LENGTH_AWARE into :func:`split_count`'s share of the batch's plan
    (``at_mean``, ``mean``: :func:`split_plan`'s; the grid's NUM_SPLITS the most)."""
    seq, length = row_context(row, qsl_ptr, seq_lens_ptr, num_seqs, SEARCH_STEPS)
    length = tl.minimum(length, max_len)
    count = split_count(length, at_mean, mean, BLOCK_N, NUM_SPLITS, LENGTH_AWARE)
    per_split = tl.cdiv(tl.cdiv(length, count), BLOCK_N) * BLOCK_N
    begin = split * per_split
    end = tl.minimum(begin + per_split, length)
    h = tl.arange(0, BLOCK_H)
    q_heads = kv_head * GROUP + h
    part = (row * (GROUP * tl.num_programs(1)) + q_heads) * NUM_SPLITS + split
    return seq, begin, end, q_heads, part, h < GROUP


@triton.jit
def rows_span(block, kv_head, split, qsl_ptr, seq_lens_ptr, num_seqs, max_len, s_qt, s_qh, GROUP: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
              SEARCH_STEPS: tl.constexpr, ROWS: tl.constexpr, at_mean=0, mean=1,
              LENGTH_AWARE: tl.constexpr = False):
    """:func:`split_span` for a program that serves ROWS consecutive query rows of one sequence at once (their
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
    count = split_count(longest, at_mean, mean, BLOCK_N, NUM_SPLITS, LENGTH_AWARE)
    per_split = tl.cdiv(tl.cdiv(longest, count), BLOCK_N) * BLOCK_N
    begin = split * per_split
    end = tl.minimum(begin + per_split, longest)
    part = (row * (GROUP * tl.num_programs(1)) + q_heads) * NUM_SPLITS + split
    return seq, begin, end, row * s_qt + q_heads * s_qh, part, head_ok, limit


@triton.jit
def tile_base(bt_row, s_bm, start, end, n, kv_head, s_blk, s_pos, s_head, BLOCK_SIZE: tl.constexpr,
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
def softmax_step(scores, m_i, l_i, AXIS: tl.constexpr = 1, EMPTY: tl.constexpr = False):
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


# -- kv_dot's position tiles (triton_kv_dot's and general_kv_dot's kernels) -------------------------------


@triton.jit
def logit_tile(block_table_ptr, seq_lens_ptr, s_bt, s_bm, s_blk, s_pos, s_head, GROUP: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (sequence, kv head, position tile): (seq, q_heads, head_ok, pos, valid, slot byte
    offsets); positions at or past the sequence's length are not valid and their block ids are not read."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    pos = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.arange(0, BLOCK_H)
    valid = pos < tl.load(seq_lens_ptr + seq)
    block = tl.load(block_table_ptr + seq.to(tl.int64) * s_bt + (pos // BLOCK_SIZE) * s_bm, mask=valid, other=0)
    base = block.to(tl.int64) * s_blk + (pos % BLOCK_SIZE) * s_pos + kv_head * s_head
    return seq, kv_head * GROUP + h, h < GROUP, pos, valid, base


@triton.jit
def store_logits(out_ptr, logits, seq, q_heads, head_ok, pos, valid, width, s_ob, s_oh, s_on):
    """Store logits [BLOCK_H, BLOCK_N], -inf where the position is not valid."""
    logits = tl.where(valid[None, :], logits, float("-inf"))
    tl.store(out_ptr + seq * s_ob + q_heads[:, None] * s_oh + pos[None, :] * s_on, logits,
             mask=head_ok[:, None] & (pos < width)[None, :])


# -- a write's rows and its byte stores (the write kernels'; write_rows: the dequant kernels' too) --------


@triton.jit
def write_rows(slot_ptr, n_rows, num_kv_heads, s_blk, s_pos, s_head, BLOCK_SIZE: tl.constexpr,
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
def store_fp16(cache_ptr, byte_addr, x, keep):
    """Store fp32 x [BLOCK_M] as little-endian fp16 at byte_addr [BLOCK_M] (two byte stores)."""
    bits = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(cache_ptr + byte_addr, (bits & 0xFF).to(tl.uint8), mask=keep)
    tl.store(cache_ptr + byte_addr + 1, (bits >> 8).to(tl.uint8), mask=keep)


@triton.jit
def fp8e4m3_bits(x):
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
def store_packed(cache_ptr, byte_addr, s_byte, codes, keep,
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


# -- word loads, unpacking and lookups (the stream kernel's) ----------------------------------------------


@triton.jit
def centroids_sym16(code, cent_ptr, OUT: tl.constexpr):
    """4-bit codes -> fp32 centroids, using the table's sign symmetry c[15 - i] = -c[i]: an 8-way select on
    the folded index, then the sign."""
    upper = code >= 8
    folded = tl.where(upper, 15 - code, code)
    ty: tl.constexpr = OUT
    mag = select8(folded, operand(tl.load(cent_ptr + 0), ty), operand(tl.load(cent_ptr + 1), ty),
                  operand(tl.load(cent_ptr + 2), ty), operand(tl.load(cent_ptr + 3), ty),
                  operand(tl.load(cent_ptr + 4), ty), operand(tl.load(cent_ptr + 5), ty),
                  operand(tl.load(cent_ptr + 6), ty), operand(tl.load(cent_ptr + 7), ty))
    return tl.where(upper, -mag, mag)


@triton.jit
def load_field_h(eptr, base_h, offset: tl.constexpr, nbytes: tl.constexpr, WORD: tl.constexpr,
                 THIRDS: tl.constexpr = False):
    """The nbytes-byte field at byte offset ``offset`` of the slots at ``base_h`` (2-byte units) as WORD-byte
    little-endian words, int32 [N, nbytes / WORD] (zero-extended); unmasked. With THIRDS (3-bit codes, 2-byte
    words): int32 [N, nbytes / 6, 2], each group of 16 codes (three words w0, w1, w2) as (w0 | w1 << 16, w2),
    its three loads in one layout so that each thread holds a whole group (no exchange between lanes)."""
    if WORD == 2:
        word = base_h + offset // 2
    else:  # 4-byte words: base_h + offset / 2 is even (the host checked the alignment), >= 0
        word = ((base_h + offset // 2).to(tl.uint32 if base_h.dtype == tl.int32 else tl.uint64) // 2).to(base_h.dtype)
    # not masked: past the end a position's block id loads as 0 (tile_base), so its address is a slot of
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
def load_half_h(hptr, base_h, valid, offset: tl.constexpr):
    """The fp16 at byte offset ``offset`` of the slots at ``base_h`` (2-byte units) -> fp32 [N], 0 where not
    valid."""
    return tl.load(hptr + base_h + offset // 2, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def unpack(words, BITS: tl.constexpr, WORD: tl.constexpr):
    """int32 words [N, W] of BITS-bit fields -> int32 [N, W * 8 * WORD / BITS] in natural order (field k of
    word j is column j * per + k: little-endian fields are consecutive coordinates)."""
    PER: tl.constexpr = 8 * WORD // BITS
    k = tl.arange(0, PER)
    fields = (words[:, :, None] >> (k * BITS)[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(fields, (words.shape[0], words.shape[1] * PER))


@triton.jit
def pair_columns(low, high):
    """The asm converters' outputs (pack=2: [N, W, 2] each, low[n, j, :] = fp16 columns 4 j, 4 j + 1 and
    high[n, j, :] = columns 4 j + 2, 4 j + 3, as the pairs the asm built) -> fp16 [N, 4 W] in column order."""
    x = tl.permute(tl.join(low, high), (0, 1, 3, 2))  # [N, W, (low, high), pair]
    return tl.reshape(x, (low.shape[0], low.shape[1] * 4))


@triton.jit
def lut4_fp16(words, lut_ptr):
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
    return pair_columns(low, high)


@triton.jit
def codes4_fp16_odd16(words):
    """int32 [N, W] holding four 4-bit uniform codes each (low 16 bits, little-endian) -> fp16 [N, 4 W] in
    natural order: code * 2^-24 in even columns, 16 * code * 2^-24 in odd ones (fp16 subnormals, exact; see
    :func:`codes_f16`), by two byte permutes and two ands per four codes (PTX; GPU only). A code byte's two
    nibbles go to the two halves of an fp16 pair as they are, the high one 4 bits up: that is the factor 16,
    which the caller takes out of the odd columns once per program instead of shifting every code
    (:func:`odd16_codes` is the same without asm). Emulated bit-exactly in Python for all 2^16 words."""
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
    return pair_columns(low, high)


@triton.jit
def odd16_codes(codes, D: tl.constexpr):
    """int32 codes [N, D] in [0, 16) -> fp16 code * 2^-24 (even columns), 16 * code * 2^-24 (odd columns):
    what :func:`codes4_fp16_odd16` returns, without asm."""
    return codes_f16(codes << ((tl.arange(0, D) & 1) * 4)[None, :])


@triton.jit
def fp8x4_fp16(words):
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
    return pair_columns(low, high)


@triton.jit
def quads3(words):
    """:func:`load_field_h`'s THIRDS tile [N, G, 2] -> four int32 [N, G] whose low 12 bits hold codes 4 q ..
    4 q + 3 of each group of 16 (48 bits, little-endian: code k at bit 3 k); register-local."""
    lo, hi = tl.split(words)  # bits 0-31, bits 32-47
    return lo, lo >> 12, ((lo >> 24) & 0xFF) | (hi << 8), hi >> 4


@triton.jit
def join16(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """Sixteen [N, G] tensors -> [N, 16 G]: column 16 g + k holds the k-th tensor's column g (tl.join adds a
    last axis; the flattening takes the innermost join's axis as the most significant)."""
    even = tl.join(tl.join(tl.join(c0, c8), tl.join(c4, c12)), tl.join(tl.join(c2, c10), tl.join(c6, c14)))
    odd = tl.join(tl.join(tl.join(c1, c9), tl.join(c5, c13)), tl.join(tl.join(c3, c11), tl.join(c7, c15)))
    x = tl.join(even, odd)
    return tl.reshape(x, (c0.shape[0], c0.shape[1] * 16))


@triton.jit
def join_quads(y0, y1, y2, y3):
    """Four [N, 4 G] tensors (quad q of each group of 16 codes: column 4 g + k is code 4 q + k of group g)
    -> [N, 16 G] in natural order (column 16 g + 4 q + k)."""
    shape: tl.constexpr = (y0.shape[0], y0.shape[1] // 4, 4)
    x = tl.join(tl.join(tl.reshape(y0, shape), tl.reshape(y2, shape)),
                tl.join(tl.reshape(y1, shape), tl.reshape(y3, shape)))  # [N, G, 4 (k), 2 (i), 2 (j)]: quad 2 i + j
    return tl.reshape(tl.permute(x, (0, 1, 3, 4, 2)), (y0.shape[0], y0.shape[1] * 4))


@triton.jit
def codes3(x, k: tl.constexpr):
    return (x >> (3 * k)) & 7


@triton.jit
def centroids3x4(x, cent_ptr, DTYPE: tl.constexpr):
    """The four 3-bit codes in the low 12 bits of x -> their centroids in DTYPE, by a select tree (the
    interpreter's path of :func:`keys3`)."""
    return (operand(centroids(codes3(x, 0), cent_ptr, 3), DTYPE),
            operand(centroids(codes3(x, 1), cent_ptr, 3), DTYPE),
            operand(centroids(codes3(x, 2), cent_ptr, 3), DTYPE),
            operand(centroids(codes3(x, 3), cent_ptr, 3), DTYPE))


@triton.jit
def keys3(words, lut_ptr, cent_ptr, ASM: tl.constexpr, DTYPE: tl.constexpr):
    """3-bit Lloyd-Max key codes (a THIRDS tile) -> their centroids [N, D] in natural order, in DTYPE: by byte
    permutes on the GPU (:func:`lut3_fp16`), by a select tree otherwise."""
    x0, x1, x2, x3 = quads3(words)
    if ASM:
        cent = join_quads(pair_columns(*lut3_fp16(x0, lut_ptr)), pair_columns(*lut3_fp16(x1, lut_ptr)),
                          pair_columns(*lut3_fp16(x2, lut_ptr)), pair_columns(*lut3_fp16(x3, lut_ptr)))
    else:
        a0, a1, a2, a3 = centroids3x4(x0, cent_ptr, DTYPE)
        b0, b1, b2, b3 = centroids3x4(x1, cent_ptr, DTYPE)
        c0, c1, c2, c3 = centroids3x4(x2, cent_ptr, DTYPE)
        d0, d1, d2, d3 = centroids3x4(x3, cent_ptr, DTYPE)
        cent = join16(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3)
    return cent


@triton.jit
def codes3x4_f16(x):
    """The four 3-bit codes in the low 12 bits of x -> fp16 code * 2^-24 each (exact)."""
    return (codes_f16(codes3(x, 0)), codes_f16(codes3(x, 1)), codes_f16(codes3(x, 2)),
            codes_f16(codes3(x, 3)))


@triton.jit
def values3_f16(words):
    """3-bit uniform value codes (a THIRDS tile) -> fp16 code * 2^-24 [N, D] in natural order (exact)."""
    x0, x1, x2, x3 = quads3(words)
    a0, a1, a2, a3 = codes3x4_f16(x0)
    b0, b1, b2, b3 = codes3x4_f16(x1)
    c0, c1, c2, c3 = codes3x4_f16(x2)
    d0, d1, d2, d3 = codes3x4_f16(x3)
    return join16(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3)


@triton.jit
def lut3_fp16(words, lut_ptr):
    """int32 [N, G] whose low 12 bits hold four 3-bit codes -> their fp16 centroids as :func:`pair_columns`
    takes them (two [N, G, 2]: codes 0, 1 and codes 2, 3), each code looked up in an 8-entry fp16 table by
    byte permutes (PTX ``prmt``; GPU only): the codes spread into the nibbles of a selector (three shifts,
    three lop3), then prmt picks the low and the high bytes from the table's halves and two prmt pair them.
    The table: :func:`~tqkv_compile.lowerings.cache_tables.key_lut`'s words 0, 1 (low bytes of entries 0-3,
    4-7) and 4, 5 (high bytes)."""
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
