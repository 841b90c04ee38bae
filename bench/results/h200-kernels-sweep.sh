#!/bin/bash
# One device call: install, --check, then a decode sweep of kernel variants (tqkv only). Logs under $OUT.
# (Historical: the "sym" and "centroid_gather" knobs this sweep compared were removed afterwards; see h200-kernels-notes.md.)
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
timeout 150 python3 -m tqkv_compile.bench_kernels --check --dims 64,128 > $OUT/check.log 2>&1; echo "check rc=$?"; tail -2 $OUT/check.log; grep FAIL $OUT/check.log | head
A='{"kernel":"bytes","block_n":32}'
V64="[$A,{\"block_n\":64},{\"block_n\":32},{\"block_n\":64,\"num_warps\":8},{\"block_n\":64,\"num_stages\":3},{\"block_n\":32,\"num_stages\":3},{\"block_n\":64,\"splits\":4},{\"block_n\":128,\"num_warps\":8}"
run() { timeout $1 python3 -m tqkv_compile.bench_kernels --tune --cases $2 --presets $3 --variants "$4" >> $OUT/tune.log 2>&1; echo "rc=$? $2 $3"; }
run 120 64x32768 turboquant_4bit_nc "$V64,{\"block_n\":32,\"sym\":false}]"
run 90 64x32768 turboquant_k8v4 "$V64]"
run 60 64x32768 turboquant_k3v4_nc,turboquant_3bit_nc "[$A,{\"block_n\":64},{\"block_n\":32},{\"block_n\":64,\"num_warps\":8}]"
run 60 1x32768 turboquant_4bit_nc,turboquant_k8v4 "[$A,{\"block_n\":64},{\"block_n\":32},{\"block_n\":64,\"num_warps\":8},{\"block_n\":32,\"splits\":128},{\"block_n\":64,\"splits\":32}]"
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/tune.log"):
    if line.startswith("{") and '"variant"' in line:
        r = json.loads(line)
        print(f'{r["B"]}x{r["L"]} {r["preset"][11:]:8s} {r.get("us", r.get("error", "")[:80])!s:>9} {r.get("GBps","")!s:>7} {json.dumps(r["variant"])}')
PY
