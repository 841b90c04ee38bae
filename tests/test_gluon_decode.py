"""The fragment kernel (lowerings/gluon_decode.py) on a machine without a GPU: Gluon has no interpreter, so what
can be checked here is checked here: its inline PTX on every input (emulated), its coordinate orders, that it
compiles for Hopper with every conversion into an mma operand a no-op (``assert_trivial``) and no tile through
shared memory, and that the launcher picks it only where it may. Its numbers are checked on a GPU by ``tqkv bench
kernels --check`` (``TQKV_FRAGMENT_KERNEL=1`` to take it for every case it serves)."""


from __future__ import annotations


import numpy as np
import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from test_asm_emulation import asm_text, execute  # noqa: E402

import tqkv_compile  # noqa: E402
from tqkv_compile.lowerings import cache_tables, gluon_decode, launch_choices, triton_attention  # noqa: E402


def _emulate(fn, inputs: dict[str, np.ndarray], shared: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Run the inline PTX of a Gluon function on uint32 arrays given by operand name (test_asm_emulation's
    interpreter); every register it writes, operands included. First: its constraint string declares every
    operand the asm names (with pack=2 each input is passed twice; a short string compiles with one Triton and
    aborts another)."""
    import inspect
    import re

    source = inspect.getsource(getattr(fn, "fn", fn))
    constraints = re.search(r'\}""",\s*"([^"]+)"', source).group(1).split(",")
    used = max(int(n) for n in re.findall(r"\$(\d+)", asm_text(fn)))
    assert used < len(constraints), (fn, used, constraints)
    return execute(asm_text(fn), {k: np.asarray(v).astype(np.uint32) for k, v in inputs.items()}, shared)


def _halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A 32-bit register holding an fp16 pair (pack=2: element 0 low) -> (element 0, element 1) as fp16."""
    return (x & 0xFFFF).astype(np.uint16).view(np.float16), (x >> 16).astype(np.uint16).view(np.float16)


def test_key_lookup_gives_each_words_fp16_pairs_in_place():
    """_lut4_pairs: a word's four codes -> (table[c0], table[c1]) in $0 and (table[c2], table[c3]) in $1, for
    every 16-bit word, with garbage in the word's high half (the loads are zero-extended, but nothing may
    depend on it). Operands as pack=2 numbers them: $2 / $3 the word's two copies, $4 / $5 table word 0, ..."""
    preset = tqkv_compile.get_preset("turboquant_4bit_nc", 128)
    table_words = cache_tables.key_lut(preset, torch.device("cpu")).tolist()
    words = np.arange(1 << 16, dtype=np.uint32) | (np.uint32(0xA5C3) << 16)
    inputs = {"$2": words, "$3": words}
    inputs.update({f"${4 + 2 * i}": np.full_like(words, t & 0xFFFFFFFF) for i, t in enumerate(table_words)})
    regs = _emulate(gluon_decode._lut4_pairs, inputs)
    table = preset.centroids("cpu").to(torch.float16).numpy()
    codes = [(words >> (4 * k)) & 0xF for k in range(4)]
    for out, (a, b) in (("$0", (0, 1)), ("$1", (2, 3))):
        lo, hi = _halves(regs[out])
        np.testing.assert_array_equal(lo, table[codes[a]])
        np.testing.assert_array_equal(hi, table[codes[b]])


