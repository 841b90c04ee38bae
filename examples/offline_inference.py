"""Offline inference with the tqkv pass: a TurboQuant cache whose layers are served by tqkv's ops.

    python examples/offline_inference.py [MODEL_DIR]

MODEL_DIR defaults to the built-in 6-layer Llama (config.json only: dummy weights, prompts as token ids).
With a real model folder, drop load_format/skip_tokenizer_init and pass text prompts.
"""

import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine here, to read tqkv's counters


def main() -> None:
    from vllm import LLM, SamplingParams

    import tqkv_compile.vllm
    from tqkv_compile.model_config import builtin_model
    from tqkv_compile.vllm import serving

    model = sys.argv[1] if len(sys.argv) > 1 else builtin_model()
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=512,
              kv_cache_dtype="turboquant_4bit_nc", compilation_config=tqkv_compile.vllm.compilation_config())
    outputs = llm.generate([{"prompt_token_ids": [5, 17, 99, 42, 7, 300]}],
                           SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    print("generated token ids:", list(outputs[0].outputs[0].token_ids))
    print("layers served by the rewritten graph:", serving.served_layers("compiled"))
    print("layers left on vLLM's path:", serving.fallbacks)


if __name__ == "__main__":
    main()
