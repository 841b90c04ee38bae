"""The native CPU decode attention (``csrc/cpu_decode.cpp``): the PyTorch backend's decode rows on CPU tensors.

It reads the packed slots straight from the paged cache (no decoded copy of the context): per (sequence, kv
head) task it decodes each slot once (centroid lookups from a vector register, fp8 bytes, value codes) for
every query row and head of the GQA group and keeps an fp32 online softmax, tasks spread over the intra-op
threads (``at::parallel_for``). AVX-512 for vLLM's slot layouts and AVX2 + FMA + F16C for every layout where
the CPU has them (chosen at run time), portable C++ otherwise. A second op encodes a decode step's few tokens
for ``kv_write`` (:func:`kv_write`).

Built on first use with ``torch.utils.cpp_extension.load`` into torch's extensions directory (a name that
hashes the source, so an edited source builds anew and a built one loads in well under a second), the build
time said once on stderr. Where no compiler works, one line says so and the PyTorch path
(``ReferenceBackend.attention``) serves; ``TQKV_CPU_KERNEL=0`` forces that path.

Its decode serves every preset of codec.py at head sizes 64, 128 and 256 (:func:`supports_preset`): vLLM's slot
layouts (``Preset.vllm_layout``) through code specialised by key and value width, the others (5-bit keys, key
outlier channels, Lloyd-Max values with wide coordinates: ``tqkv_k5v3``, ``tqkv_k4o1v225``) through a path that
decodes any field widths. Its encode (:func:`kv_write`) writes every one of those layouts too.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch

from tqkv_compile import env, lloyd_max
from tqkv_compile.codec import Preset

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_decode.cpp"
BUILD_SECONDS = 20  # the estimate the build message gives (measured 14-20 s on a 2-core EPYC VM)

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet in this process


#: -fopenmp: at::parallel_for is OpenMP pragmas in torch's headers (without it, one thread); no -lgomp at the link:
#: the GOMP symbols resolve to the OpenMP runtime torch loaded, not a second one
CFLAGS = ["-O3", "-std=c++17", "-fno-math-errno", "-fopenmp"]


def extension_name() -> str:
    """The extension's name: a hash of the source, the flags and torch's version (torch's build cache keys on the
    name)."""
    digest = hashlib.sha1(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + torch.__version__.encode())
    return f"tqkv_cpu_decode_{digest.hexdigest()[:12]}"


def enabled() -> bool:
    """``TQKV_CPU_KERNEL`` is not ``0`` (read at every call: tests switch it)."""
    return env.get("TQKV_CPU_KERNEL", "1") not in ("0", "false", "False", "")


def load() -> bool:
    """Build (first use) and load the kernel; False, with one line on stderr, where that fails."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build_and_load()
    return _loaded


