"""A model of the fragment kernel's global loads: how many 128-byte cache lines each warp's load instruction
touches, summed over one tile (64 positions of one kv head, the 4 warps of a program), for the ways the kernel
can load (its STAGE). The L1 serves about one line (a "wavefront") a cycle, so a tile whose loads touch more
lines than the ~466 cycles it has at the H200's bandwidth (8.6 KB for 4bit_nc at ~18.4 B an SM-cycle) cannot run
at that bandwidth, however few instructions it issues. A model, not a measurement: it takes the cache as vLLM
lays it out ([blocks, 16, kv heads, slot bytes]) with random block ids, and ignores what the L1 merges.

    python bench/load_lines.py                          # vLLM's four presets, head 128
    python bench/load_lines.py --preset tqkv_4bit_pc --trials 1000
"""

from __future__ import annotations

import argparse
import random

import tqkv_compile

BLOCK_SIZE, KV_HEADS, LINE = 16, 8, 128


def _lines(addresses: list[int], size: int) -> int:
    return len({a // LINE for a in addresses} | {(a + size - 1) // LINE for a in addresses})


def tile_lines(preset, rng: random.Random) -> dict[str, int]:
    """Lines a tile's load instructions touch, by load: keys / values as each thread's fragments (STAGE 0) or
    a position's words a warp instruction (STAGE 1, 2), and the per-position fields (norm, scale, zero) as the
    score rows hold them (each thread 2 rows of its warp's 16: STAGE 0) or as a [64, 4] tile (8 positions' 4
    fields a warp instruction: STAGE 1, 2)."""
    head = rng.randrange(KV_HEADS)
    blocks = [rng.randrange(1 << 16) for _ in range(4)]

    def slot(pos: int) -> int:
        return ((blocks[pos // 16] * BLOCK_SIZE + pos % 16) * KV_HEADS + head) * preset.slot_bytes

    key_word = 4 if preset.key_fp8 else 2  # bytes of four key codes
    kt = preset.head_dim // 16  # a thread's key words of a row
    words_v = preset.head_dim // 128  # a thread's value words of a position
    out = dict(keys_fragments=0, values_fragments=0, keys_rows=0, values_rows=0, fields=0, fields_rows=0)
    for w in range(4):
        for r in range(2):  # keys as fragments: lane (g, t) rows g, g + 8 of warp w, words t * KT + kk
            for kk in range(kt):
                out["keys_fragments"] += _lines([slot(16 * w + g + 8 * r) + key_word * (kt * t + kk)
                                                 for g in range(8) for t in range(4)], key_word)
        for kk in range(4):  # values as fragments: words J (8 w + l // 4) + j of positions 16 kk + 8 r2 + 2 t + b
            for r2 in range(2):
                for b in range(2):
                    for j in range(words_v):
                        out["values_fragments"] += _lines(
                            [slot(16 * kk + 8 * r2 + 2 * t + b) + preset.key_bytes + 2 * (words_v * (8 * w + g) + j)
                             for g in range(8) for t in range(4)], 2)
        for row in range(16):  # rows: a warp's instruction reads 32 consecutive words of one position
            pos = 16 * w + row
            for first in range(0, preset.head_dim // 4, 32):
                if preset.key_bits != 3 or preset.key_fp8:
                    out["keys_rows"] += _lines([slot(pos) + key_word * (first + lane) for lane in range(32)],
                                               key_word)
                if preset.value_bits != 3:
                    out["values_rows"] += _lines([slot(pos) + preset.key_bytes + 2 * (first + lane)
                                                  for lane in range(32)], 2)
        # 3-bit fields (STAGE 1 / 2): lane (group g, row) reads words 3 g .. 3 g + 3, 4 positions an instruction
        groups = preset.head_dim // 16
        for rows in range(4):
            for j in range(4):
                for rep in range(max(1, groups // 8)):
                    spots = [(16 * w + 4 * rows + q, 3 * (8 * rep + g) + j) for q in range(4) for g in range(8)]
                    if preset.key_bits == 3 and not preset.key_fp8:
                        out["keys_rows"] += _lines([slot(p) + 2 * word for p, word in spots], 2)
                    if preset.value_bits == 3:
                        out["values_rows"] += _lines([slot(p) + preset.key_bytes + 2 * word for p, word in spots], 2)
        fields = ([preset.key_code_bytes] if not preset.key_fp8 else []) + \
            [preset.key_bytes + preset.value_code_bytes, preset.key_bytes + preset.value_code_bytes + 2]
        for r in range(2):
            for offset in fields:
                out["fields"] += _lines([slot(16 * w + g + 8 * r) + offset for g in range(8)], 2)
        four = (fields * 2)[:4]  # the fields as a [64, 4] tile: a warp's instruction reads 8 positions' fields
        for r in range(2):
            out["fields_rows"] += _lines([slot(16 * w + 8 * r + g) + four[c] for g in range(8) for c in range(4)], 2)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append", help="repeatable; default vLLM's four presets")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--trials", type=int, default=400)
    args = parser.parse_args()
    for name in args.preset or ["turboquant_4bit_nc", "turboquant_k8v4", "turboquant_k3v4_nc", "turboquant_3bit_nc"]:
        preset = tqkv_compile.get_preset(name, args.head_dim)
        rng = random.Random(0)
        sums: dict[str, float] = {}
        for _ in range(args.trials):
            for key, value in tile_lines(preset, rng).items():
                sums[key] = sums.get(key, 0) + value / args.trials
        tile_bytes = 64 * preset.slot_bytes
        budget = tile_bytes / (4.8e12 / (132 * 1.98e9))  # SM-cycles a tile at the H200's peak bandwidth
        stage0 = sums["keys_fragments"] + sums["values_fragments"] + sums["fields"]
        rows = sums["keys_rows"] + sums["values_rows"] + sums["fields_rows"]
        print(f"{name} D{args.head_dim}: a tile {tile_bytes} B, ~{budget:.0f} SM-cycles at peak bandwidth; lines a "
              f"tile: " + ", ".join(f"{k} {v:.0f}" for k, v in sums.items()) +
              f"; STAGE 0 {stage0:.0f}, STAGE 1 / 2 {rows:.0f} (+ the move through shared memory)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
