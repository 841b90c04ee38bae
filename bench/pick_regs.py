"""The fragment kernel's register cap from a `regs` run (bench/h200_session.sh regs), kept for the next stages.

    python3 bench/pick_regs.py h200-regs.json /root/tqkv-ab.env

The run times each preset and case with the launcher's default ({}), a cap of 128 registers ({"maxnreg": 128}:
4 programs an SM where PREFETCH 2's default of 168 holds 3) and 3 splits, each twice. This prints every case's
mean times and ratios, and the geometric mean of 128's time over the default's, over the presets with 4-bit keys
(those the key table serves, the cap's reason) and over all. Where the first is at most 0.98 and the second at
most 1 (the cap applies to every launch at head 128: it must not cost the other presets more than it gains),
``TQKV_FRAGMENT_MAXNREG=128`` is written to the environment file (which h200_session.sh reads at every later
stage on the machine); otherwise, and on any error (no file, no default timings), the line is taken out of it.
The file's other lines stay. A case where 128 failed counts as infinitely slow; one where the default failed
is left out (nothing to compare with)."""
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

KEY = "TQKV_FRAGMENT_MAXNREG"
CAP = 128
FOUR_BIT_KEYS = ("turboquant_4bit_nc", "tqkv_4bit_pc")
LIMIT = 0.98


def variant_name(variant: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(variant.items())) or "default"


def mean_times(records: list[dict]) -> dict[str, dict[tuple[str, int, int], float]]:
    """{variant: {(preset, B, L): mean us}} over the decode records (failed runs: infinity)."""
    runs: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if "meta" in r or r.get("op") != "decode" or "variant" not in r:
            continue
        runs[variant_name(r["variant"])][(r["preset"], r["B"], r["L"])].append(r.get("us", math.inf))
    return {name: {k: sum(v) / len(v) for k, v in cases.items()} for name, cases in runs.items()}


def score(times: dict[str, dict], name: str, presets: tuple[str, ...]) -> float:
    """Geometric mean of ``name``'s time over the default's, over the default's cases of ``presets``."""
    base = {k: v for k, v in times.get("default", {}).items() if k[0] in presets and math.isfinite(v)}
    if not base:
        return math.inf
    ratios = [times.get(name, {}).get(k, math.inf) / us for k, us in base.items()]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def write_choice(env_file: Path, keep: bool) -> None:
    lines = [l for l in (env_file.read_text().splitlines() if env_file.exists() else []) if not l.startswith(KEY + "=")]
    if keep:
        lines.append(f"{KEY}={CAP}")
    env_file.write_text("".join(l + "\n" for l in lines))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        times = mean_times(json.load(open(argv[0])))
    except (OSError, ValueError) as exc:
        times = {}
        print(f"{argv[0]}: {exc}", file=sys.stderr)
    if "default" not in times:
        print(f"no default timings in {argv[0]}: the default cap stays", file=sys.stderr)
        write_choice(Path(argv[1]), keep=False)
        return 1
    others = sorted(n for n in times if n != "default")
    print(f"{'preset':20s} {'case':>10s} {'default':>9s} " + " ".join(f"{n:>16s}" for n in others))
    for key, us in sorted(times["default"].items()):
        cells = " ".join(f"{times[n].get(key, math.inf):8.1f} ({times[n].get(key, math.inf) / us:.3f})" for n in others)
        print(f"{key[0]:20s} {key[1]:>4d}x{key[2]:<5d} {us:9.1f} {cells}")
    cap = f"maxnreg={CAP}"
    four, rest = score(times, cap, FOUR_BIT_KEYS), score(times, cap, tuple({k[0] for k in times["default"]}))
    keep = four <= LIMIT and rest <= 1.0
    print(f"{cap} / default, geometric mean: {four:.4f} over the 4-bit-key presets, {rest:.4f} over all: "
          + (f"{KEY}={CAP} kept for the later stages" if keep else "the default cap stays"))
    write_choice(Path(argv[1]), keep)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
