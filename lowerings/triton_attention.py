"""Triton decode attention straight from the packed TurboQuant cache: split-KV, then a log-sum-exp merge.
:func:`decode_attention` picks a kernel and its launch settings, fills the partials with it and merges them.

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

Each program writes its partial output (normalised) and its base-2 log-sum-exp; the merge kernel
(:mod:`decode_merge`) combines the splits. A row's sequence and causal length come from ``query_start_loc``
inside the kernel (the one-token-per-sequence case is recognised in two loads; other rows binary-search), so any
mix of decode and multi-token rows is served: each row attends to positions ``0 .. seq_len - n_new + j``.

Three kernels share that contract, each in its own module with its launch: the stream kernel
(:mod:`decode_stream`: fields read as 16- or 32-bit words, vLLM's four layouts, the one every engine cache
takes), the byte kernel (:mod:`decode_bytes`: byte loads, any view, the fallback) and :mod:`gluon_decode`'s
fragment kernel (4-bit or fp8 keys with 4-bit values, Gluon: each thread loads its own mma fragments' codes),
which takes the stream kernel's place on CUDA where it is the faster one; :func:`default_kernel` picks between
the first two. Several query rows of a sequence (speculative verification) share one stream-kernel program
and one read of the cache (``ROWS``). Their device functions are :mod:`device_helpers`'. The launch choices
(kernel, tile, splits, rows a program) are :mod:`~tqkv_compile.lowerings.launch_choices`'s; how they were
measured: docs/performance-history.md.
"""

from __future__ import annotations

import math

import torch
import triton

from tqkv_compile.codec import Preset
from tqkv_compile.lowerings import decode_bytes, decode_stream, dependent_launch, gluon_decode
from tqkv_compile.lowerings.cache_tables import require_vllm_layout
from tqkv_compile.lowerings.decode_merge import merge
from tqkv_compile.lowerings.decode_stream import stream_words
from tqkv_compile.lowerings.device_helpers import LOG2E
from tqkv_compile.lowerings.launch_choices import length_aware as choose_length_aware
from tqkv_compile.lowerings.launch_choices import (num_splits, packed_rows, plan_capacity, programs_per_sm,
                                                   split_grid, stream_block_n, stream_maxnreg)
from tqkv_compile.lowerings.triton_query import prepare_query


def default_kernel(preset: Preset, kv_cache: torch.Tensor, device: torch.device) -> str:
    """The stream kernel wherever it can read the cache (vLLM's four presets from a byte-contiguous view with
    2-byte-aligned fields and strides: every cache vLLM allocates), else the byte kernel (any view)."""
    return "stream" if stream_words(preset, kv_cache, asm=device.type == "cuda") is not None else "bytes"


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
                     rows_per_program: int | None = None, length_aware: bool | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> out [T, Hq, D] (query dtype); see the module docstring and ops.attention.
    ``kernel``: "stream" or "bytes" (default: :func:`default_kernel`); the other keywords are tuning
    knobs (the measured best by default). ``lut``: the stream kernel's key lookup table (default:
    :func:`~tqkv_compile.lowerings.cache_tables.key_lut`, built once per preset and device). ``index32``: the
    stream kernel's int32 indexing (default: wherever the cache view spans fewer than 2^31 half-words; False
    forces int64). ``signs``: the stream kernel's rotation as +-1 (default: :func:`decode_stream.rotation_signs`);
    ``query_in_kernel``: the stream kernel rotates and scales the query itself (default: for fp8 keys, whose
    query is only scaled, with fp16 / bf16 queries and interpreted; False: a :func:`prepare_query` launch first).
    ``launch``: wraps each kernel before its launch (``torch.library.wrap_triton`` when traced for Inductor, see
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
    ``splits``, the grid's, :func:`launch_choices.split_grid`'s where ``splits`` is not given); False: every
    row into ``splits``; None (the default): :func:`launch_choices.length_aware` decides."""
    require_vllm_layout(preset)
    traced = launch is not None
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
        if kernel == "stream" and packed == 1 and not traced and \
                gluon_decode.wanted(preset, kv_cache, group, rows, max_len, query.device):
            kernel = "fragments"  # where it is faster (not traced by Inductor: launched here)
    elif kernel == "fragments":
        if (why := gluon_decode.supports(preset, kv_cache, group, query.device, stage)) is not None:
            raise ValueError(f"kernel='fragments': {why}")
        if traced:
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
        maxnreg = maxnreg or stream_maxnreg(dim, packed * group)
    occupancy = programs_per_sm(maxnreg, num_warps or 4) if kernel != "bytes" and maxnreg else None
    if length_aware is None:
        length_aware = choose_length_aware(num_seqs, packed)
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
    search_steps = max(1, math.ceil(math.log2(num_seqs + 1)))  # bisection steps over query_start_loc
    if kernel == "stream":
        decode_stream.fill_partials(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, rotation,
                                    centroids, part_out, part_lse, block_n=block_n, search_steps=search_steps,
                                    plan=(plan_slots, plan_wanted), rows_per_program=packed,
                                    length_aware=length_aware, num_warps=num_warps, num_stages=num_stages,
                                    prefetch=prefetch, asm=asm, maxnreg=maxnreg, lut=lut, index32=index32,
                                    signs=signs, query_in_kernel=query_in_kernel, launch=launch)
    elif kernel == "fragments":
        q = prepare_query(query, None if preset.key_fp8 else rotation, scale * LOG2E)
        gluon_decode.launch(q, kv_cache, block_table, seq_lens, query_start_loc, part_out, part_lse, preset, group,
                            splits, search_steps, prefetch, stage, maxnreg, key_table,
                            (plan_slots, plan_wanted) if length_aware else None)
    else:
        decode_bytes.fill_partials(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, rotation,
                                   centroids, part_out, part_lse, block_n=block_n, search_steps=search_steps,
                                   num_warps=num_warps, num_stages=num_stages, launch=launch)
    return merge(part_out, part_lse, out, launch=launch, pdl=dependent_launch.options(query.device, traced=traced))
