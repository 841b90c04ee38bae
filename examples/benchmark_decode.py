"""End-to-end decode benchmark (same as ``tqkv bench e2e``): vLLM's engine with each cache configuration.

    python examples/benchmark_decode.py --out e2e.json --plot e2e.png              # GPU: Llama-3-8B shape
    python examples/benchmark_decode.py --model tqkv_compile/models/tiny-llama --dtype float32 \\
        --configs vllm_tq:turboquant_4bit_nc,tqkv:turboquant_4bit_nc --cases 2x64x16   # a CPU-sized run
"""

from tqkv_compile.tools.bench_e2e import main

if __name__ == "__main__":
    raise SystemExit(main())
