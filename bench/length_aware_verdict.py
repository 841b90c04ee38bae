"""Whether the length-aware split may be the launcher's default, read from a launch sweep (``bench/launch_sweep.py``
with its built-in launches ``fixed`` and ``aware``, and any variants such as ``narrow`` / ``aware4``).

The rule under test is :func:`~tqkv_compile.lowerings.launch_choices.length_aware`'s with its default on: the
``aware`` launch in cells of several sequences at one row a program, ``fixed`` elsewhere (one sequence; rows packed
a program: several rows a sequence at query-head groups under 8). It may be the default when, in every cell the sweep has, it costs at most ``--tolerance`` against
``fixed`` (one launch's noise), including the tuned cell (llama3-8b 64 x 32768, 4bit_nc). Prints a table (us and the
ratio to ``fixed`` of every launch the cell has), then one line ``TQKV_LENGTH_AWARE=rule`` or ``=0`` with the reason;
``--env FILE`` writes that line to FILE too (``hopper_session.sh`` reads it for the stages after the sweep).

    python bench/length_aware_verdict.py bench/results/h100-launch-sweep-aware.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

TUNED = ("llama3-8b", "64x32768", "turboquant_4bit_nc")


def rule_applies(shape: str, case_name: str) -> bool:
    """Whether the rule takes the length-aware split in this cell of the shape matrix, as the launcher decides it:
    ``launch_choices.length_aware_rule`` over the cell's sequences and the rows a program ``packed_rows`` gives
    them (rows of a sequence are packed only at query-head groups under 8)."""
    from tqkv_compile.lowerings.launch_choices import length_aware_rule, packed_rows
    from tqkv_compile.tools.bench_shapes import CASES, SHAPES

    q_heads, kv_heads, _ = SHAPES[shape]
    case = CASES[case_name]
    return length_aware_rule(case.batch, packed_rows(case.batch * case.rows, case.batch, q_heads // kv_heads))


def verdict(records: list[dict], tolerance: float) -> tuple[bool, str, list[str]]:
    """(on, why, table lines) from a sweep's records."""
    cells: dict[tuple, dict[str, float]] = collections.defaultdict(dict)
    for r in records:
        if "us" in r and r.get("splits") is None:
            cells[(r["shape"], r["case"], r["preset"])][r["kernel"]] = r["us"]
    lines, losses, gains = [], [], []
    names = sorted({k for launches in cells.values() for k in launches} - {"default", "fixed"})
    lines.append(f"{'shape':16} {'case':20} {'preset':20} {'fixed us':>9} " + " ".join(f"{n:>9}" for n in names)
                 + "  rule")
    for (shape, case, preset), launches in sorted(cells.items()):
        if "fixed" not in launches or "aware" not in launches:
            continue
        fixed = launches["fixed"]
        chosen = launches["aware"] if rule_applies(shape, case) else fixed
        ratio = chosen / fixed
        (losses if ratio > 1 + tolerance else gains).append(((shape, case, preset), ratio))
        lines.append(f"{shape:16} {case:20} {preset:20} {fixed:9.1f} "
                     + " ".join(f"{launches[n] / fixed:9.3f}" if n in launches else f"{'-':>9}" for n in names)
                     + f"  {ratio:.3f}")
    if not losses and not gains:
        return False, "the sweep has no cell with both fixed and aware", lines
    if losses:
        worst = max(losses, key=lambda x: x[1])
        return False, (f"{len(losses)} cell(s) lose more than {tolerance:.0%} against fixed, worst "
                       f"{':'.join(worst[0])} at {worst[1]:.3f}x the time"), lines
    tuned = dict(gains).get(TUNED)
    best = min(gains, key=lambda x: x[1])
    return True, (f"no cell loses more than {tolerance:.0%}; the tuned cell at "
                  f"{'%.3f' % tuned if tuned is not None else 'not swept'}x; best "
                  f"{':'.join(best[0])} at {best[1]:.3f}x the time"), lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep", help="a launch sweep's JSON list (bench/launch_sweep.py --out)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="the cost allowed a cell (%(default)s)")
    parser.add_argument("--env", help="also write the verdict's TQKV_LENGTH_AWARE=... line to this file")
    args = parser.parse_args(argv)
    with open(args.sweep) as f:
        records = [r for r in json.load(f) if "meta" not in r]
    on, why, lines = verdict(records, args.tolerance)
    print("\n".join(lines))
    line = f"TQKV_LENGTH_AWARE={'rule' if on else 0}"
    print(f"{line}  ({why})")
    if args.env:
        with open(args.env, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