@pytest.mark.parametrize("copies", [8, 32])
def test_key_table_lookup_reads_each_words_pairs_from_the_lanes_copy(copies):
    """KEY_TABLE: the table the kernel fills (:func:`_fill_key_table`: word e x copies + c of the table holds
    entry e of key_pairs) at the base :func:`_table_base` computes (the last bytes of the dynamic shared memory),
    each lane's base (:func:`_table_lane_base`), and :func:`_table4_pairs` on every 16-bit word (garbage in the
    high half) from every lane: (table[c0], table[c1]) in $0, (table[c2], table[c3]) in $1, what the byte-permute
    lookup gives; and the 32 lanes of a warp read distinct banks with 32 copies (8: at most 4 lanes a bank)."""
    preset = tqkv_compile.get_preset("turboquant_4bit_nc", 128)
    pairs = gluon_decode.key_pairs(preset, torch.device("cpu")).numpy().astype(np.uint32)
    nbytes = gluon_decode.table_bytes(copies)
    # 5 KB of Triton's own, then the table; global_smem at shared-window address 1024
    smem, dynamic = 1024, 5120 + nbytes
    one = np.zeros(1, dtype=np.uint32)
    base = _emulate(gluon_decode._table_base, {"$1": one + nbytes, "global_smem": one + smem,
                                               "%dynamic_smem_size": one + dynamic})["$0"][0]
    assert base == smem + 5120
    shared = np.zeros((smem + dynamic) // 4, dtype=np.uint32)
    i = np.arange(256 * copies)
    shared[(base + 4 * i) // 4] = pairs[i // copies]  # _fill_key_table's stores
    lanes = np.arange(32, dtype=np.uint32)
    lane_base = _emulate(gluon_decode._table_lane_base, {"$1": base + 0 * lanes, "$2": lanes * 0 + copies - 1,
                                                         "%laneid": lanes})["$0"]
    table = preset.centroids("cpu").to(torch.float16).numpy()
    words = np.arange(1 << 16, dtype=np.uint32) | (np.uint32(0x5A3C) << 16)
    codes = [(words >> (4 * k)) & 0xF for k in range(4)]
    for lane in (0, 5, 31):
        regs = _emulate(gluon_decode._table4_pairs, {"$2": words, "$3": words, "$4": words * 0 + lane_base[lane],
                                                     "$5": words * 0 + lane_base[lane], "$6": words * 0 + 4 * copies,
                                                     "$7": words * 0 + 4 * copies}, shared)
        for out, (a, b) in (("$0", (0, 1)), ("$1", (2, 3))):
            lo, hi = _halves(regs[out])
            np.testing.assert_array_equal(lo, table[codes[a]])
            np.testing.assert_array_equal(hi, table[codes[b]])
    # a warp's lanes, each with its own word: banks of the first pair's address
    rng = np.random.default_rng(1)
    warp_words = rng.integers(0, 1 << 16, size=(1000, 32)).astype(np.uint32)
    regs = _emulate(gluon_decode._table4_pairs, {"$2": warp_words, "$3": warp_words,
                                                 "$4": np.broadcast_to(lane_base, warp_words.shape),
                                                 "$5": np.broadcast_to(lane_base, warp_words.shape),
                                                 "$6": warp_words * 0 + 4 * copies, "$7": warp_words * 0 + 4 * copies},
                    shared)
    banks = (regs["a0"] // 4) % 32
    worst = max(np.bincount(row, minlength=32).max() for row in banks)
    assert worst == 1 if copies == 32 else worst <= 4, worst


def test_value_unpacking_pairs_two_positions_codes_as_f_code_subnormals():
    """_value_pairs: the words of positions p ($4) and p + 1 ($5) -> output i holds nibble i of both (p low),
    as fp16 code * 2^-24 (i even) or 16 code * 2^-24 (i odd), exact, with no offset to cancel later; over 2^16
    words each side, shuffled."""
    rng = np.random.default_rng(0)
    first = np.arange(1 << 16, dtype=np.uint32)
    second = rng.permutation(first)
    regs = _emulate(gluon_decode._value_pairs, {"$4": first | (np.uint32(0x5A5A) << 16), "$5": second})
    for i in range(4):
        f = 16 if i % 2 else 1
        lo, hi = _halves(regs[f"${i}"])
        np.testing.assert_array_equal(lo.astype(np.float64), f * ((first >> (4 * i)) & 0xF) * 2.0**-24)
        np.testing.assert_array_equal(hi.astype(np.float64), f * ((second >> (4 * i)) & 0xF) * 2.0**-24)


@pytest.mark.parametrize("dim", [128, 256])
def test_coordinate_orders_are_permutations_with_the_fragments_structure(dim):
    """key_order / value_order (the kernel's join / permute / reshape chain run on indices) are permutations of
    the coordinates, and they put each thread's codes where its mma fragments are: key column c = 16 kk + 8 r2
    + 2 t + b is coordinate 4 KT t + 4 kk + 2 r2 + b (thread t's codes of a row are one run of KT words), and
    value row rd = 64 rep + 16 w + 8 r1 + g is nibble r1 + 2 (rep % 2) of word J (8 w + g) + rep // 2."""
    keys, values = gluon_decode.key_order(dim).long(), gluon_decode.value_order(dim).long()
    assert sorted(keys.tolist()) == list(range(dim)) and sorted(values.tolist()) == list(range(dim))
    c, kt = torch.arange(dim), dim // 16
    assert torch.equal(keys, 4 * kt * ((c >> 1) & 3) + 4 * (c >> 4) + 2 * ((c >> 3) & 1) + (c & 1))
    rd, vj = torch.arange(dim), dim // 128
    rep, w, r1, g = rd >> 6, (rd >> 4) & 3, (rd >> 3) & 1, rd & 7
    assert torch.equal(values, 4 * (vj * (8 * w + g) + (rep >> 1)) + r1 + 2 * (rep & 1))
    # thread t of a quad reads a contiguous run of words: its columns' coordinates span 4 KT consecutive ones
    for t in range(4):
        cols = [cc for cc in range(dim) if (cc >> 1) & 3 == t]
        assert sorted(keys[cols].tolist()) == list(range(4 * kt * t, 4 * kt * (t + 1)))


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import tqkv_compile
from tqkv_compile.lowerings import gluon_decode

results = []
for name, dim, prefetch, stage, *table in json.loads(sys.argv[1]):
    p = tqkv_compile.get_preset(name, dim)
    constexprs = dict(GROUP=4, D=dim, BLOCK_SIZE=16, NUM_SPLITS=8, SEARCH_STEPS=7, KEY_FP8=p.key_fp8,
                      NORM_CORRECTION=p.norm_correction, PREFETCH=prefetch, STAGE=stage, KEY_TABLE=sum(table),
                      LENGTH_AWARE=True,
                      H_POS=8 * p.slot_bytes // 2 if stage else 0, KEY_BITS=0 if p.key_fp8 else p.key_bits,
                      VALUE_BITS=p.value_bits,
                      KEY_CODE_BYTES=p.key_code_bytes, VALUE_OFFSET=p.key_bytes, VALUE_CODE_BYTES=p.value_code_bytes,
                      **gluon_decode.layouts(dim))
    fn = gluon_decode.fragment_kernel
    pointers = {n: "*i32" for n in fn.arg_names if n.endswith("_ptr")}
    pointers.update(q_ptr="*fp32", cache_ptr="*u8", part_out_ptr="*fp32", part_lse_ptr="*fp32")
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    kernel = triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=gluon_decode.NUM_WARPS,
                                         maxnreg=gluon_decode.maxnreg(dim, prefetch)))
    ptx = kernel.asm["ptx"]
    shared = kernel.metadata.shared
    if table:  # the launcher's step: the table's bytes beyond Triton's allocation, in the launch's metadata
        gluon_decode.reserve_shared(kernel, gluon_decode.table_bytes(table[0]))
        gluon_decode.reserve_shared(kernel, gluon_decode.table_bytes(table[0]))  # (idempotent)
    results.append(dict(name=name, dim=dim, prefetch=prefetch, stage=stage, table=sum(table),
                        norm_correction=p.norm_correction,
                        shared=shared, launch_shared=kernel.packed_metadata[2], mma=ptx.count("mma.sync.aligned.m16n8k16"),
                        loads=ptx.count("ld.global"), cp_async=ptx.count("cp.async.ca.shared.global"),
                        table_loads=ptx.count("ld.shared.b32"),
                        dynamic_size=ptx.count("%dynamic_smem_size")))
print("RESULTS " + json.dumps(results))
"""


def test_fragment_kernel_compiles_for_hopper_with_no_tile_through_shared_memory():
    """Compiled for sm_90a (no GPU needed; in a process of its own, without the suite's TRITON_INTERPRET): every
    convert_layout into an mma operand is asserted trivial in the kernel, so compiling is the check that the
    loaded codes are the fragments; the shared memory left is P's exchange between warps and the max's reduction
    (1 KB; the stream kernel's tiles take 19 KB), plus, at STAGE 1 / 2, the words' move into the fragments'
    layout. The loops with PREFETCH and STAGE compile too."""
    import json
    import os
    import subprocess
    import sys

    cases = [["tqkv_4bit_pc", 128, 0, 0], ["turboquant_4bit_nc", 128, 0, 0], ["turboquant_4bit_nc", 256, 0, 0],
             ["turboquant_k8v4", 128, 0, 0], ["turboquant_4bit_nc", 128, 2, 0], ["turboquant_k8v4", 128, 2, 0],
             ["turboquant_4bit_nc", 128, 0, 1], ["turboquant_4bit_nc", 256, 2, 2], ["turboquant_k8v4", 128, 2, 2],
             ["turboquant_k3v4_nc", 128, 0, 2], ["turboquant_3bit_nc", 128, 0, 1], ["turboquant_3bit_nc", 256, 2, 2],
             ["turboquant_4bit_nc", 128, 2, 1, 32], ["tqkv_4bit_pc", 128, 2, 1, 8], ["turboquant_4bit_nc", 256, 0, 1, 32]]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", gluon_decode.MAXNREG_ENV)}
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=600)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert line is not None, done.stderr[-3000:]
    results = json.loads(line[len("RESULTS "):])
    assert [[r["name"], r["dim"], r["prefetch"], r["stage"]] + ([r["table"]] if r["table"] else []) for r in results] == cases
    for r in results:
        # KEY_TABLE: the pair table sits past Triton's allocation (found from %dynamic_smem_size), which the
        # launch grows by its bytes; two shared loads a key word of a thread (D / 4 words a row, 2 rows a thread,
        # lanes t of a quad share a row's words: KT words a row a thread)
        if r["table"]:
            assert r["launch_shared"] == -(-r["shared"] // 128) * 128 + 1024 * r["table"], r
            assert r["dynamic_size"] >= 1, r
            assert r["table_loads"] >= 2 * 2 * r["dim"] // 16, r
        else:
            assert r["launch_shared"] == r["shared"] and r["dynamic_size"] == 0, r
        # STAGE 1 / 2 move the words through shared memory on purpose: at most a tile of them (64 x D / 4 words)
        assert r["shared"] <= 2048 + (0 if r["stage"] == 0 else 64 * r["dim"]), r
        assert r["cp_async"] == 0, r  # (no copies into shared memory: the ring of STAGE 3 is gone)
        # one mma.sync a k-step of each warp's 16 key rows (twice with the norm's sum of squares), and for the
        # values D / 64 row tiles of 4 k-steps: nothing else goes through the tensor cores
        kt = r["dim"] // 16
        assert r["mma"] == kt * (2 if r["norm_correction"] else 1) + 4 * r["dim"] // 64, r
    # PREFETCH 2 issues the loads of the tile ahead in the loop and those of the first tile before it: the
    # loop's loads once more than without (block ids, words, norms: the same loads, twice in the code)
    by = {(r["name"], r["dim"], r["prefetch"], r["stage"]): r["loads"] for r in results}
    for name in ("turboquant_4bit_nc", "turboquant_k8v4"):
        assert by[name, 128, 2, 0] > by[name, 128, 0, 0], by


def test_the_launcher_takes_it_only_where_it_can(monkeypatch):
    """Without a GPU the fragment kernel is never picked (a reason is given); asked for by name it is refused
    with that reason; presets it does not read are refused by name; TQKV_FRAGMENT_KERNEL is auto, 0 or 1."""
    p = tqkv_compile.get_preset("turboquant_4bit_nc", 128)
    cache = torch.zeros(4, 16, 2, p.slot_bytes, dtype=torch.uint8)
    assert "CUDA" in gluon_decode.supports(p, cache, 4, torch.device("cpu"))
    assert gluon_decode.mode() == "auto" and gluon_decode.enabled()
    monkeypatch.setenv(gluon_decode.ENV, "0")
    assert not gluon_decode.enabled()
    monkeypatch.setenv(gluon_decode.ENV, "yes")
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        gluon_decode.mode()
    monkeypatch.setenv(gluon_decode.ENV, "1")
    assert gluon_decode.enabled()
    k3 = tqkv_compile.get_preset("turboquant_k3v4_nc", 128)
    meta = type("Cuda", (), {"type": "cuda"})()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    k3_cache = torch.zeros(4, 16, 2, k3.slot_bytes, dtype=torch.uint8)
    assert "STAGE 1 or 2" in gluon_decode.supports(k3, k3_cache, 4, meta, stage=0)
    assert gluon_decode.supports(k3, k3_cache, 4, meta) is None  # the default stage for 3-bit fields: 2
    assert gluon_decode.supports(k3, k3_cache, 4, meta, stage=2) is None
    b3 = tqkv_compile.get_preset("turboquant_3bit_nc", 128)
    assert gluon_decode.supports(b3, torch.zeros(4, 16, 2, b3.slot_bytes, dtype=torch.uint8), 4, meta, stage=1) is None
    assert launch_choices.fragments_preferred(k3, 64, 32768) and not launch_choices.fragments_preferred(k3, 1, 4096)
    own = tqkv_compile.get_preset("tqkv_k4o1v225", 128)
    assert "vLLM's layouts" in gluon_decode.supports(own, torch.zeros(4, 16, 2, own.slot_bytes, dtype=torch.uint8),
                                                     4, meta, stage=2)
    k8 = tqkv_compile.get_preset("turboquant_k8v4", 128)
    assert gluon_decode.supports(k8, torch.zeros(4, 16, 2, k8.slot_bytes, dtype=torch.uint8), 4, meta) is None
    misaligned = torch.zeros(4, 16, 2, k8.slot_bytes + 2, dtype=torch.uint8)[..., : k8.slot_bytes]
    assert "4-byte" in gluon_decode.supports(k8, misaligned, 4, meta)
    assert "head size 64" in gluon_decode.supports(tqkv_compile.get_preset("turboquant_4bit_nc", 64), cache, 4, meta)
    assert "group of 16" in gluon_decode.supports(p, cache, 16, meta)
    assert "multiple of 16" in gluon_decode.supports(p, torch.zeros(4, 8, 2, p.slot_bytes, dtype=torch.uint8), 4, meta)
    assert gluon_decode.supports(p, cache, 4, meta) is None
    assert gluon_decode.wanted(p, cache, 4, 64, 4096, meta) and not gluon_decode.wanted(p, cache, 4, 64, 4096,
                                                                                         torch.device("cpu"))
    monkeypatch.setenv(gluon_decode.ENV, "auto")
    assert not gluon_decode.wanted(p, cache, 4, 1, 4096, meta)  # where the stream kernel measured faster
    monkeypatch.setenv(gluon_decode.ENV, "0")
    assert not gluon_decode.wanted(p, cache, 4, 64, 4096, meta)
    monkeypatch.setenv(gluon_decode.ENV, "1")
    huge = torch.empty(300_000, 16, 8, p.slot_bytes, dtype=torch.uint8, device="meta")  # 4.8 GB: past int32
    assert "2^31" in gluon_decode.supports(p, huge, 4, meta)
    q = torch.zeros(1, 8, 128)
    with pytest.raises(ValueError, match="fragments.*CUDA"):
        triton_attention.decode_attention(q, cache, torch.zeros(1, 4, dtype=torch.int32),
                                          torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                                          0.1, p, torch.eye(128), torch.zeros(16), kernel="fragments")


def test_it_is_preferred_where_the_h200_measured_it_faster():
    """The default's rule, against the measurements it came from (gluon_decode.preferred's docstring)."""
    nc, k8 = tqkv_compile.get_preset("turboquant_4bit_nc", 128), tqkv_compile.get_preset("turboquant_k8v4", 128)
    assert launch_choices.fragments_preferred(nc, 64, 32768) and launch_choices.fragments_preferred(nc, 1, 32768)
    assert launch_choices.fragments_preferred(nc, 16, 8192) and not launch_choices.fragments_preferred(nc, 1, 4096)
    assert launch_choices.fragments_preferred(k8, 64, 4096) and launch_choices.fragments_preferred(k8, 16, 8192)
    assert launch_choices.fragments_preferred(k8, 1, 32768) and not launch_choices.fragments_preferred(k8, 1, 4096)
    assert not launch_choices.fragments_preferred(k8, 8, 4096)


def test_prefetch_and_stage_settings_and_the_register_cap(monkeypatch):
    """TQKV_FRAGMENT_PREFETCH and TQKV_FRAGMENT_STAGE pick the loop (by default PREFETCH 2, 1 for fp8 keys, 0 at
    head 256; STAGE 1, 2 for 3-bit fields: timed); prefetch 2 holds the next tile's words in registers, so its cap is raised (no spills at 150 / 222 registers with
    triton 3.6: bench/ptx_stats.py --kernel fragments --fragment-prefetch 2); anything else is refused, by the
    launcher too."""
    monkeypatch.delenv(gluon_decode.PREFETCH_ENV, raising=False)
    monkeypatch.delenv(gluon_decode.MAXNREG_ENV, raising=False)
    get = tqkv_compile.get_preset
    assert gluon_decode.default_prefetch() == 2 and gluon_decode.default_prefetch(get("turboquant_4bit_nc", 128)) == 2
    assert gluon_decode.default_prefetch(get("turboquant_k8v4", 128)) == 1  # (PREFETCH 2 lost for fp8 keys)
    assert gluon_decode.default_prefetch(get("turboquant_4bit_nc", 256)) == 0  # (untimed at 256)
    assert gluon_decode.loop_settings(get("turboquant_4bit_nc", 128)) == (2, 1)
    assert gluon_decode.loop_settings(get("turboquant_3bit_nc", 128)) == (2, 2)
    monkeypatch.setenv(gluon_decode.PREFETCH_ENV, "0")
    assert gluon_decode.default_prefetch(get("turboquant_k8v4", 128)) == 0
    monkeypatch.setenv(gluon_decode.PREFETCH_ENV, "2")
    assert gluon_decode.default_prefetch() == 2
    monkeypatch.setenv(gluon_decode.PREFETCH_ENV, "yes")
    with pytest.raises(ValueError, match="0, 1 or 2"):
        gluon_decode.default_prefetch()
    assert [gluon_decode.maxnreg(d, 0) for d in (128, 256)] == [128, 168]
    assert [gluon_decode.maxnreg(d, 2) for d in (128, 256)] == [168, 255]
    assert launch_choices.programs_per_sm(gluon_decode.maxnreg(128, 2), gluon_decode.NUM_WARPS) == 3
    # TQKV_FRAGMENT_MAXNREG: one cap for every launch at head 128 (the A/B of 128 at PREFETCH 2), and the
    # occupancy with it; head 256 keeps its caps (128 spills there)
    monkeypatch.setenv(gluon_decode.MAXNREG_ENV, "128")
    assert [gluon_decode.maxnreg(d, f) for d in (128, 256) for f in (0, 2)] == [128, 128, 168, 255]
    assert launch_choices.programs_per_sm(gluon_decode.maxnreg(128, 2), gluon_decode.NUM_WARPS) == 4
    for bad in ("32", "256", "many", ""):
        monkeypatch.setenv(gluon_decode.MAXNREG_ENV, bad)
        with pytest.raises(ValueError, match="64 to 255"):
            gluon_decode.maxnreg(128, 2)
    monkeypatch.delenv(gluon_decode.MAXNREG_ENV)
    p = tqkv_compile.get_preset("turboquant_4bit_nc", 128)
    monkeypatch.delenv(gluon_decode.STAGE_ENV, raising=False)
    assert gluon_decode.default_stage() == 1 and gluon_decode.default_stage(p) == 1
    assert gluon_decode.default_stage(tqkv_compile.get_preset("turboquant_k3v4_nc", 128)) == 2  # (checked there)
    monkeypatch.setenv(gluon_decode.STAGE_ENV, "1")
    assert gluon_decode.default_stage(tqkv_compile.get_preset("turboquant_3bit_nc", 128)) == 1
    monkeypatch.setenv(gluon_decode.STAGE_ENV, "4")
    with pytest.raises(ValueError, match="0, 1 or 2"):
        gluon_decode.default_stage()
    monkeypatch.delenv(gluon_decode.STAGE_ENV)
    args = (torch.zeros(1, 4, 128), torch.zeros(4, 16, 1, p.slot_bytes, dtype=torch.uint8),
            torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.zeros(1, 4, 1, 128), torch.zeros(1, 4, 1), p, 4, 1, 1)
    with pytest.raises(ValueError, match="prefetch: expected 0, 1 or 2"):
        gluon_decode.launch(*args, prefetch=3)
    # the loop a launch runs, as the launcher sizes it (its register cap)
    assert gluon_decode.loop_settings(p, 2, 2) == (2, 2) and gluon_decode.loop_settings(p, True, 1) == (1, 1)
    monkeypatch.delenv(gluon_decode.PREFETCH_ENV)
    assert gluon_decode.loop_settings(p) == (2, 1)
    with pytest.raises(ValueError, match="stage: expected 0, 1 or 2"):
        gluon_decode.launch(*args, prefetch=0, stage=4)


def test_key_table_setting(monkeypatch):
    """TQKV_FRAGMENT_KEY_TABLE: 32 copies by default for 4-bit keys on the Tritons whose launches can grow (3.6-3.9),
    except on GPUs other than Hopper (timed on an H100 only); none for fp8 and 3-bit keys (nothing
    to look up in it); 0 turns it off, anything else is refused, by the launcher too (its keyword)."""
    import triton

    get = tqkv_compile.get_preset
    monkeypatch.delenv(gluon_decode.KEY_TABLE_ENV, raising=False)
    growable = (3, 6) <= tuple(int(x) for x in triton.__version__.split(".")[:2]) <= (3, 9)
    assert gluon_decode.default_key_table(get("turboquant_4bit_nc", 128)) == (32 if growable else 0)
    assert gluon_decode.default_key_table(get("tqkv_4bit_pc", 256)) == (32 if growable else 0)
    assert gluon_decode.default_key_table(get("turboquant_k8v4", 128)) == 0
    assert gluon_decode.default_key_table(get("turboquant_k3v4_nc", 128)) == 0
    assert gluon_decode.default_key_table(get("turboquant_4bit_nc", 128),
                                          device=torch.device("cpu")) == (32 if growable else 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # (an A100: untimed)
    assert gluon_decode.default_key_table(get("turboquant_4bit_nc", 128), device=torch.device("cuda")) == 0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert gluon_decode.default_key_table(get("turboquant_4bit_nc", 128),
                                          device=torch.device("cuda")) == (32 if growable else 0)
    monkeypatch.setenv(gluon_decode.KEY_TABLE_ENV, "0")
    assert gluon_decode.default_key_table(get("turboquant_4bit_nc", 128)) == 0
    monkeypatch.setenv(gluon_decode.KEY_TABLE_ENV, "32")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert gluon_decode.default_key_table(get("turboquant_4bit_nc", 128), device=torch.device("cuda")) == 32  # (asked for)
    monkeypatch.setenv(gluon_decode.KEY_TABLE_ENV, "16")
    with pytest.raises(ValueError, match="TQKV_FRAGMENT_KEY_TABLE"):
        gluon_decode.default_key_table(get("turboquant_4bit_nc", 128))
    monkeypatch.delenv(gluon_decode.KEY_TABLE_ENV)
    p = get("turboquant_4bit_nc", 128)
    args = (torch.zeros(1, 4, 128), torch.zeros(4, 16, 1, p.slot_bytes, dtype=torch.uint8),
            torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.zeros(1, 4, 1, 128), torch.zeros(1, 4, 1), p, 4, 1, 1)
    with pytest.raises(ValueError, match="key_table: expected 0, 32 or 8"):
        gluon_decode.launch(*args, key_table=16)
    assert gluon_decode.table_bytes(32) == 32 * 1024


def test_field_columns_come_apart_as_the_kernel_reads_them():
    """STAGE 1 / 2 load a position's fields as one [64, 4] tile with columns (norm, zero, scale, zero), and
    _fields takes them apart by reshape [64, 2, 2], split, split (STAGE 0 joins them into that shape). Triton's
    reshape and split semantics are Gluon's: the same chain here, interpreted, on column indices, must give
    (norm, scale) from the first half and (zero, zero) from the second."""
    import triton
    import triton.language as tl

    @triton.jit
    def chain(src, out):
        rows = tl.arange(0, 64)
        tile = tl.load(src + rows[:, None] * 4 + tl.arange(0, 4)[None, :])
        first, second = tl.split(tl.reshape(tile, [64, 2, 2]))
        norm, scale = tl.split(first)
        zero, again = tl.split(second)
        tl.store(out + rows, norm)
        tl.store(out + 64 + rows, scale)
        tl.store(out + 128 + rows, zero)
        tl.store(out + 192 + rows, again)

    columns = {"norm": 0, "zero": 1, "scale": 2}  # the kernel's `at`: fc == 0 norm, fc == 2 scale, else zero
    src = (torch.arange(64)[:, None] * 100 + torch.arange(4)[None, :]).to(torch.int32)
    out = torch.empty(4, 64, dtype=torch.int32)
    chain[(1,)](src, out)
    rows = torch.arange(64, dtype=torch.int32) * 100
    assert torch.equal(out[0] - rows, torch.full((64,), columns["norm"], dtype=torch.int32))
    assert torch.equal(out[1] - rows, torch.full((64,), columns["scale"], dtype=torch.int32))
    assert torch.equal(out[2] - rows, torch.full((64,), columns["zero"], dtype=torch.int32))
    assert torch.equal(out[3] - rows, torch.full((64,), 3, dtype=torch.int32))  # the fourth column: zero again


def test_three_bit_codes_spread_into_the_four_bit_words():
    """_spread3x8 (STAGE 1 / 2, 3-bit fields): eight 3-bit codes at bit 3 i of a 24-bit run -> nibble i of $0
    (codes 0-3 in its low half, which is what the lookups read), and codes 4-7 in $1's low half, bit 3 of every
    nibble clear, whatever the bits above 23 hold; the codes as codec.pack_codes lays them out, 2^20 random runs."""
    from tqkv_compile import codec

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 8, size=(1 << 20, 8))
    packed = codec.pack_codes(torch.from_numpy(codes), 3).numpy().astype(np.uint32)  # [n, 3] bytes
    garbage = rng.integers(0, 256, 1 << 20, dtype=np.uint32) << 24
    runs = packed[:, 0] | (packed[:, 1] << 8) | (packed[:, 2] << 16) | garbage
    regs = _emulate(gluon_decode._spread3x8, {"$2": runs})
    assert not (regs["$1"] >> 16).any()
    for i in range(8):
        np.testing.assert_array_equal((regs["$0"] >> (4 * i)) & 0xF, codes[:, i])
    for i in range(4):
        np.testing.assert_array_equal((regs["$1"] >> (4 * i)) & 0xF, codes[:, 4 + i])


def test_three_bit_lookup_gives_each_words_fp16_pairs():
    """_lut3_pairs: a word of four 3-bit codes (nibbles, bit 3 clear) -> (table[c0], table[c1]) in $0 and
    (table[c2], table[c3]) in $1 from the key table's low half; the word's high half is ignored."""
    preset = tqkv_compile.get_preset("turboquant_k3v4_nc", 128)
    table_words = cache_tables.key_lut(preset, torch.device("cpu")).tolist()
    words = (np.arange(1 << 16, dtype=np.uint32) & 0x7777) | (np.uint32(0xA5C3) << 16)
    inputs = {"$2": words, "$3": words}
    for operand, index in (("$4", 0), ("$6", 1), ("$8", 4), ("$10", 5)):  # pack=2: each table word twice
        inputs[operand] = inputs[f"${int(operand[1:]) + 1}"] = np.full_like(words, table_words[index] & 0xFFFFFFFF)
    regs = _emulate(gluon_decode._lut3_pairs, inputs)
    table = preset.centroids("cpu").to(torch.float16).numpy()
    assert table.shape == (8,)
    codes = [(words >> (4 * k)) & 0x7 for k in range(4)]
    for out, (a, b) in (("$0", (0, 1)), ("$1", (2, 3))):
        lo, hi = _halves(regs[out])
        np.testing.assert_array_equal(lo, table[codes[a]])
        np.testing.assert_array_equal(hi, table[codes[b]])


def test_stage3_is_gone(monkeypatch):
    """STAGE 3 (a ring of cp.async copies; checked on an H100, 0.89x STAGE 1 there) was deleted on 2026-12-05:
    the setting, supports() and the launcher refuse it with the choices left."""
    p = tqkv_compile.get_preset("turboquant_4bit_nc", 128)
    with pytest.raises(ValueError, match="stage: expected 0, 1 or 2"):
        gluon_decode.loop_settings(p, 2, 3)
    meta = type("Cuda", (), {"type": "cuda"})()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cache = torch.zeros(4, 16, 2, p.slot_bytes, dtype=torch.uint8)
    assert gluon_decode.supports(p, cache, 4, meta, stage=1) is None
    assert "STAGE 0, 1 and 2" in gluon_decode.supports(p, cache, 4, meta, stage=3)
    monkeypatch.setenv(gluon_decode.STAGE_ENV, "3")
    with pytest.raises(ValueError, match="0, 1 or 2"):
        gluon_decode.default_stage(p)
