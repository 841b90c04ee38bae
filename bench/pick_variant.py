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
    l2 = defaultdict(set)  # how each variant's harness timed decode (the L2 rule changed on 2026-12-04)
    for r in records:
        if "meta" in r or r.get("impl") != "tqkv":
            continue
        variant = r["variant"].removesuffix("-again")
        B, L = r["B"], r["L"]
        if r["op"] == "kv_write" and B == 1 and L > 0:  # trees before 2026-12-04 20:40 wrote kv_write as B 1, L tokens
            B, L = L, 0
        times[variant][(r["op"], r["preset"], B, L)].append(r.get("us", math.inf))  # error: infinitely slow
        if r["op"] == "decode":
            l2[variant].add(r.get("l2", "warm: one block table replayed").split(":")[0])
    names = sorted(times)
    if not names:
        sys.exit("no tqkv timings in " + args.variants_json)
    if len(set().union(*l2.values())) > 1:
        sys.exit(f"the variants' harnesses timed decode differently ({dict(l2)}): not comparable; build the trees "
                 "from commits on the same side of the L2 change, or time them with one harness")
    base = {k: sum(v) / len(v) for k, v in times[names[0]].items()}
    scores = {}
    for name in names[1:]:
        # a case the first variant timed and this one did not (or failed) counts as infinitely slow
        ratios = [sum(times[name][k]) / len(times[name][k]) / base[k] if times[name].get(k) else math.inf
                  for k in base]
        scores[name] = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else math.inf
        print(f"{name:12s} {env.get(name, ''):40s} time / {names[0]}: {scores[name]:.4f} over {len(ratios)}",
              file=sys.stderr)
    checked = True
    if args.check:
        text = open(args.check).read()
        found = re.findall(r"(\d+) failures", text)
        checked = bool(found) and all(n == "0" for n in found)
        print(f"check: {', '.join(n + ' failures' for n in found) or 'no result'}", file=sys.stderr)
    best = min(scores, key=scores.get, default=None)
    if best is not None and scores[best] <= 0.99 and checked:
        print(f"winner: {best}", file=sys.stderr)
        print(env.get(best, ""))
    else:
        print("no winner: the first variant's switches stay", file=sys.stderr)


if __name__ == "__main__":
    main()
