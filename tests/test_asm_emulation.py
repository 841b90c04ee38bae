"""The stream kernel's inline PTX runs only on a GPU; these tests run its text here, instruction by
instruction, on every input word, with an emulation of the few PTX instructions it uses."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

triton = pytest.importorskip("triton")

from tqkv_compile.lowerings import cache_tables, device_helpers  # noqa: E402


def _prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """prmt.b32 (default mode): byte i of d is byte (c >> 4i) & 7 of {b, a}, its sign replicated if bit 3."""
    pool = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    d = np.zeros_like(a)
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = np.take_along_axis(pool, (sel & 7)[None, :].astype(np.int64), axis=0)[0]
        byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(a.dtype)
        d |= byte << (8 * i)
    return d


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """lop3.b32: bit k of d is bit (4 a_k + 2 b_k + c_k) of lut (a = 0xF0, b = 0xCC, c = 0xAA)."""
    d = np.zeros_like(a)
    for k in range(8):
        term = np.full_like(a, 0xFFFFFFFF)
        for bit, x in zip((4, 2, 1), (a, b, c)):
            term &= x if k & bit else ~x
        if lut >> k & 1:
            d |= term
    return d


def asm_text(fn) -> str:
    """The inline PTX between ``\"""{`` and ``}\"""`` in the source of a (Triton or Gluon) jit function."""
    return re.search(r'"""\{(.*?)\}"""', inspect.getsource(getattr(fn, "fn", fn)), re.S).group(1)


def execute(text: str, regs: dict[str, np.ndarray], shared: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Run inline-PTX ``text`` (and, shl, shr.u32, prmt, lop3, mov into 16-bit halves, mov.u32, add.u32,
    sub.u32, mad.lo.u32, ld.shared.b32 from ``shared``: 32-bit words, byte address / 4) on uint32 arrays given by
    operand name (all one shape; special registers and symbols, ``%laneid``, ``global_smem``, by name too);
    every register it writes, operands included, alongside the inputs."""
    regs = dict(regs)
    shape = next(iter(regs.values())).shape

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full(shape, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint32)

    for line in text.split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32":
            low_high, src = re.match(r"\{(.*?)\},\s*(\w+)", args).groups()
            low, high = (t.strip() for t in low_high.split(","))
            regs[low], regs[high] = val(src) & 0xFFFF, val(src) >> 16
            continue
        dst, *src = (t.strip() for t in args.split(","))
        if op == "ld.shared.b32":
            address = val(src[0].strip("[]"))
            assert shared is not None and np.all(address % 4 == 0), "ld.shared.b32: aligned words of `shared`"
            regs[dst] = shared[address // 4].astype(np.uint32)
            continue
        if op == "mov.u32":
            regs[dst] = val(src[0])
        elif op == "add.u32":
            regs[dst] = (val(src[0]) + val(src[1])) & 0xFFFFFFFF
        elif op == "sub.u32":
            regs[dst] = (val(src[0]) - val(src[1])) & 0xFFFFFFFF
        elif op == "mad.lo.u32":
            regs[dst] = (val(src[0]).astype(np.uint64) * val(src[1]) + val(src[2])).astype(np.uint32)
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "shl.b32":
            regs[dst] = (val(src[0]) << int(src[1], 0)) & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[dst] = val(src[0]) >> int(src[1], 0)
        elif op == "prmt.b32":
            regs[dst] = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "lop3.b32":
            regs[dst] = _lop3(val(src[0]), val(src[1]), val(src[2]), int(src[3], 0))
        else:
            raise AssertionError(f"no emulation for {op}")
    return regs


def _run_asm(fn, words: np.ndarray, tables: list[int] = ()) -> list[np.ndarray]:
    """Interpret the PTX of ``fn``'s inline asm (and, shl, prmt, lop3, mov) on uint32 ``words`` and the table
    words ``tables`` (its arguments in order, each repeated ``pack`` times as Triton numbers them, after the
    outputs); its four fp16 results in column order: from four 16-bit outputs ("=h", pack=1), or from two
    32-bit outputs each holding an fp16 pair ("=r", pack=2: low half first)."""
    source = inspect.getsource(getattr(fn, "fn", fn))
    text = asm_text(fn)
    constraints = re.search(r'"(=[^"]*)"', source).group(1).split(",")
    pack = int(re.search(r"pack=(\d)", source).group(1))
    outs = sum(c.startswith("=") for c in constraints)
    regs = {}
    for i, arg in enumerate([words, *tables]):
        value = (words if i == 0 else np.full_like(words, arg & 0xFFFFFFFF)).astype(np.uint32)
        for copy in range(pack):
            regs[f"${outs + i * pack + copy}"] = value

    regs = execute(text, regs)
    if constraints[0] == "=h":
        halves = [regs[f"${i}"] for i in range(4)]
    else:
        assert constraints[:2] == ["=r", "=r"] and pack == 2, constraints
        halves = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
    return [h.astype(np.uint16).view(np.float16) for h in halves]


def test_uniform_code_unpacking_gives_code_and_16_code_in_odd_columns_as_exact_subnormals():
    words = np.arange(1 << 16, dtype=np.uint32)
    got = _run_asm(device_helpers.codes4_fp16_odd16, words)
    for k in range(4):
        code = (words >> (4 * k)) & 0xF
        want = code * (16 if k % 2 else 1) * 2.0**-24
        np.testing.assert_array_equal(got[k].astype(np.float64), want)


def test_centroid_lookup_by_byte_permutes_gives_the_fp16_table_entries():
    """lut4_fp16 (4-bit Lloyd-Max keys): four codes -> their fp16 centroids, for every 16-bit word."""
    import torch

    from tqkv_compile.codec import get_preset

    preset = get_preset("turboquant_4bit_nc", 128)
    key_words = cache_tables.key_lut(preset, torch.device("cpu"))
    words = np.arange(1 << 16, dtype=np.uint32)
    got = _run_asm(device_helpers.lut4_fp16, words, key_words.tolist())
    table = preset.centroids("cpu").to(torch.float16).numpy()
    for k in range(4):
        np.testing.assert_array_equal(got[k], table[(words >> (4 * k)) & 0xF])


@pytest.mark.parametrize("preset_name", ["turboquant_k3v4_nc", "turboquant_3bit_nc"])
def test_3bit_centroid_lookup_by_byte_permutes_gives_the_fp16_table_entries(preset_name):
    """lut3_fp16 (3-bit Lloyd-Max keys): the four codes in a word's low 12 bits -> their fp16 centroids, for
    every 16-bit word (the bits above 12 must not matter: the kernel hands it words with other codes there)."""
    import torch

    from tqkv_compile.codec import get_preset

    preset = get_preset(preset_name, 128)
    lut = cache_tables.key_lut(preset, torch.device("cpu")).tolist()
    words = np.arange(1 << 16, dtype=np.uint32)
    got = _run_asm(device_helpers.lut3_fp16, words, [lut[0], lut[1], lut[4], lut[5]])
    table = preset.centroids("cpu").to(torch.float16).numpy()
    assert table.shape == (8,)
    for k in range(4):
        np.testing.assert_array_equal(got[k], table[(words >> (3 * k)) & 7])
