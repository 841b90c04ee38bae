"""The fragment kernel: decode attention for 4-bit Lloyd-Max or fp8 keys and 4-bit uniform values, in Gluon
(Triton's explicit-layout dialect) so that every thread loads exactly the codes of its own tensor-core fragments.

Why. The stream kernel (:mod:`decode_stream`) is issue-bound, not memory-bound: Triton lays its loaded words
out for coalescing, unpacks them there, and then moves the dequantized fp16 tiles into the mma operand layout
through shared memory (stores, barriers, ldmatrix) with register moves on both sides. Here the coordinate order
is ours to choose (the query is permuted the same way; the output is stored back in natural order), so it is
chosen such that the codes a thread needs for its mma.sync m16n8k16 fragments are whole 16-bit words of the
slot: a word's byte-permute lookup yields the fragment's fp16 pairs in place, and the conversion into the
operand layout is a no-op (``assert_trivial``). Statically it issues about half the stream kernel's
instructions a tile (``python bench/ptx_stats.py --kernel fragments``; figures in docs/performance-history.md).

The layouts, one program = one query row's group of <= 8 query heads over one split, 4 warps, 64 positions a
tile (warp w: positions 16 w .. 16 w + 15 for the keys), head size D = 128 or 256 (KT = D / 16 k-steps):

- keys: A operand [64 positions, D] of scores^T = K . q^T. Lane l (t = l % 4) holds rows l // 4 and l // 4 + 8
  of its warp and columns c = 16 kk + 8 r2 + 2 t + b. Column c is stored coordinate s = 4 KT t + 4 kk + 2 r2 + b:
  thread t's KT words of four codes (16-bit for 4-bit codes, 32-bit for fp8) of a row are contiguous, and word
  kk gives the pairs (r2 = 0, 1), by byte permutes from the table or by the hardware's fp8 conversion.
- values: A operand [D, 64 positions] of acc^T += V^T . P^T. Lane l of warp w holds dimensions
  rd = 64 rep + 16 w + 8 r1 + l // 4 and positions 16 kk + 8 r2 + 2 t + b; its codes of one position are
  J = D / 128 words (word J (8 w + l // 4) + j, nibble i: rep = 2 j + i // 2, r1 = i % 2), and one asm turns the
  words of positions 2 t and 2 t + 1 into the fragment's pairs (one dimension, two positions).
- the sums over positions (p, p * zero, p * scale) are kept per position and reduced once after the loop;
  only the running max crosses lanes and warps in a tile, and P crosses warps once (the value dot's B operand).
- the key table (8 words) is loaded from one of two copies picked by the lane's parity: ptxas cannot prove it
  uniform and keeps it in registers (otherwise it re-copied it from uniform registers before every use: 70 of
  558 SASS a tile).

Loops (constexprs): STAGE 1 / 2 load a position's words as a warp's run and move them into the layouts above
through shared memory (each thread loading its fragments' own words makes a warp's load instruction touch 8-11
cache lines), and read 3-bit fields too: a group's three words in one thread, repacked
into the 4-bit words' format (:func:`_spread3x8`) before the move, 3-bit keys looked up by :func:`_lut3_pairs`;
PREFETCH 1 / 2 load a tile ahead (2 the default: :func:`default_prefetch`).

Key lookup (4-bit keys): byte permutes from eight registers (:func:`_lut4_pairs`, 11 instructions a word of four
codes, a third of the loop's issue) with ``TQKV_FRAGMENT_KEY_TABLE=0``; by default (32; on Hopper)
from a table of the 256 fp16 pairs in shared memory (:func:`_table4_pairs`: 6 instructions a word, two of them
shared loads), kept past Triton's own shared memory with 32 copies side by side so that a warp's lanes hit
different banks (:func:`default_key_table`).

Defaults: STAGE 1 (2 for 3-bit fields: :func:`default_stage`); ``launch_choices.fragments_preferred`` says where the kernel wins, and
the launcher takes it there by default (``TQKV_FRAGMENT_KERNEL=0`` turns it off, ``=1`` takes it wherever it can
serve the call; or ``decode_attention(kernel="fragments")``). ``tqkv bench kernels --check`` is its correctness
test on a GPU (docs/kernels.md). Contract: :func:`_decode_stream_kernel`'s (partials and their base-2
log-sum-exp for the merge kernel), with the query from :func:`prepare_query`. How each default was chosen, with
its measurements: docs/performance-history.md.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Gluon is experimental (triton 3.5+); without it the kernel is simply unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # (bar.sync of the CTA: 3.6's name; gl.barrier in 3.9)
except ImportError:  # pragma: no cover - older triton
    gluon = None

from tqkv_compile.codec import Preset
from tqkv_compile.lowerings.cache_tables import halves_span
from tqkv_compile.lowerings.cache_tables import key_lut as stream_lut
from tqkv_compile.lowerings.launch_choices import fragments_preferred

BLOCK_N = 64
NUM_WARPS = 4
ENV = "TQKV_FRAGMENT_KERNEL"


def mode() -> str:
    """``TQKV_FRAGMENT_KERNEL``: ``auto`` (the default: ``launch_choices.fragments_preferred`` decides), ``1`` (wherever it can serve
    the call), ``0`` (never: the stream kernel)."""
    return _setting(ENV, "auto", ("auto", "0", "1"))


def _listed(choices: tuple, last: str = "or") -> str:
    """``(0, 1, 2)`` -> ``"0, 1 or 2"`` (the choices in messages)."""
    return f"{', '.join(map(str, choices[:-1]))} {last} {choices[-1]}"


def _setting(name: str, default: str, choices: tuple) -> str:
    """Environment variable ``name`` (``default`` when unset), refused unless one of ``choices`` (as text)."""
    choices = tuple(map(str, choices))
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected {_listed(choices)}")
    return value


def wanted(preset: Preset, kv_cache: torch.Tensor, group: int, rows: int, max_len: int,
           device: torch.device) -> bool:
    """Whether the launcher takes this kernel by itself for the call: ``TQKV_FRAGMENT_KERNEL`` (:func:`mode`:
    ``1`` wherever it can serve, ``auto`` where ``launch_choices.fragments_preferred``), and it can serve the
    call (:func:`supports`)."""
    chosen = mode()
    return (chosen == "1" or (chosen == "auto" and fragments_preferred(preset, rows, max_len))) and \
        supports(preset, kv_cache, group, device) is None


def enabled() -> bool:
    """Whether the launcher may pick this kernel by itself (``TQKV_FRAGMENT_KERNEL`` not ``0``)."""
    return mode() != "0"


PREFETCH_ENV = "TQKV_FRAGMENT_PREFETCH"
PREFETCHES = (0, 1, 2)  # loaded in the tile (0); block ids a tile ahead (1); words a tile, block ids two ahead (2)


def default_prefetch(preset: Preset | None = None) -> int:
    """The kernel's PREFETCH when the caller names none: ``TQKV_FRAGMENT_PREFETCH`` (0, 1 or 2); by default 2 (the
    next tile's block ids and words loaded before this tile's math: register double buffering, ~40 registers
    more, 3 programs an SM where 4 fit), 1 for fp8 keys (block ids only), 0 at head 256 (untimed there: 2 runs
    at 255 registers, 2 programs an SM). 2 hides some of the load latency that binds at PREFETCH 0; for fp8
    keys it loses at 64 x 4096, hence 1 there (docs/performance-history.md)."""
    if preset is not None and preset.head_dim > 128:
        fallback = "0"
    else:
        fallback = "1" if preset is not None and preset.key_fp8 else "2"
    return int(_setting(PREFETCH_ENV, fallback, PREFETCHES))


STAGE_ENV = "TQKV_FRAGMENT_STAGE"
STAGES = (0, 1, 2)  # the loops: fragments loaded in place (0), moved as 16-bit (1) or 32-bit words (2)


def default_stage(preset: Preset | None = None) -> int:
    """The kernel's STAGE when the caller names none: ``TQKV_FRAGMENT_STAGE`` (0, 1 or 2), default 1 (2 for
    ``preset``'s with 3-bit fields: the loop checked on the H200 for them; 1 was timed but not checked). 0: each
    thread loads its fragments' words itself, so a warp's load instruction reads 8 bytes of each of 8 positions
    (8-11 cache lines: the L1 serves one a cycle). 1 loads each position's words as one contiguous run of a warp
    (1-2 lines an instruction) and moves them into the fragments' layout through shared memory, as 16-bit words
    (2: extended to 32 bits first: 16 KB of shared memory traffic a tile against 8, ~35 fewer instructions).
    1 is the best or within 2% of it for every preset; 2 stays for the A/B. The measurements:
    docs/performance-history.md."""
    three_bit = preset is not None and _three_bit_fields(preset)
    return int(_setting(STAGE_ENV, "2" if three_bit else "1", STAGES))


KEY_TABLE_ENV = "TQKV_FRAGMENT_KEY_TABLE"
KEY_TABLE_COPIES = (0, 32, 8)  # the choices: none (byte permutes), 32 copies (the default on Hopper), 8


def default_key_table(preset: Preset | None = None, device: torch.device | None = None) -> int:
    """How 4-bit keys are looked up when the caller names nothing: ``TQKV_FRAGMENT_KEY_TABLE`` 32 (the default,
    on the Tritons whose compiled kernels :func:`reserve_shared` can grow: 3.6 to 3.9) or 0. 32: a table of the
    256 fp16 pairs in shared memory (:func:`_table4_pairs`: two byte extracts, two multiply-adds and two shared
    loads a word of four codes), 32 copies side by side so that a warp's lanes always hit different banks; 32 KB a
    program beyond Triton's own shared memory. 0: byte permutes from eight registers (:func:`_lut4_pairs`, 11
    instructions a word). 32 issues fewer instructions a tile and is faster than 0 on an H100; 8 copies (2-3
    lanes a bank) are slower than 0 (docs/performance-history.md). Other keys (fp8, 3-bit) have no table: 0.
    Unset, also 0 on GPUs other than Hopper (``device``; timed on an H100 only)."""
    if preset is not None and not has_key_table(preset):
        return 0
    fallback = _growable_launches() and (
        device is None or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9)
    return int(_setting(KEY_TABLE_ENV, "32" if fallback else "0", KEY_TABLE_COPIES))


def has_key_table(preset: Preset) -> bool:
    """Whether ``preset``'s keys can be looked up in the key pair table: 4-bit codes (fp8 keys are converted by the
    hardware, 3-bit ones by byte permutes from eight entries)."""
    return not preset.key_fp8 and preset.key_bits == 4


@functools.cache
def _growable_launches() -> bool:
    """Whether this Triton's compiled kernels carry the launch metadata :func:`reserve_shared` grows (3.6-3.9:
    checked there; elsewhere the key table stays off unless asked for)."""
    import triton

    major_minor = tuple(int(x) for x in triton.__version__.split(".")[:2])
    return (3, 6) <= major_minor <= (3, 9)


def table_bytes(copies: int) -> int:
    """Shared memory the key pair table takes with ``copies`` copies: 256 entries of 4 bytes each."""
    return 256 * 4 * copies


def reserve_shared(kernel, extra: int) -> None:
    """Make a compiled fragment kernel (a triton ``CompiledKernel``) launch with ``extra`` bytes of dynamic shared
    memory beyond what Triton allocated for it: the key pair table lives there (:func:`_table_base` finds it at
    the end, from ``%dynamic_smem_size``), out of the reach of Triton's own allocation. Patches the launch's
    metadata (triton 3.6's ``metadata.shared`` / ``packed_metadata``) and reloads the module so that the size
    limit above 48 KB is raised too; idempotent."""
    if kernel is None:
        raise RuntimeError("TQKV_FRAGMENT_KEY_TABLE: triton compiled no kernel to grow (a jit cache hook?); set it "
                           "to 0")
    if hasattr(kernel, "result"):  # (a compile still in flight: triton's async compile mode)
        kernel = kernel.result()
    if getattr(kernel, "_tqkv_extra_shared", None) == extra:
        return
    meta = getattr(kernel, "metadata", None)
    if meta is None or not hasattr(meta, "_replace") or not hasattr(kernel, "packed_metadata"):
        raise RuntimeError("TQKV_FRAGMENT_KEY_TABLE: this triton's compiled kernels have no metadata.shared / "
                           "packed_metadata to grow (written against triton 3.6); set it to 0")
    own = getattr(kernel, "_tqkv_own_shared", meta.shared)  # Triton's allocation
    shared = (-(-own // 128) * 128 + extra) if extra else own  # the table 128-byte aligned after it
    kernel.metadata = meta._replace(shared=shared)
    try:  # the launch's (num_warps, num_ctas, shared) as the backend packs it
        from triton.compiler.compiler import make_backend

        kernel.packed_metadata = make_backend(kernel.metadata.target).pack_metadata(kernel.metadata)
    except (ImportError, AttributeError):
        kernel.packed_metadata = (meta.num_warps, meta.num_ctas, shared)
    if getattr(kernel, "module", None) is not None:  # (loaded before: not in launch's flow) unloaded first
        from triton.runtime.driver import driver

        unload = getattr(driver.active.utils, "unload_module", None)
        if unload is not None:
            unload(kernel.module)
    kernel.module, kernel.function, kernel._run = None, None, None  # loaded again: the larger size's limit
    kernel._tqkv_own_shared, kernel._tqkv_extra_shared = own, extra


def _three_bit_fields(preset: Preset) -> bool:
    return preset.key_bits == 3 and not preset.key_fp8 or preset.value_bits == 3


MAXNREG_ENV = "TQKV_FRAGMENT_MAXNREG"


def maxnreg(dim: int, prefetch: int = 0) -> int:
    """The register cap: 4 programs an SM at head 128 (123 registers, no spills with triton 3.6), 168 at 256.
    Words prefetched a tile ahead (``prefetch`` 2) hold ~40 registers more: 168 at head 128 (3 programs an SM),
    255 at 256 (2). (Block ids a tile ahead, ``prefetch`` 1, at head 256 with STAGE 1 / 2: 8-16 bytes of spills
    under 168, triton 3.6.)

    ``TQKV_FRAGMENT_MAXNREG`` (a number, 64 to 255) sets the cap of every launch at head 128 instead, for the next
    A/B (so that the engine runs can take it; head 256 keeps its caps, which 128 would spill under): with the key
    table, which frees the permute lookup's registers, PREFETCH 2 at head 128 compiles under 128 without loop
    spills (sm_90a, triton 3.6: 4bit_nc 516 SASS a tile and 4 bytes spilled outside the loop, tqkv_4bit_pc 425
    and none, the 3-bit presets none), so 4 programs an SM instead of 3. Timed on an H100: slower over the
    4-bit-key presets, so 168 stays (docs/performance-history.md)."""
    if (forced := os.environ.get(MAXNREG_ENV)) is not None:
        if not (forced.isdigit() and 64 <= int(forced) <= 255):
            raise ValueError(f"{MAXNREG_ENV}={forced!r}: expected a number of registers from 64 to 255")
        if dim <= 128:
            return int(forced)
    if prefetch == 2:
        return 168 if dim <= 128 else 255
    return 128 if dim <= 128 else 168


def supports(preset: Preset, kv_cache: torch.Tensor, group: int, device: torch.device,
             stage: int | None = None) -> str | None:
    """None where the kernel can serve the call at ``stage`` (default :func:`default_stage`), else why not (a
    sentence). 3-bit fields (turboquant_k3v4_nc, turboquant_3bit_nc) are read at STAGE 1 / 2 only: their words
    are repacked into the 4-bit words' format in the row layout, before the move."""
    if gluon is None:
        return "this triton has no Gluon"
    if device.type != "cuda":
        return "the fragment kernel runs on CUDA GPUs only (Gluon has no interpreter)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "mma.sync m16n8k16 needs compute capability 8.0 or later"
    stage = default_stage(preset) if stage is None else stage
    if stage not in STAGES:
        return f"STAGE {stage}: the fragment kernel's loops are STAGE {_listed(STAGES, 'and')}"
    if not (preset.key_fp8 or preset.key_bits in (3, 4)) or preset.value_bits not in (3, 4) or not preset.vllm_layout:
        return f"{preset.name}: the fragment kernel reads vLLM's layouts only (3- or 4-bit or fp8 keys, 3- or 4-bit values)"
    if _three_bit_fields(preset) and stage == 0:
        return f"{preset.name}: 3-bit fields are read at TQKV_FRAGMENT_STAGE 1 or 2 only (the 4-bit or fp8 keys with 4-bit uniform values at any)"
    if preset.head_dim not in (128, 256):
        return f"head size {preset.head_dim}: the fragment kernel serves 128 and 256"
    if group > 8:
        return f"a query-head group of {group}: the fragment kernel serves up to 8"
    if kv_cache.dtype != torch.uint8 or kv_cache.stride(3) != 1 or kv_cache.shape[1] % 16:
        return "the cache must be uint8 slots with contiguous bytes and blocks of a multiple of 16 positions"
    offsets = (kv_cache.storage_offset(), *kv_cache.stride()[:3], preset.key_code_bytes, preset.key_bytes,
               preset.value_code_bytes)
    if any(o % 2 for o in offsets):
        return "the cache's fields and strides must be 2-byte aligned"
    if preset.key_fp8 and any(o % 4 for o in offsets[:4]):
        return "fp8 keys are read as 32-bit words: the cache's slots must be 4-byte aligned"
    if halves_span(kv_cache) >= 2**31:
        return "the cache view spans 2^31 half-words or more: the fragment kernel indexes in int32"
    return None


def _bits(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


@functools.lru_cache(maxsize=None)
def layouts(dim: int) -> dict:
    """The kernel's constexpr layouts for head size ``dim`` (see the module doc for what each element is)."""
    kt, words_v = dim // 16, dim // 128  # key words a thread holds of a row; value words of a position
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    # key words [64, D / 4]: word m = KT t + kk; registers kk then r1, lanes t then l // 4, warps: rows 16, 32
    key_words = gl.DistributedLinearLayout(
        reg_bases=[[0, k] for k in _bits(kt)] + [[8, 0]],
        lane_bases=[[0, kt], [0, 2 * kt], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, dim // 4])
    # value words [64, D / 4]: word J (8 w + l // 4) + j; registers b (first: the asm pairs positions 2 t, 2 t + 1),
    # r2, kk, then j; lanes t then l // 4; warps w
    value_words = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]] + [[0, j] for j in _bits(words_v)],
        lane_bases=[[2, 0], [4, 0], [0, words_v], [0, 2 * words_v], [0, 4 * words_v]],
        warp_bases=[[0, 8 * words_v], [0, 16 * words_v]], block_bases=[], shape=[BLOCK_N, dim // 4])
    # slot offsets [4 groups of 16 positions, 16] laid out as the key rows (the group is the warp) and as the
    # value positions (every warp every group): one block id a group of 16, not one a position
    key_slots = gl.DistributedLinearLayout(
        reg_bases=[[0, 8]], lane_bases=[[0, 0], [0, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[1, 0], [2, 0]], block_bases=[], shape=[4, 16])
    value_slots = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 8], [1, 0], [2, 0]], lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, 16])
    # words [64, D / 4] as a warp's load instruction reads them best: 32 consecutive words of one position (lanes
    # along the words, registers along the warp's 16 rows, then the next 32 words at head 256); warp w: rows 16 w ..
    row_words = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0]] + [[0, 32 * k] for k in _bits(dim // 128)],
        lane_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[BLOCK_N, dim // 4])
    # 3-bit fields' words [64, D / 4], column 4 g + j = word 3 g + j: lane (bits 0-2) the group g, (bits 3-4) rows
    # 1, 2; registers j, then rows 4, 8 (and groups past 8 at head 256): a group's three words in one thread,
    # 4 positions a warp's instruction; their slot offsets as ROW_SLOTS' (registers 0, 1 broadcast)
    row3_words = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [4, 0], [8, 0]] + [[0, 32 * k] for k in _bits(dim // 128)],
        lane_bases=[[0, 4], [0, 8], [0, 16], [1, 0], [2, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[BLOCK_N, dim // 4])
    row3_slots = gl.DistributedLinearLayout(
        reg_bases=[[0, 0], [0, 0], [0, 4], [0, 8]] + [[0, 0] for _ in _bits(dim // 128)],
        lane_bases=[[0, 0], [0, 0], [0, 0], [0, 1], [0, 2]], warp_bases=[[1, 0], [2, 0]], block_bases=[],
        shape=[4, 16])
    # their slot offsets [4 groups of 16 positions, 16]: a thread the 16 of its warp's group
    row_slots = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]], lane_bases=[[0, 0]] * 5, warp_bases=[[1, 0], [2, 0]],
        block_bases=[], shape=[4, 16])
    # the per-position fields [64, 4] as loaded (STAGE >= 1: lane l reads field l % 4 of row l // 4 (and + 8), 8
    # positions a warp's instruction; the rows as the scores hold them) and as used (a thread's 4 in registers)
    field_rows = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, 4])
    field_regs = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, 4])
    # the key pair table's fill (_fill_key_table): consecutive words across a warp's lanes; the same for the
    # length-aware split plan's vectors (_split_plan: 128 sequences, 128 split counts)
    table_fill = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    return dict(TABLE_FILL=table_fill, PLAN=table_fill, ROW_WORDS=row_words, ROW_SLOTS=row_slots, ROW3_WORDS=row3_words,
                ROW3_SLOTS=row3_slots, FIELD_ROWS=field_rows, FIELD_REGS=field_regs, MMA=mma,
                A_OP=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                B_OP=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
                KEY_WORDS=key_words, VALUE_WORDS=value_words, KEY_SLOTS=key_slots, VALUE_SLOTS=value_slots)


def key_order(dim: int) -> torch.Tensor:
    """int32 [D]: the stored key coordinate of the kernel's column c, by the kernel's own chain run on coordinate
    indices: word m of a row holds coordinates 4 m .. 4 m + 3, the lookup gives the pairs (4 m, 4 m + 1) and
    (4 m + 2, 4 m + 3), then join / permute / reshape as in :func:`fragment_kernel`."""
    kt = dim // 16
    m = torch.arange(dim // 4)
    low = torch.stack([4 * m, 4 * m + 1], -1)  # [m, b]
    high = torch.stack([4 * m + 2, 4 * m + 3], -1)
    x = torch.stack([low, high], -1).permute(0, 2, 1)  # [m, r2, b]
    x = x.reshape(4, kt, 2, 2).permute(1, 2, 0, 3)  # [kk, r2, t, b]
    return x.reshape(dim).to(torch.int32)


def value_order(dim: int) -> torch.Tensor:
    """int32 [D]: the stored value coordinate of the kernel's accumulator row rd, by the kernel's chain run on
    coordinate indices (word g of a position holds coordinates 4 g .. 4 g + 3, output i of the unpacking is
    nibble i). Odd coordinates sit in a byte's high nibble: the kernel's codes there are 16 x code."""
    vj = dim // 128
    word = torch.arange(dim // 4)
    v = [4 * word + i for i in range(4)]
    y = torch.stack([torch.stack([v[0], v[1]], -1), torch.stack([v[2], v[3]], -1)], -1)  # [word, i % 2, i // 2]
    y = y.reshape(4, 8, vj, 2, 2).permute(2, 4, 0, 3, 1)  # [j, i // 2, w, r1, l // 4]
    return y.reshape(dim).to(torch.int32)


_ORDERS: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def orders(dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`key_order`, :func:`value_order`) on ``device``, built once (before CUDA-graph capture: warm)."""
    key = (dim, str(device))
    if key not in _ORDERS:
        _ORDERS[key] = (key_order(dim).to(device), value_order(dim).to(device))
    return _ORDERS[key]


_LUTS: dict[tuple[str, int, str], torch.Tensor] = {}


def key_lut(preset: Preset, device: torch.device) -> torch.Tensor:
    """The stream kernel's key table (:func:`cache_tables.key_lut`, 8 int32) twice, built once per preset
    and device (before CUDA-graph capture: ``TritonBackend.warm``): the kernel loads the copy its lane's parity
    names. (The stream kernel had the same trick for a while and reverted it: fewer instructions, no faster
    there.)"""
    key = (preset.name, preset.head_dim, str(device))
    if key not in _LUTS:
        lut = stream_lut(preset, device)
        _LUTS[key] = torch.cat([lut, lut]).contiguous()
    return _LUTS[key]


_PAIRS: dict[tuple[str, int, str], torch.Tensor] = {}


def key_pairs(preset: Preset, device: torch.device) -> torch.Tensor:
    """int32 [256]: entry e the fp16 pair (centroid[e & 15], centroid[e >> 4]) (low half first), the key pair
    table :func:`_table4_pairs` reads (a word's byte 0 holds codes 0 and 1, byte 1 codes 2 and 3); built once per
    preset and device (before CUDA-graph capture: ``TritonBackend.warm``)."""
    key = (preset.name, preset.head_dim, str(device))
    if key not in _PAIRS:
        bits = preset.centroids("cpu").float().to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
        e = torch.arange(256)
        _PAIRS[key] = (bits[e & 15] | (bits[e >> 4] << 16)).to(torch.int32).contiguous().to(device)
    return _PAIRS[key]


if gluon is not None:
    @gluon.jit
    def _lut4_pairs(words, t0, t1, t2, t3, t4, t5, t6, t7):
        """int32 words (low 16 bits: four 4-bit codes) -> the fp16 pairs (codes 0, 1) and (codes 2, 3): the
        stream kernel's byte-permute lookup (:func:`device_helpers.lut4_fp16`), each pair in one register."""
        return gl.inline_asm_elementwise(
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
            [gl.join(words, words), t0, t1, t2, t3, t4, t5, t6, t7],  # pack=2: the asm reads the first copy
            dtype=(gl.float16, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def _table4_pairs(words, lane_base, stride):
        """int32 words (low 16 bits: four 4-bit codes; the high half ignored) -> the fp16 pairs (codes 0, 1) and
        (codes 2, 3), each one shared load from the key pair table (:func:`key_pairs`, entry e at ``lane_base`` +
        e x ``stride``: the lane's copy, :func:`_table_lane_base`)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 b0, b1, a0, a1;
            prmt.b32 b0, $2, 0, 0x4440;
            prmt.b32 b1, $2, 0, 0x4441;
            mad.lo.u32 a0, b0, $6, $4;
            mad.lo.u32 a1, b1, $6, $4;
            ld.shared.b32 $0, [a0];
            ld.shared.b32 $1, [a1];
            }""",
            "=r,=r,r,r,r,r,r,r",
            [gl.join(words, words), lane_base, stride],  # pack=2: the asm reads the first copy of each
            dtype=(gl.float16, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def _table_base(nbytes):
        """The shared-window address of the key pair table: the last ``nbytes`` of the launch's dynamic shared
        memory (``global_smem``, Triton's, runs to ``%dynamic_smem_size``; the launcher adds the table's bytes
        beyond Triton's own: :func:`reserve_shared`)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 n;
            mov.u32 n, %dynamic_smem_size;
            mov.u32 $0, global_smem;
            add.u32 $0, $0, n;
            sub.u32 $0, $0, $1;
            }""", "=r,r", [nbytes], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _table_lane_base(base, copies_mask):
        """``base`` + 4 x (lane & ``copies_mask``) (copies - 1, copies a power of 2): where this lane's copy of the
        table's entry 0 is (entry e is e x 4 ``copies`` bytes further: copies side by side, so lanes of different
        copies read different banks)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 l;
            mov.u32 l, %laneid;
            and.b32 l, l, $2;
            shl.b32 l, l, 2;
            add.u32 $0, $1, l;
            }""", "=r,r,r", [base, copies_mask], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _store_shared(address, value):
        """st.shared.b32 of ``value`` at shared-window ``address``, elementwise (the result: 0, for Triton)."""
        return gl.inline_asm_elementwise("st.shared.b32 [$1], $2; mov.b32 $0, 0;", "=r,r,r", [address, value],
                                         dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _fill_key_table(pairs_ptr, base, COPIES: gl.constexpr, TABLE_FILL: gl.constexpr):
        """Write the key pair table (``pairs_ptr``: :func:`key_pairs`) ``COPIES`` times into shared memory at
        ``base``: word e x COPIES + c is entry e (copy c), 2 COPIES words a thread. (The caller syncs after.)"""
        i = gl.arange(0, 256 * COPIES, layout=TABLE_FILL)
        _store_shared(base + 4 * i, gl.load(pairs_ptr + i // COPIES))

    @gluon.jit
    def _fp8_pairs(words):
        """int32 words of four fp8 e4m3 codes -> the fp16 pairs (codes 0, 1) and (codes 2, 3), by the hardware's
        two-at-a-time conversion (the stream kernel's :func:`device_helpers.fp8x4_fp16`, each pair in one
        register)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b16 l, h;
            mov.b32 {l, h}, $2;
            cvt.rn.f16x2.e4m3x2 $0, l;
            cvt.rn.f16x2.e4m3x2 $1, h;
            }""",
            "=r,=r,r,r", [gl.join(words, words)], dtype=(gl.float16, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def _value_pairs(words):
        """int32 words (low 16 bits: four 4-bit codes) of two consecutive positions (pack=2: $4, $5) -> four
        fp16 pair tensors, nibble i of both words: code * 2^-24 (i even) or 16 code * 2^-24 (i odd), exact
        (fp16 subnormals: ``device_helpers.codes_f16`` says why). Two byte permutes put a byte of each word
        in the low byte of an fp16 half; an and keeps one nibble."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 x, y;
            prmt.b32 x, $4, $5, 0x0400;
            prmt.b32 y, $4, $5, 0x0501;
            and.b32 $0, x, 0x000F000F;
            and.b32 $1, x, 0x00F000F0;
            and.b32 $2, y, 0x000F000F;
            and.b32 $3, y, 0x00F000F0;
            }""",
            "=r,=r,=r,=r,r,r",
            [words],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def _word(halves):
        """16-bit words zero-extended to int32, opaquely: a word the loop carries (``PREFETCH`` 2) would otherwise
        cross the loop as i16 and be extended again (a LOP3 each) after it; here the load's own zero extension
        stands."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [halves.to(gl.int32)], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _spread3x8(v):
        """int32: eight 3-bit codes in bits 0..23 of ``v`` (the bits above ignored) -> two words of four 4-bit
        codes each (nibble i = code i, bit 3 clear: the 4-bit words' format) in the low halves of two int32s:
        codes 0-3 (the first also holds codes 4-7 in its high half, which the lookups never read), codes 4-7.
        Three shift-and-merge steps move the fields apart: 12-bit halves to 16 bits, 6-bit quarters to bytes,
        3-bit codes to nibbles."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 t, u;
            shl.b32 u, $2, 4;
            and.b32 t, $2, 0xFFF;
            lop3.b32 t, u, 0x0FFF0000, t, 0xEA;
            shl.b32 u, t, 2;
            and.b32 t, t, 0x003F003F;
            lop3.b32 t, u, 0x3F003F00, t, 0xEA;
            shl.b32 u, t, 1;
            and.b32 t, t, 0x07070707;
            lop3.b32 $0, u, 0x70707070, t, 0xEA;
            shr.u32 $1, $0, 16;
            }""",
            "=r,=r,r", [v], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _lut3_pairs(words, t0, t1, t4, t5):
        """int32 words (low 16 bits: four 3-bit codes as nibbles, bit 3 clear) -> the fp16 pairs (codes 0, 1) and
        (codes 2, 3) from the key table's first eight entries (:func:`_lut4_pairs` without the upper half: the
        words are the byte selectors themselves)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 lo, hi;
            prmt.b32 lo, $4, $6, $2;
            prmt.b32 hi, $8, $10, $2;
            prmt.b32 $0, lo, hi, 0x5140;
            prmt.b32 $1, lo, hi, 0x7362;
            }""",
            "=r,=r,r,r,r,r,r,r,r,r,r,r",
            [gl.join(words, words), t0, t1, t4, t5],  # pack=2: the asm reads the first copy
            dtype=(gl.float16, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def _three_bit_words(halves, ROWS_N: gl.constexpr, GROUPS: gl.constexpr):
        """A [rows, 4 G] tile of 16-bit words, columns 4 g + j = word 3 g + j of the 3-bit field (j = 3: the
        next group's first word, unused) -> int32 [rows, 4 G]: column 4 g + k the 4-bit-format word of codes
        16 g + 4 k .. + 3. Three little-endian words hold 16 codes, code i at bit 3 i (codec.pack_codes)."""
        h = gl.reshape(halves.to(gl.int32), [ROWS_N, GROUPS, 2, 2])  # [row, g, j // 2, j % 2]
        even, odd = gl.split(h)
        h0, h2 = gl.split(even)
        h1, _ = gl.split(odd)
        first0, first1 = _spread3x8(h0 | (h1 << 16))  # codes 0-7: bits 0 .. 23 of the 48
        second0, second1 = _spread3x8((h1 | (h2 << 16)) >> 8)  # codes 8-15: bits 24 .. 47
        low = gl.join(first0, second0)  # words 0 and 2
        high = gl.join(first1, second1)  # words 1 and 3
        return gl.reshape(gl.join(low, high), [ROWS_N, 4 * GROUPS])  # [row, g, k // 2, k % 2]

    @gluon.jit
    def _lane_parity():
        return gl.inline_asm_elementwise(
            """{
            mov.u32 $0, %laneid;
            and.b32 $0, $0, 1;
            }""", "=r,r", [gl.program_id(0)], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _block_ids(bt_row, s_bm, start, end, groups, BLOCK_SIZE: gl.constexpr):
        """The block ids [4] of the tile at ``start``, one a group of 16 positions (0 past ``end``: block 0's
        slots, read and dropped)."""
        first = start + 16 * groups
        return gl.load(bt_row + (first // BLOCK_SIZE) * s_bm, mask=first < end, other=0)

    @gluon.jit
    def _slots(block, start, groups, within, h_blk, h_pos, h_base, BLOCK: gl.constexpr, BLOCK_SIZE: gl.constexpr):
        """Slot offsets [64] (2-byte units, the kv head's ``h_base`` added) of the tile at ``start`` from its
        :func:`_block_ids`; laid out as [4 groups, 16] (the key rows' or the value positions' layout)."""
        first = start + 16 * groups
        slots = block[:, None] * h_blk + ((first % BLOCK_SIZE)[:, None] + within[None, :]) * h_pos
        return gl.reshape(slots, [BLOCK]) + h_base

    @gluon.jit
    def _group_base(block, start, groups, h_blk, h_base, H_POS: gl.constexpr, BLOCK_SIZE: gl.constexpr):
        """The slot offset (2-byte units) of the first position of each group of 16 of the tile at ``start``
        (the kv head's ``h_base`` added), from its :func:`_block_ids`."""
        return block * h_blk + ((start + 16 * groups) % BLOCK_SIZE) * H_POS + h_base

    @gluon.jit
    def _position_pointers(ptr, block, start, h_blk, h_base, SLOTS: gl.constexpr, OUT: gl.constexpr,
                           H_POS: gl.constexpr, BLOCK: gl.constexpr, BLOCK_SIZE: gl.constexpr):
        """``ptr`` + each position's slot offset [64] of the tile at ``start``, laid out as ``OUT`` (a [4, 16]
        ``SLOTS`` layout reshaped): built in two steps, a group's base and then the position within the group as
        a multiple of the constexpr stride, so that a thread's positions of one block differ by immediates."""
        block = gl.convert_layout(block, gl.SliceLayout(1, SLOTS))  # (the same block id: warp w, group w)
        groups = gl.arange(0, 4, layout=gl.SliceLayout(1, SLOTS))
        within = gl.arange(0, 16, layout=gl.SliceLayout(0, SLOTS))
        base = _group_base(block, start, groups, h_blk, h_base, H_POS, BLOCK_SIZE)
        rows = gl.reshape((ptr + base)[:, None] + (within * H_POS)[None, :], [BLOCK])
        return gl.convert_layout(rows, OUT, assert_trivial=True)

    @gluon.jit
    def _tile_loads(hptr, wptr, fptr, kb, vb, start, end, kg, kp, vgr, vp, km, vm, sn, h_blk, h_pos, h_base,
                    KEY_FP8: gl.constexpr, KEY_CODE_BYTES: gl.constexpr, VALUE_OFFSET: gl.constexpr,
                    VALUE_CODE_BYTES: gl.constexpr, BLOCK: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                    KEY_WORDS: gl.constexpr, VALUE_WORDS: gl.constexpr, ROWS: gl.constexpr, STAGE: gl.constexpr,
                    ROW_WORDS: gl.constexpr, ROW_SLOTS: gl.constexpr, FIELD_ROWS: gl.constexpr,
                    H_POS: gl.constexpr, KEY_BITS: gl.constexpr, VALUE_BITS: gl.constexpr,
                    ROW3_WORDS: gl.constexpr, ROW3_SLOTS: gl.constexpr, KEY_SLOTS: gl.constexpr):
        """Everything the tile at ``start`` reads from the cache, given its block ids (``kb``, ``vb``: the key
        rows' and the value positions' copies): the key words, the value words, and the fields, each position's
        key norm, value scale and value zero (fp16, 0 past ``end``; fp8 keys have no norm: the scale in its
        place, never read), for :func:`_fields`.
        ``STAGE`` 0: the words as the fragments hold them (``KEY_WORDS`` / ``VALUE_WORDS``: a load instruction
        of a warp reads 8 bytes of each of 8 positions); 1 and 2: as ``ROW_WORDS`` (a warp's instruction reads
        consecutive words of one position), 16-bit (1) or extended to 32 (2), for the kernel to move into the
        fragments' layout."""
        if STAGE >= 1:  # a pointer a position, laid out along the rows of ROW_WORDS
            rows = _position_pointers(hptr, kb, start, h_blk, h_base, ROW_SLOTS, gl.SliceLayout(1, ROW_WORDS),
                                      H_POS, BLOCK, BLOCK_SIZE)
            rm = gl.arange(0, km.shape[0], layout=gl.SliceLayout(0, ROW_WORDS))
            if KEY_BITS == 3 or VALUE_BITS == 3:  # 3-bit fields: a group's three words a lane (ROW3_WORDS)
                rows3 = _position_pointers(hptr, kb, start, h_blk, h_base, ROW3_SLOTS, gl.SliceLayout(1, ROW3_WORDS),
                                           H_POS, BLOCK, BLOCK_SIZE)
                c3 = gl.arange(0, km.shape[0], layout=gl.SliceLayout(0, ROW3_WORDS))
                c3 = 3 * (c3 >> 2) + (c3 & 3)  # word 3 g + j (j = 3 reads the next group's first: inside the slot)
            if KEY_FP8:  # 32-bit words (4-byte aligned slots and strides: supports())
                kw = gl.load(rows.to(gl.pointer_type(gl.int32), bitcast=True)[:, None] + rm[None, :])
            elif KEY_BITS == 3:  # repacked into the 4-bit keys' words in registers, then moved like them
                kw = _three_bit_words(gl.load(rows3[:, None] + c3[None, :]), BLOCK, km.shape[0] // 4)
                if STAGE == 1:
                    kw = kw.to(gl.uint16)
            elif STAGE == 1:  # (16-bit: half the shared memory traffic of the move; extended after it)
                kw = gl.load(rows[:, None] + rm[None, :])
            else:  # (2: extended first, moved as 32-bit words: fewer instructions to pack and unpack)
                kw = _word(gl.load(rows[:, None] + rm[None, :]))
            if VALUE_BITS == 3:
                vw = _three_bit_words(gl.load(rows3[:, None] + (VALUE_OFFSET // 2 + c3)[None, :]), BLOCK,
                                      km.shape[0] // 4)
                if STAGE == 1:
                    vw = vw.to(gl.uint16)
            else:
                vw = gl.load(rows[:, None] + (VALUE_OFFSET // 2 + rm)[None, :])
                if STAGE == 2:
                    vw = _word(vw)
        else:
            kslot = _slots(kb, start, kg, kp, h_blk, h_pos, h_base, BLOCK, BLOCK_SIZE)
            kslot = gl.convert_layout(kslot, gl.SliceLayout(1, KEY_WORDS), assert_trivial=True)
            # not masked: past the end a position reads a slot of block 0, inside the cache, and is dropped
            if KEY_FP8:  # 32-bit words of four codes (4-byte aligned slots: supports())
                kw = gl.load(wptr + (kslot >> 1)[:, None] + km[None, :])
            else:  # 16-bit words of four codes
                kw = _word(gl.load(hptr + kslot[:, None] + km[None, :]))
            vslot = _slots(vb, start, vgr, vp, h_blk, h_pos, h_base, BLOCK, BLOCK_SIZE)
            vslot = gl.convert_layout(vslot, gl.SliceLayout(1, VALUE_WORDS), assert_trivial=True)
            vw = _word(gl.load(hptr + vslot[:, None] + (VALUE_OFFSET // 2 + vm)[None, :]))
        # the fields (fp16, converted where used: a conversion here would wait for a prefetched load)
        scale_at: gl.constexpr = (VALUE_OFFSET + VALUE_CODE_BYTES) // 2
        norm_at: gl.constexpr = scale_at if KEY_FP8 else KEY_CODE_BYTES // 2  # (fp8 keys: no norm, never read)
        if STAGE >= 1:  # a [64, 4] tile, columns (norm, zero, scale, zero): a warp's instruction reads 8 positions
            frows = _position_pointers(fptr, kb, start, h_blk, h_base, KEY_SLOTS, gl.SliceLayout(1, FIELD_ROWS),
                                       H_POS, BLOCK, BLOCK_SIZE)
            fc = gl.arange(0, 4, layout=gl.SliceLayout(0, FIELD_ROWS))
            at = gl.where(fc == 0, norm_at, gl.where(fc == 2, scale_at, scale_at + 1))
            fvalid = start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, FIELD_ROWS)) < end
            fields = gl.load(frows[:, None] + at[None, :], mask=fvalid[:, None], other=0.0)
        else:  # each as the score rows hold them, joined (no data moves) as [64, 2, 2] (norm, scale), (zero, zero)
            valid = start + sn < end
            sslot = gl.convert_layout(kslot, ROWS, assert_trivial=True)  # the score rows are the key rows
            vscale = gl.load(fptr + sslot + scale_at, mask=valid, other=0.0)
            vzero = gl.load(fptr + sslot + scale_at + 1, mask=valid, other=0.0)
            if KEY_FP8:
                knorm = vscale
            else:
                knorm = gl.load(fptr + sslot + norm_at, mask=valid, other=0.0)
            fields = gl.join(gl.join(knorm, vscale), gl.join(vzero, vzero))
        return kw, vw, fields

    @gluon.jit
    def _fields(fields, ROWS: gl.constexpr, FIELD_REGS: gl.constexpr, STAGE: gl.constexpr):
        """:func:`_tile_loads`' fields -> (key norm, value scale, value zero), fp32 in the score rows' layout."""
        if STAGE >= 1:  # into the rows' layout, the four columns in a thread's registers (through shared memory)
            fields = gl.reshape(gl.convert_layout(fields, FIELD_REGS), [fields.shape[0], 2, 2])
        first, second = gl.split(fields)
        knorm, vscale = gl.split(first)
        vzero, _ = gl.split(second)
        return (gl.convert_layout(knorm, ROWS, assert_trivial=True).to(gl.float32),
                gl.convert_layout(vscale, ROWS, assert_trivial=True).to(gl.float32),
                gl.convert_layout(vzero, ROWS, assert_trivial=True).to(gl.float32))

    @gluon.jit
    def _split_plan(qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted,
                    BLOCK: gl.constexpr, NUM_SPLITS: gl.constexpr, PLAN: gl.constexpr):
        """:func:`device_helpers.split_plan` for one query row a program (row blocks are rows), in Gluon: (the
        count the wave model rates best for a batch of the mean, the batch's mean tiles a row; NUM_SPLITS <= 128)."""
        total = num_seqs * 0
        blocks = num_seqs * 0
        for first in range(0, num_seqs, 128):
            s = first + gl.arange(0, 128, layout=PLAN)
            ok = s < num_seqs
            n = gl.load(qsl_ptr + s + 1, mask=ok, other=0) - gl.load(qsl_ptr + s, mask=ok, other=0)
            length = gl.minimum(gl.load(seq_lens_ptr + s, mask=ok, other=0), max_len)
            total += gl.sum(n * ((length + BLOCK - 1) // BLOCK), axis=0)
            blocks += gl.sum(n, axis=0)
        blocks = gl.maximum(blocks, 1)
        mean = gl.maximum((total + blocks - 1) // blocks, 1)
        pairs = blocks * gl.num_programs(1)
        c = gl.arange(0, 128, layout=PLAN) + 1
        most = gl.minimum(gl.minimum(mean, (plan_wanted + pairs - 1) // pairs), NUM_SPLITS)
        cost = ((pairs * c + plan_slots - 1) // plan_slots) * ((mean + c - 1) // c + 2)
        cost = gl.where(c <= gl.maximum(most, 1), cost, 2147483647)
        best = gl.min(cost, axis=0)
        return gl.max(gl.where(cost == best, c, 0), axis=0), mean

    @gluon.jit
    def fragment_kernel(q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, lut_ptr, key_order_ptr,
                        value_order_ptr, part_out_ptr, part_lse_ptr, num_seqs, max_len, plan_slots, plan_wanted,
                        s_qt, s_qh, s_bt, s_bm, h_blk, h_pos, h_head,
                        GROUP: gl.constexpr, D: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                        NUM_SPLITS: gl.constexpr, SEARCH_STEPS: gl.constexpr, KEY_FP8: gl.constexpr,
                        NORM_CORRECTION: gl.constexpr, PREFETCH: gl.constexpr,
                        KEY_CODE_BYTES: gl.constexpr, VALUE_OFFSET: gl.constexpr, VALUE_CODE_BYTES: gl.constexpr,
                        MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, KEY_WORDS: gl.constexpr,
                        VALUE_WORDS: gl.constexpr, KEY_SLOTS: gl.constexpr, VALUE_SLOTS: gl.constexpr,
                        ROW_WORDS: gl.constexpr, ROW_SLOTS: gl.constexpr, FIELD_ROWS: gl.constexpr,
                        FIELD_REGS: gl.constexpr, H_POS: gl.constexpr, KEY_BITS: gl.constexpr,
                        VALUE_BITS: gl.constexpr, ROW3_WORDS: gl.constexpr, ROW3_SLOTS: gl.constexpr,
                        STAGE: gl.constexpr, KEY_TABLE: gl.constexpr, TABLE_FILL: gl.constexpr, PLAN: gl.constexpr,
                        LENGTH_AWARE: gl.constexpr = False):
        BLOCK: gl.constexpr = 64
        KT: gl.constexpr = D // 16
        VJ: gl.constexpr = D // 128
        # (the key and value coordinate orders come as tables: key_order / value_order run this chain on indices)
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
        COLS: gl.constexpr = gl.SliceLayout(0, MMA)
        row = gl.program_id(0)
        kv_head = gl.program_id(1)
        split = gl.program_id(2)
        hptr = cache_ptr.to(gl.pointer_type(gl.uint16), bitcast=True)
        wptr = cache_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        fptr = cache_ptr.to(gl.pointer_type(gl.float16), bitcast=True)

        at_mean = num_seqs * 0
        mean = at_mean + 1
        if LENGTH_AWARE:  # the batch's plan first: its loads need nothing of this program's row
            at_mean, mean = _split_plan(qsl_ptr, seq_lens_ptr, num_seqs, max_len, plan_slots, plan_wanted, BLOCK,
                                        NUM_SPLITS, PLAN)
        # the row's sequence and causal length (device_helpers.row_context)
        in_batch = row < num_seqs
        start_q = gl.load(qsl_ptr + row, mask=in_batch, other=0)
        stop_q = gl.load(qsl_ptr + row + 1, mask=in_batch, other=0)
        seq = row
        if not ((start_q <= row) & (row < stop_q)):  # not one token per sequence: bisect query_start_loc
            lo = row * 0
            hi = lo + num_seqs
            for _ in range(SEARCH_STEPS):
                mid = (lo + hi) // 2
                go = gl.load(qsl_ptr + 1 + mid, mask=mid < num_seqs, other=0) <= row
                active = lo < hi
                lo = gl.where(active & go, mid + 1, lo)
                hi = gl.where(active & (go == 0), mid, hi)
            seq = gl.minimum(lo, num_seqs - 1)
            start_q = gl.load(qsl_ptr + seq)
            stop_q = gl.load(qsl_ptr + seq + 1)
        length = gl.load(seq_lens_ptr + seq) - (stop_q - start_q) + (row - start_q) + 1
        length = gl.where((start_q <= row) & (row < stop_q), length, 0)
        length = gl.minimum(length, max_len)
        count = length * 0 + NUM_SPLITS
        if LENGTH_AWARE:  # this row's share of the plan (device_helpers.split_share)
            tiles = (length + BLOCK - 1) // BLOCK
            share = (2 * at_mean * tiles + mean) // (2 * mean)
            count = gl.maximum(gl.minimum(gl.minimum(share, NUM_SPLITS), tiles), 1)
        per_split = gl.cdiv(gl.cdiv(length, count), BLOCK) * BLOCK
        begin = split * per_split
        end = gl.minimum(begin + per_split, length)
        h = gl.arange(0, 8, layout=COLS)
        part = (row * (GROUP * gl.num_programs(1)) + kv_head * GROUP + h) * NUM_SPLITS + split
        head_ok = h < GROUP
        if begin >= end:
            gl.store(part_lse_ptr + part, gl.full([8], float("-inf"), gl.float32, layout=COLS), mask=head_ok)
            return

        # the query^T [D, 8], the B operand, its rows in the keys' stored order
        s = gl.load(key_order_ptr + gl.arange(0, D, layout=gl.SliceLayout(1, B_OP)))
        hq = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
        q = gl.load(q_ptr + row * s_qt + (kv_head * GROUP + hq)[None, :] * s_qh + s[:, None],
                    mask=(hq < GROUP)[None, :], other=0.0).to(gl.float16)
        if NORM_CORRECTION:
            ones = gl.full([D, 8], 1.0, gl.float16, layout=B_OP)
        if KEY_TABLE > 0:  # the key pair table in shared memory, KEY_TABLE copies (lut_ptr: key_pairs)
            gl.static_assert(KEY_BITS == 4 and not KEY_FP8, "the key pair table serves 4-bit keys")
            table = _table_base(gl.program_id(0) * 0 + 1024 * KEY_TABLE)
            _fill_key_table(lut_ptr, table, KEY_TABLE, TABLE_FILL)
            _barrier()
            lane_table = _table_lane_base(table, gl.program_id(0) * 0 + (KEY_TABLE - 1))
            table_stride = gl.program_id(0) * 0 + 4 * KEY_TABLE
        elif not KEY_FP8:
            copy = 8 * _lane_parity()  # the table twice: which copy depends on the lane (module doc)
            t0 = gl.load(lut_ptr + copy + 0)
            t1 = gl.load(lut_ptr + copy + 1)
            t2 = gl.load(lut_ptr + copy + 2)
            t3 = gl.load(lut_ptr + copy + 3)
            t4 = gl.load(lut_ptr + copy + 4)
            t5 = gl.load(lut_ptr + copy + 5)
            t6 = gl.load(lut_ptr + copy + 6)
            t7 = gl.load(lut_ptr + copy + 7)

        m_i = gl.full([8], float("-inf"), gl.float32, layout=COLS)
        l_acc = gl.full([BLOCK, 8], 0.0, gl.float32, layout=MMA)  # sums over positions, kept per position
        z_acc = gl.full([BLOCK, 8], 0.0, gl.float32, layout=MMA)
        acc = gl.full([D, 8], 0.0, gl.float32, layout=MMA)  # transposed: [dimension, query head]
        zeros = gl.full([D, 8], 0.0, gl.float32, layout=MMA)
        bt_row = block_table_ptr + seq.to(gl.int64) * s_bt
        head_base = kv_head * h_head
        kg = gl.arange(0, 4, layout=gl.SliceLayout(1, KEY_SLOTS))
        kp = gl.arange(0, 16, layout=gl.SliceLayout(0, KEY_SLOTS))
        vgr = gl.arange(0, 4, layout=gl.SliceLayout(1, VALUE_SLOTS))
        vp = gl.arange(0, 16, layout=gl.SliceLayout(0, VALUE_SLOTS))
        km = gl.arange(0, D // 4, layout=gl.SliceLayout(0, KEY_WORDS))
        vm = gl.arange(0, D // 4, layout=gl.SliceLayout(0, VALUE_WORDS))
        sn = gl.arange(0, BLOCK, layout=ROWS)
        # PREFETCH 0: a tile's block ids, then its words, then its math (two memory round trips a tile in a row);
        # 1: the block ids a tile ahead; 2: the block ids two tiles ahead and the words one tile ahead (register
        # double buffering: the next tile's loads are in flight during this tile's math)
        if PREFETCH >= 1:
            kb = _block_ids(bt_row, s_bm, begin, end, kg, BLOCK_SIZE)
            vb = _block_ids(bt_row, s_bm, begin, end, vgr, BLOCK_SIZE) if STAGE == 0 else kb
        if PREFETCH == 2:
            kw, vw, fields = _tile_loads(
                hptr, wptr, fptr, kb, vb, begin, end, kg, kp, vgr, vp, km, vm, sn, h_blk, h_pos, head_base,
                KEY_FP8, KEY_CODE_BYTES, VALUE_OFFSET, VALUE_CODE_BYTES, BLOCK, BLOCK_SIZE, KEY_WORDS, VALUE_WORDS,
                ROWS, STAGE, ROW_WORDS, ROW_SLOTS, FIELD_ROWS, H_POS, KEY_BITS,
                VALUE_BITS, ROW3_WORDS, ROW3_SLOTS, KEY_SLOTS)
            kb = _block_ids(bt_row, s_bm, begin + BLOCK, end, kg, BLOCK_SIZE)
            vb = _block_ids(bt_row, s_bm, begin + BLOCK, end, vgr, BLOCK_SIZE) if STAGE == 0 else kb
        for start in range(begin, end, BLOCK):
            if PREFETCH == 2:
                kb_next = _block_ids(bt_row, s_bm, start + 2 * BLOCK, end, kg, BLOCK_SIZE)
                vb_next = _block_ids(bt_row, s_bm, start + 2 * BLOCK, end, vgr, BLOCK_SIZE) if STAGE == 0 else kb_next
                kw_next, vw_next, fields_next = _tile_loads(
                    hptr, wptr, fptr, kb, vb, start + BLOCK, end, kg, kp, vgr, vp, km, vm, sn, h_blk, h_pos,
                    head_base, KEY_FP8, KEY_CODE_BYTES, VALUE_OFFSET, VALUE_CODE_BYTES, BLOCK, BLOCK_SIZE, KEY_WORDS,
                    VALUE_WORDS, ROWS, STAGE, ROW_WORDS, ROW_SLOTS, FIELD_ROWS, H_POS, KEY_BITS,
                VALUE_BITS, ROW3_WORDS, ROW3_SLOTS, KEY_SLOTS)
            else:
                if PREFETCH == 1:
                    kb_next = _block_ids(bt_row, s_bm, start + BLOCK, end, kg, BLOCK_SIZE)
                    vb_next = _block_ids(bt_row, s_bm, start + BLOCK, end, vgr, BLOCK_SIZE) if STAGE == 0 else kb_next
                else:
                    kb = _block_ids(bt_row, s_bm, start, end, kg, BLOCK_SIZE)
                    vb = _block_ids(bt_row, s_bm, start, end, vgr, BLOCK_SIZE) if STAGE == 0 else kb
                kw, vw, fields = _tile_loads(
                    hptr, wptr, fptr, kb, vb, start, end, kg, kp, vgr, vp, km, vm, sn, h_blk, h_pos, head_base,
                    KEY_FP8, KEY_CODE_BYTES, VALUE_OFFSET, VALUE_CODE_BYTES, BLOCK, BLOCK_SIZE, KEY_WORDS,
                    VALUE_WORDS, ROWS, STAGE, ROW_WORDS, ROW_SLOTS, FIELD_ROWS, H_POS, KEY_BITS,
                VALUE_BITS, ROW3_WORDS, ROW3_SLOTS, KEY_SLOTS)
            valid = start + sn < end
            knorm, vscale, vzero = _fields(fields, ROWS, FIELD_REGS, STAGE)

            if STAGE == 1:  # into the fragments' layout (through shared memory), then extended
                if KEY_FP8:
                    kf = gl.convert_layout(kw, KEY_WORDS)
                else:
                    kf = _word(gl.convert_layout(kw, KEY_WORDS))
                vf = _word(gl.convert_layout(vw, VALUE_WORDS))
            elif STAGE == 2:  # into the fragments' layout (through shared memory)
                kf = gl.convert_layout(kw, KEY_WORDS)
                vf = gl.convert_layout(vw, VALUE_WORDS)
            elif STAGE == 0:
                kf = kw
                vf = vw

            # ---- keys: scores^T [64, 8] = K . q^T
            if KEY_FP8:
                low, high = _fp8_pairs(kf)
            elif KEY_BITS == 3:
                low, high = _lut3_pairs(kf, t0, t1, t4, t5)
            elif KEY_TABLE > 0:
                low, high = _table4_pairs(kf, lane_table, table_stride)
            else:
                low, high = _lut4_pairs(kf, t0, t1, t2, t3, t4, t5, t6, t7)
            x = gl.permute(gl.join(low, high), (0, 1, 3, 2))  # [64, m, r2, b]
            x = gl.permute(gl.reshape(x, [BLOCK, 4, KT, 2, 2]), (0, 2, 3, 1, 4))  # [64, kk, r2, t, b]
            keys = gl.convert_layout(gl.reshape(x, [BLOCK, D]), A_OP, assert_trivial=True)
            scores = mma_v2(keys, q, gl.full([BLOCK, 8], 0.0, gl.float32, layout=MMA))
            if NORM_CORRECTION:  # ||c||^2 on the tensor cores, in the scores' layout
                sumsq = mma_v2(keys * keys, ones, gl.full([BLOCK, 8], 0.0, gl.float32, layout=MMA))
                scores = scores * (knorm[:, None] / gl.sqrt(sumsq + 1e-16))
            elif not KEY_FP8:  # (fp8 keys are the keys themselves, times the query's scale)
                scores = scores * knorm[:, None]
            scores = gl.where(valid[:, None], scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, axis=0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(scores - m_new[None, :])
            m_i = m_new
            ps = (p * vscale[:, None]).to(gl.float16)
            l_acc = l_acc * alpha[None, :] + p
            z_acc = z_acc * alpha[None, :] + p * vzero[:, None]

            # ---- values: acc^T [D, 8] += V^T . (P * scale)^T, codes as fp16 f code * 2^-24
            v0, v1, v2, v3 = _value_pairs(vf)
            y = gl.join(gl.join(v0, v1), gl.join(v2, v3))  # [64, word, r1, i // 2]
            y = gl.reshape(y, [BLOCK, 4, 8, VJ, 2, 2])  # [pos, w, l // 4, j, r1, i // 2]
            y = gl.reshape(gl.permute(y, (3, 5, 1, 4, 2, 0)), [D, BLOCK])  # [j, i // 2, w, r1, l // 4, pos]
            values = gl.convert_layout(y, A_OP, assert_trivial=True)
            # the tile's P.V from zero, added in fp32 (decode_stream's kernel says why; Gluon's pipeline
            # has no pass that folds the add back into the mma's accumulator, as Triton's combine does)
            acc = acc * alpha[None, :] + mma_v2(values, gl.convert_layout(ps, B_OP), zeros)
            if PREFETCH == 2:
                kw, vw, fields = kw_next, vw_next, fields_next
            if PREFETCH >= 1:
                kb, vb = kb_next, vb_next

        l_i = gl.sum(l_acc, axis=0)
        inv = 1.0 / l_i
        zsum = gl.sum(z_acc, axis=0)
        sv = gl.load(value_order_ptr + gl.arange(0, D, layout=ROWS))
        f = gl.where((sv & 1) == 1, 1.0 / 16.0, 1.0)  # high nibbles came out as 16 x code
        out = acc * ((f * 16777216.0)[:, None] * inv[None, :]) + (zsum * inv)[None, :]  # 2^24: the codes' unit
        gl.store(part_out_ptr + part[None, :] * D + sv[:, None], out, mask=head_ok[None, :])
        gl.store(part_lse_ptr + part, m_i + gl.log2(l_i), mask=head_ok)


def loop_settings(preset: Preset, prefetch: int | None = None, stage: int | None = None) -> tuple[int, int]:
    """The (PREFETCH, STAGE) a launch runs for ``preset``: the defaults (:func:`default_prefetch`,
    :func:`default_stage`) where none is named, refused outside their choices, so that the register cap
    (:func:`maxnreg`) and the split count the launcher derives from PREFETCH are the kernel's."""
    prefetch = default_prefetch(preset) if prefetch is None else int(prefetch)
    stage = default_stage(preset) if stage is None else stage
    if prefetch not in PREFETCHES:
        raise ValueError(f"prefetch: expected {_listed(PREFETCHES)}, got {prefetch!r}")
    if stage not in STAGES:
        raise ValueError(f"stage: expected {_listed(STAGES)}, got {stage!r}")
    return prefetch, stage


def launch(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           query_start_loc: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, preset: Preset,
           group: int, splits: int, search_steps: int, prefetch: int | None = None, stage: int | None = None,
           regs: int | None = None, key_table: int | None = None, plan: tuple[int, int] | None = None) -> None:
    """Fill ``part_out`` / ``part_lse`` (the stream kernel's partials) from ``q`` (prepare_query's query, fp32
    [T, Hq, D], its last stride 1). ``prefetch``: the kernel's PREFETCH (0 none, 1 block ids a tile ahead, 2 also
    the words; default :func:`default_prefetch`); ``stage``: the kernel's STAGE (0: each thread loads its
    fragments' words, 1 / 2: a warp loads a position's words together, then they move through shared memory as
    16- / 32-bit words; default :func:`default_stage`); ``regs``: the register cap (default :func:`maxnreg`); ``key_table``: 4-bit
    keys looked up by byte permutes (0) or from a table of pairs in shared memory with that many copies (8 or
    32; default :func:`default_key_table`); ``plan``: (resident programs, the ~4-an-SM cap) for length-aware
    splits (each row's count from the batch's lengths, at most ``splits``: ``launch_choices.row_splits``); None:
    every row into ``splits``."""
    prefetch, stage = loop_settings(preset, prefetch, stage)
    copies = default_key_table(preset, q.device) if key_table is None else int(key_table)
    if copies not in KEY_TABLE_COPIES:  # (8: bank conflicts, slower than 0; for the A/B)
        raise ValueError(f"key_table: expected {_listed(KEY_TABLE_COPIES)}, got {key_table!r}")
    if not has_key_table(preset):
        copies = 0
    rows, kv_heads = q.shape[0], kv_cache.shape[2]
    max_len = block_table.shape[1] * kv_cache.shape[1]
    grid = (rows, kv_heads, splits)
    args = (q, kv_cache, block_table, seq_lens, query_start_loc,
            key_pairs(preset, q.device) if copies else key_lut(preset, q.device),
            *orders(preset.head_dim, q.device), part_out, part_lse,
            seq_lens.shape[0], max_len, *(plan or (0, 0)), q.stride(0), q.stride(1), *block_table.stride(),
            *(st // 2 for st in kv_cache.stride()[:3]))
    constexprs = dict(
        GROUP=group, D=preset.head_dim, BLOCK_SIZE=kv_cache.shape[1], NUM_SPLITS=splits, SEARCH_STEPS=search_steps,
        KEY_FP8=preset.key_fp8, NORM_CORRECTION=preset.norm_correction, KEY_CODE_BYTES=preset.key_code_bytes,
        VALUE_OFFSET=preset.key_bytes, VALUE_CODE_BYTES=preset.value_code_bytes, PREFETCH=prefetch, STAGE=stage,
        H_POS=kv_cache.stride(1) // 2 if stage else 0, KEY_BITS=0 if preset.key_fp8 else preset.key_bits,
        VALUE_BITS=preset.value_bits, KEY_TABLE=copies, LENGTH_AWARE=plan is not None, **layouts(preset.head_dim),
        num_warps=NUM_WARPS, maxnreg=regs or maxnreg(preset.head_dim, prefetch))
    if copies:
        # the key table's shared memory beyond Triton's allocation: the compiled kernel Triton's binder picks for
        # these arguments (compiled the first time), its launch grown once; the launch below finds the same one,
        # so no ungrown kernel is ever launched. (A second pass of the binder a launch: CPU time outside CUDA
        # graphs only; launching the returned kernel directly would save it, not yet run on a GPU.)
        reserve_shared(fragment_kernel.warmup(*args, grid=grid, **constexprs), table_bytes(copies))
    fragment_kernel[grid](*args, **constexprs)