def _registered() -> bool:
    try:
        torch.ops.tqkv_cpu.decode_attention  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def _build_and_load() -> bool:
    if _registered():
        return True
    try:
        from torch.utils import cpp_extension

        name = extension_name()
        try:
            built = (Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so").exists()
        except Exception:  # a private helper: a torch without it only loses the message's accuracy
            built = False
        if not built:
            print(f"[tqkv] building the CPU decode kernel (first use, ~{BUILD_SECONDS} s)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        cpp_extension.load(name, [str(SOURCE)], extra_cflags=CFLAGS, is_python_module=False,
                           verbose=False)
        if not built:
            print(f"[tqkv] CPU decode kernel built in {time.perf_counter() - start:.1f} s", file=sys.stderr,
                  flush=True)
        return _registered()
    except Exception as e:  # no compiler, no ninja, headers missing: the PyTorch path serves
        reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        print(f"[tqkv] CPU decode kernel unavailable ({type(e).__name__}: {reason}); decode attention takes the "
              "PyTorch path", file=sys.stderr, flush=True)
        return False


#: the widest Lloyd-Max codes (wide coordinates included) and the most key outlier channels the kernel reads:
#: its centroid tables are four vector registers of 8 entries
MAX_CODE_BITS = 5
MAX_KEY_OUTLIERS = 4


def supports_preset(preset: Preset) -> bool:
    """Head sizes 64 / 128 / 256, fp8 keys or Lloyd-Max keys of at most 5 bits (their wide coordinates' widths
    included), values of 2 to 5 bits (likewise), at most 4 key outlier channels: every preset of codec.py.
    Decided once a preset object (asked three times a layer and step)."""
    known = _supported.get(id(preset))
    if known is None or known[0] is not preset:
        known = _supported[id(preset)] = (preset, _supports(preset))
    return known[1]


#: id(preset) -> (the preset, whether the kernel reads it); the preset held so that its id is not reused
_supported: dict[int, tuple[Preset, bool]] = {}


def _supports(preset: Preset) -> bool:
    key_bits = preset.key_bits + (1 if preset.key_wide_coords else 0)
    value_bits = preset.value_bits + (1 if preset.value_wide_coords else 0)
    return (preset.head_dim in (64, 128, 256) and (preset.key_fp8 or 2 <= key_bits <= MAX_CODE_BITS)
            and 2 <= preset.value_bits and value_bits <= MAX_CODE_BITS
            and preset.key_outliers <= MAX_KEY_OUTLIERS)


def serves(preset: Preset, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether :func:`attention` serves this call: CPU tensors, a supported preset, slots contiguous in the
    cache's last dimension, the kernel enabled and built."""
    return (query.device.type == "cpu" and kv_cache.device.type == "cpu" and supports_preset(preset)
            and kv_cache.stride(3) == 1 and enabled() and load())


def has_avx2() -> bool:
    """Whether the loaded kernel takes its AVX2 + FMA path on this CPU."""
    return load() and bool(torch.ops.tqkv_cpu.has_avx2())


def has_avx512() -> bool:
    """Whether the loaded kernel takes its AVX-512 path (vLLM's slot layouts) on this CPU."""
    return load() and bool(torch.ops.tqkv_cpu.has_avx512())


#: the kernel's instruction sets, narrowest first (``attention(isa=...)``); each falls back to the one before
#: where the CPU or the slot layout has no path of it (AVX-512: vLLM's layouts; others stay on AVX2)
ISAS = ("portable", "avx2", "avx512")


def attention(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset: Preset, key=None, value=None,
              out=None, isa: str = "avx512") -> torch.Tensor:
    """``ReferenceBackend.attention``'s contract through the kernel, reading the cache (``key`` / ``value``
    are not looked at: whole prompts are routed elsewhere by ``prefill.serve``): query [T, Hq, D] (fp32 / bf16
    / fp16) -> [T, Hq, D] in the query's dtype, in ``out`` where given; rows outside
    ``query_start_loc[0] .. query_start_loc[-1]`` are zero. The kernel rotates the query and writes the
    output's dtype itself (one op call, no intermediate tensors). ``isa``: the widest instruction set to use (one of
    :data:`ISAS`; ``"portable"``: plain C++)."""
    if not load():
        raise RuntimeError("the CPU decode kernel is not available (see the [tqkv] line above)")
    q = query if query.shape[-1] <= 1 or query.stride(-1) == 1 else query.contiguous()
    into = out if out is not None and (out.shape[-1] <= 1 or out.stride(-1) == 1) else torch.empty_like(q)
    args = _launch_args(preset)
    torch.ops.tqkv_cpu.decode_attention.default(q, kv_cache, block_table, seq_lens, query_start_loc, *args.decode_tensors,
                                                into, float(scale), *args.decode_layout, ISAS.index(isa))
    if out is not None and into is not out:
        out.copy_(into)
        return out
    return into


class Tables(NamedTuple):
    """A preset's Lloyd-Max tables, fp32, contiguous and zero-padded, for its four code fields (the keys' codes,
    their wide coordinates' codes, the values' codes, their wide coordinates' codes; a field the preset lacks is
    zeros): ``decode`` [4, 32] the centroids, ``encode`` [4, 2, 64] the centroids and the midpoints."""

    decode: torch.Tensor
    encode: torch.Tensor


_tables_made: dict[tuple[str, int], Tables] = {}


def _tables(preset: Preset) -> Tables:
    """The preset's :class:`Tables`, made once a preset (keyed by name and head size: hashing the frozen Preset
    itself costs ~5 us a call)."""
    k = (preset.name, preset.head_dim)
    if k not in _tables_made:
        decode = torch.zeros(4, 32, dtype=torch.float32)
        encode = torch.zeros(4, 2, 64, dtype=torch.float32)
        dim = preset.head_dim
        fields = [] if preset.key_fp8 else [(0, preset.key_bits, True), (1, preset.key_bits + 1, preset.key_wide_coords)]
        if preset.value_lloyd_max:
            fields += [(2, preset.value_bits, True), (3, preset.value_bits + 1, preset.value_wide_coords)]
        for row, bits, present in fields:
            if present and bits <= MAX_CODE_BITS:
                decode[row, : 1 << bits] = encode[row, 0, : 1 << bits] = lloyd_max.centroids(dim, bits)
                encode[row, 1, : (1 << bits) - 1] = lloyd_max.midpoints(dim, bits)
        _tables_made[k] = Tables(decode, encode)
    return _tables_made[k]


class LaunchArgs(NamedTuple):
    """A preset's constant arguments of the two ops, in their order: ``decode_tensors`` (the centroid tables and
    the rotation H) and ``decode_layout`` (the slot layout's fields) of ``decode_attention``, ``encode`` (tables
    and fields) of ``kv_write``."""

    decode_tensors: tuple
    decode_layout: tuple
    encode: tuple


def _launch_args(preset: Preset) -> LaunchArgs:
    """The preset's :class:`LaunchArgs`, made once a preset object (read at every layer and step: a dozen
    property reads a call otherwise)."""
    known = _launch_args_made.get(id(preset))
    if known is None or known[0] is not preset:
        p, key_kind = preset, 8 if preset.key_fp8 else preset.key_bits
        made = LaunchArgs(
            (_tables(p).decode, p.rotation()),
            (key_kind, p.key_wide_coords, p.key_outliers, p.norm_correction, p.value_bits, p.value_wide_coords,
             p.value_lloyd_max, p.key_code_bytes, p.key_bytes, p.value_code_bytes, p.slot_bytes),
            (_tables(p).encode, key_kind, p.key_wide_coords, p.key_outliers, p.norm_at_write, p.value_bits,
             p.value_wide_coords, p.value_lloyd_max, p.key_code_bytes, p.key_bytes, p.value_code_bytes, p.slot_bytes))
        known = _launch_args_made[id(preset)] = (preset, made)
    return known[1]


#: id(preset) -> (the preset, its LaunchArgs); the preset held so that its id is not reused
_launch_args_made: dict[int, tuple[Preset, LaunchArgs]] = {}


def serves_write(preset: Preset, key: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether :func:`kv_write` serves this call: CPU tensors, a supported preset, the kernel on. Any number of
    tokens: the kernel's encode is faster than the PyTorch one at a prefill's too (8192 tokens x 3 kv heads:
    4-5x)."""
    return (key.device.type == "cpu" and kv_cache.device.type == "cpu" and supports_preset(preset)
            and kv_cache.stride(3) == 1 and enabled() and load())


def kv_write(key, value, kv_cache, slot_mapping, preset: Preset) -> None:
    """``ReferenceBackend.kv_write``'s contract through the kernel: key, value [T, Hk, D] (fp32 / bf16 / fp16)
    encoded into the slots ``slot_mapping`` (int [T], negative: skipped) of the cache view. The codec's bytes;
    a code may differ where a rotated coordinate lies within float rounding of a midpoint (the rotation's sums
    are fp64 here, fp32 in torch's matmul), and key outlier channels of equal magnitude may be chosen or ordered
    otherwise than torch.topk's own order among equal values (the largest first, then the lowest channel)."""
    if not supports_preset(preset):
        raise ValueError(f"{preset.name}: a slot layout the kernel does not read or write (supports_preset)")
    if not load():
        raise RuntimeError("the CPU decode kernel is not available (see the [tqkv] line above)")
    key = key if key.stride(-1) == 1 else key.contiguous()
    if value.dtype != key.dtype:
        value = value.to(key.dtype)
    value = value if value.stride(-1) == 1 else value.contiguous()
    torch.ops.tqkv_cpu.kv_write.default(key, value, kv_cache, slot_mapping, *_launch_args(preset).encode)
