"""The decode launcher's choices, from shapes alone so that a CUDA graph captured at one shape replays at it:
which kernel, its tile, register cap, split count, and query rows a program, and the merge's chunk.

Kept apart from the kernels (:mod:`~tqkv_compile.lowerings.decode_stream`,
:mod:`~tqkv_compile.lowerings.decode_bytes`, :mod:`~tqkv_compile.lowerings.gluon_decode`,
:mod:`~tqkv_compile.lowerings.general_decode`; this module imports none of them): each rule here is fitted to
measurements, named in its docstring (``bench/results/*launch-sweep*.json``, docs/performance-history.md), and
``bench/launch_sweep.py`` times the alternatives on a GPU. The kernels take whatever they are given
(``decode_attention``'s keywords override every choice).
"""

from __future__ import annotations

import torch
import triton

from tqkv_compile import env
from tqkv_compile.codec import Preset


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The device's SM count (cached); 4 for the CPU (the interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def programs_per_sm(maxnreg: int, num_warps: int) -> int:
    """Programs an SM holds at once under a register cap (64K registers an SM, allocated per warp in 256s; at
    most 64 warps and 32 programs an SM; shared memory is not the limit of the stream kernel: 22 KB a program)."""
    per_warp = triton.cdiv(maxnreg * 32, 256) * 256
    return max(1, min(65536 // (per_warp * num_warps), 64 // num_warps, 32))


def num_splits(rows: int, kv_heads: int, max_len: int, device: torch.device, block_n: int,
               programs_per_sm: int | None = None, most_splits: int = 128) -> int:
    """Splits per (row, kv head), from shapes only, so a CUDA graph captured at one shape replays at it.

    With ``programs_per_sm`` (how many of the kernel's programs an SM holds at once: the stream kernel's
    register cap fixes it) the split count minimises a wave model of the launch: time ~ waves x (tiles per
    program + 2), waves = ceil(programs / resident slots); it fits a split sweep on the H200
    (docs/performance-history.md). Never more splits than fill the GPU ~4 times, nor 128 (at 64, k8v4 at
    batch 1 with 128-position tiles ran 52 splits of 5 tiles where 65-66 splits hold 4).
    Among counts the model rates equal, the largest: the model counts the table's width, and a server's table
    (its max_model_len) is often far wider than its sequences, whose tiles the larger count spreads thinner
    (a 131072-position table: 64 and 66 splits rate equal; a 32800-position sequence then takes 5 tiles a
    program at 64, 4 at 66). The cost: at exactly 32768 positions (256 tiles, 4 a program either way) 66
    splits are slower than 64 (two empty programs a kv head, a second merge chunk). ``most_splits``: the stream
    kernel takes 256 (one sequence on one or two kv heads: 1 x 131072 at 8 / 1 heads 42.0 -> 32.7 us, at 14 / 2
    heads of 64 37.9 -> 30.6; H100, bench/results/h100-launch-sweep-packed.json), the fragment kernel 128 (no gain
    past it there: 29.4 / 29.6 us).
    Without ``programs_per_sm`` (the word and byte kernels, the interpreter): ~4 programs an SM, each split
    >= 4 tiles, at most 64."""
    pairs = max(rows * kv_heads, 1)
    wanted = triton.cdiv(4 * sm_count(device), pairs)  # ~4 programs an SM
    if programs_per_sm is None:
        return int(max(1, min(wanted, max_len // (4 * block_n), 64)))
    slots = programs_per_sm * sm_count(device)
    tiles = max(1, triton.cdiv(max_len, block_n))
    # never above that count: max_len is the block table's width (an engine's max_model_len), often far above
    # the batch's real lengths, and the count must not grow with it
    most = min(tiles, wanted, most_splits)

    def cost(splits: int) -> int:
        return triton.cdiv(pairs * splits, slots) * (triton.cdiv(tiles, splits) + 2)

    return min(range(1, most + 1), key=lambda s: (cost(s), -s))


LENGTH_AWARE_ENV = "TQKV_LENGTH_AWARE"
LENGTH_AWARE_AUTO = False  # (until timed on a GPU with the plan first in each program)


def length_aware(num_seqs: int, rows_per_program: int) -> bool:
    """Whether the stream and fragment kernels cut each row by the batch's lengths (:func:`row_splits`, in a grid
    :func:`split_grid` widens) where the caller names nothing. The rule: batches of several sequences served one
    row a program; not one sequence (nothing to even out; the plan's reads cost 0.5-1 us there, H100) nor packed
    rows (572 -> 1014 us at 28 / 4 heads, 32 x 16384 with 4 rows a sequence, before their register caps). From
    shapes (graph-stable). ``TQKV_LENGTH_AWARE``: ``auto`` (the default: the rule where ``LENGTH_AWARE_AUTO`` is
    on, else never), ``rule`` (the rule), ``1`` (always), ``0`` (never). Measurements:
    docs/performance-history.md."""
    chosen = env.get(LENGTH_AWARE_ENV, "auto")
    if chosen not in ("auto", "rule", "0", "1"):
        raise ValueError(f"{LENGTH_AWARE_ENV}={chosen!r}: expected auto, rule, 0 or 1")
    if chosen in ("0", "1"):
        return chosen == "1"
    return (chosen == "rule" or LENGTH_AWARE_AUTO) and length_aware_rule(num_seqs, rows_per_program)


def length_aware_rule(num_seqs: int, rows_per_program: int) -> bool:
    """:func:`length_aware`'s rule by itself (no setting read): several sequences, one row a program."""
    return num_seqs >= 2 and rows_per_program == 1


RAGGED_SPLITS = 8


def split_grid(splits: int, num_seqs: int, max_len: int, block_n: int, most_splits: int) -> int:
    """The grid's splits a (row block, kv head) where the kernel cuts each row by its length (length-aware
    splits, :func:`row_splits`): ``splits`` (:func:`num_splits`, the count for a batch as long as the table), and
    at least RAGGED_SPLITS where a batch has several sequences, so that its long sequences can take more splits
    than a batch of their length would (a ragged batch: its short sequences take fewer, and programs past a
    row's count exit at once). Capped by the table's tiles and ``most_splits``. From shapes only (graph-stable).
    Grids of 8 against the counts of :func:`num_splits` at 64 sequences of 1k..64k (28 / 4 heads): 415 us at 8
    splits, 545.8 at the 3 the table's width gave (H100, bench/results/h100-launch-sweep.json)."""
    if num_seqs < 2:
        return splits
    return max(splits, min(RAGGED_SPLITS, most_splits, triton.cdiv(max_len, block_n)))


def row_splits(lengths: list[int], rows: list[int], row_block_len: int, kv_heads: int, slots: int, wanted: int,
               block_n: int, grid_splits: int, rows_per_program: int = 1) -> int:
    """The split count the kernels give a row block of context ``row_block_len`` (length-aware splits), as
    ``device_helpers.row_splits`` computes it in each program from the batch's ``lengths`` and ``rows``
    (query rows a sequence): the batch's mean tiles a row block, the count :func:`num_splits`'s wave model rates
    best for a uniform batch of that mean (``slots`` resident programs, ``wanted`` the ~4-an-SM cap, counts up to
    ``grid_splits``), scaled by this block's tiles / the mean, rounded, in [1, min(grid_splits, its tiles)].

    Why: the split count from shapes alone must assume every row is as long as the block table (an engine's
    max_model_len), and cuts every row into the same number of splits: a ragged batch's longest rows then take
    the longest programs, which the rest of the GPU waits for; rows far shorter than the table get too few
    programs. Taken from the lengths in the kernel (as FA3's scheduler does from seqused_k in a prepare kernel),
    a uniform batch gets :func:`num_splits`'s count for its real length, and in a ragged one each program gets
    about the mean's share of positions. Still graph-stable: the grid (``grid_splits``, :func:`split_grid`)
    comes from shapes; only which of its programs have positions depends on the lengths."""
    ceil = triton.cdiv
    blocks = sum(ceil(r, rows_per_program) for r in rows)
    total = sum(ceil(r, rows_per_program) * ceil(n, block_n) for r, n in zip(rows, lengths))
    blocks = max(blocks, 1)
    mean = max(ceil(total, blocks), 1)
    pairs = blocks * kv_heads
    most = max(min(mean, ceil(wanted, pairs), grid_splits), 1)
    at_mean = min(range(1, most + 1), key=lambda c: (ceil(pairs * c, slots) * (ceil(mean, c) + 2), -c))
    tiles = ceil(row_block_len, block_n)
    return max(min((2 * at_mean * tiles + mean) // (2 * mean), grid_splits, tiles), 1)


def plan_capacity(device: torch.device, programs_per_sm: int | None) -> tuple[int, int]:
    """(resident programs, the ~4-an-SM cap) the length-aware split rule weighs waves with: the
    :func:`num_splits` model's ``slots`` and ``wanted`` numerators."""
    return (programs_per_sm or 4) * sm_count(device), 4 * sm_count(device)


def packed_rows(rows: int, num_seqs: int, group: int) -> int:
    """Query rows of a sequence one stream-kernel program serves from one read of its keys and values
    (speculative verification, short chunks): the batch's rows a sequence (rows // sequences, from shapes: graph-
    stable), at most 32 columns (rows x query-head group: the dots' N side). Only where the rows are a multiple of
    the sequences (every sequence the same rows: speculative verification, or one sequence's chunk): in a batch
    mixing a chunk with one-row decodes, rows // sequences would pack each decode into mostly empty columns. 1
    where sequences have one row each, and at groups of 8 and more, where the fragment kernel's one row a program
    stayed faster. Measured on an H100
    at 32 x 16384 with 4 rows a sequence (bench/results/h100-launch-sweep-packed.json, 4bit_nc): 32 / 8 heads
    1153 us (fragments) -> 816 (4 rows packed); 28 / 4 heads 596 -> 571 (4 rows; 2 rows: 788); 8 / 1 heads
    163 (fragments) against 186-230 packed."""
    if num_seqs < 1 or rows % num_seqs:
        return 1
    per_seq = rows // num_seqs
    return max(1, min(per_seq, 32 // group)) if per_seq >= 2 and group < 8 else 1


def fragments_preferred(preset: Preset, rows: int, max_len: int) -> bool:
    """Where the fragment kernel is the faster one, from the shapes alone (graph-stable): batches above 1 or
    tables of 16384 positions and more (fp8 keys: batches of 16 and more, or the long tables). Measured, it won
    for every preset at 64 x 32768, 1 x 32768 and 64 x 4096 and lost at 1 x 4096: a small grid, where the heavier
    prologue and epilogue of few tiles a program weigh (for fp8 keys the stream kernel also prepares the query
    itself: one launch fewer), so the stream kernel serves those. 3-bit fields need STAGE 1 / 2
    (``gluon_decode.supports``; at STAGE 0 the launcher keeps the stream kernel for them). The measurements behind the
    rule: docs/performance-history.md."""
    if preset.key_fp8:
        return rows >= 16 or max_len >= 16384
    return rows > 1 or max_len >= 16384


def stream_block_n(preset: Preset, kernel: str, rows: int, kv_heads: int, max_len: int,
                   device: torch.device) -> int:
    """Positions a tile for the stream and byte kernels: 16 interpreted, 32 for the byte kernel, 64 for the stream
    kernel (the H200 sweeps' best, docs/lab-notes/h200-kernels-notes.md), 128 for fp8 keys where their programs
    still fill the GPU twice (faster from 64 x 4096 up, slower at 1 x 4096, where 64 stays; max_len is the
    table's width, so this is graph-stable)."""
    if device.type == "cpu":
        return 16
    if kernel == "bytes":
        return 32
    programs = rows * kv_heads * min(64, max_len // 512)
    return 128 if preset.key_fp8 and programs >= 2 * sm_count(device) else 64


def stream_maxnreg(dim: int, columns: int = 1) -> int:
    """The stream kernel's register cap for ``columns`` query vectors a program (rows packed x query-head group).
    One row a program (up to 8 columns): 128 up to head 128 (4 programs an SM without spills; faster than 168),
    168 at head 256, where 128 spills ~0.5 KB a thread (sm_90a compile; not timed). Rows packed into more columns
    at head 128: 168 up to 16 columns, 192 above; under 128 they spilled 432 / 520 bytes a thread, and in one
    H100 start (bench/results/h100-launch-sweep-rows.json, 32 x 16384, 4 rows a sequence) the caps took 32 / 8
    heads (16 columns) 823 -> 586 us for 4bit_nc and 1325 -> 517 for k8v4, 28 / 4 heads (28 columns) 573 -> 428
    and 1079 -> 369 (192; 168 gave 408 and 501). Head 64 keeps 128 (its packed rows were not timed with caps).
    Without a hand prefetch (the default: the registers it holds cost more than it hides). The measurements:
    docs/performance-history.md."""
    if dim > 128:
        return 168
    if dim < 128 or columns <= 8:
        return 128
    return 168 if columns <= 16 else 192


def query_in_stream_kernel(preset: Preset, dtype: torch.dtype, interpret: bool) -> bool:
    """Whether the stream kernel prepares the query itself by default (else a ``prepare_query`` launch).
    fp8 keys: the query is only scaled, in the kernel (a launch saved). 4-bit keys: the in-kernel rotation's
    prologue (a [16, D] x [D, D] dot, 32 KB of signs) cost what the launch saved, so prepare_query rotates
    (docs/performance-history.md). fp32 queries on the
    GPU keep prepare_query's fp32 path either way."""
    return preset.key_fp8 and (interpret or dtype in (torch.float16, torch.bfloat16))


def merge_chunk(splits: int, dim: int) -> int:
    """The merge kernel's chunk of splits: their power of two, in one pass up to 128 splits at head sizes up to
    128 (one pass was faster than chunks of 64), chunks of 64 above (a [128, 256] fp32 tile would be 128
    registers a thread at 8 warps; not measured)."""
    return min(triton.next_power_of_2(splits), 128 if dim <= 128 else 64)


def merge_warps(chunk: int) -> int:
    """The merge kernel's warps: 4 up to a [64, D] chunk, 8 for a [128, D] one (the same registers a thread)."""
    return 4 if chunk <= 64 else 8
