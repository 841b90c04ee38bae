"""The winner of a variants run (bench/h200_session.sh variants), as the environment the next stages run with.

    python3 bench/pick_variant.py h200-variants.json [--check check.log] > winners.env

Each variant's tqkv times (decode and kv_write) against the first variant's (the mean of its two runs): the
geometric mean of the ratios. The variant with the lowest mean wins if it is at least 1% faster and, when a
check log is given, that check reported 0 failures; its ENV (``VAR=value ...``) is printed, else nothing.
The table goes to stderr."""
import argparse
import json
import math
import re
import sys
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants_json")
    ap.add_argument("--check", help="log of bench_kernels --check run with every variant's switches on")
    args = ap.parse_args()
    records = json.load(open(args.variants_json))
    env = {r["meta"]["variant"]: r["meta"].get("env", "") for r in records if "meta" in r}
    times: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if "meta" in r or r.get("impl") != "tqkv" or "us" not in r:
            continue
        times[r["variant"].removesuffix("-again")][(r["op"], r["preset"], r["B"], r["L"])].append(r["us"])
    names = sorted(times)
    if not names:
        sys.exit("no tqkv timings in " + args.variants_json)
    base = {k: sum(v) / len(v) for k, v in times[names[0]].items()}
    scores = {}
    for name in names[1:]:
        ratios = [sum(v) / len(v) / base[k] for k, v in times[name].items() if k in base]
        scores[name] = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else math.inf
        print(f"{name:12s} {env.get(name, ''):40s} time / {names[0]}: {scores[name]:.4f} over {len(ratios)}",
              file=sys.stderr)
    checked = True
    if args.check:
        text = open(args.check).read()
        found = re.search(r"(\d+) failures", text)
        checked = bool(found) and found.group(1) == "0"
        print(f"check: {found.group(0) if found else 'no result'}", file=sys.stderr)
    best = min(scores, key=scores.get, default=None)
    if best is not None and scores[best] <= 0.99 and checked:
        print(f"winner: {best}", file=sys.stderr)
        print(env.get(best, ""))
    else:
        print("no winner: the first variant's switches stay", file=sys.stderr)


if __name__ == "__main__":
    main()
