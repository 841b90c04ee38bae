"""One vLLM engine run in its own process, reported as one JSON line: ``python -m tqkv_compile.vllm.engine_run``.

The demo and the tests start each configuration (compiled + pass, eager, bf16 cache, ...) in a fresh
process: vLLM keeps per-process state, and the tqkv counters of a run are then that run's alone. The
engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so those counters are readable here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from tqkv_compile.argtypes import positive_int


def _prompts(count: int, length: int, vocab: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """``count`` random prompts of ``length + 7 * i`` tokens; the first ``shared_prefix`` tokens are the same in
    every prompt (requests sharing a prefix, for prefix caching)."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(length + 7 * i)] for i in range(count)]


#: set for vLLM's worker processes, where our plugin applies :func:`scaled_dummy_weights` with this std
DUMMY_WEIGHT_STD_ENV = "TQKV_DUMMY_WEIGHT_STD"


def scaled_dummy_weights(std: float):
    """Make vLLM's dummy loader draw weights with enough scale that attention matters: its own lie in
    [-1e-3, 1e-3] (norm weights too), which makes every attention nearly uniform, so that any two KV caches
    agree trivially. Matrices get uniform weights of this std, vectors (norms, biases) 1 + small noise.
    Seeded per tensor shape, so every engine of a comparison gets the same model. Only this harness's
    in-process engine is affected."""
    import torch
    from vllm.model_executor.model_loader import dummy_loader

    original = dummy_loader.initialize_single_dummy_weight

    def initialize(param, low=-1e-3, high=1e-3, seed=1234):
        if param.device.type == "meta" or not torch.is_floating_point(param):
            return original(param, low, high, seed)
        g = torch.Generator().manual_seed(seed + param.numel())
        noise = torch.rand(param.shape, generator=g) * 2 - 1
        value = 1.0 + 0.1 * noise if param.dim() == 1 else noise * (std * 3**0.5)
        with torch.no_grad():
            param.copy_(value.to(param.dtype))

    dummy_loader.initialize_single_dummy_weight = initialize
    from vllm.model_executor.model_loader import weight_utils

    if hasattr(weight_utils, "initialize_single_dummy_weight"):  # vLLM 0.20 calls it from weight_utils
        weight_utils.initialize_single_dummy_weight = initialize


def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.graph_dump:
        os.environ["TQKV_GRAPH_DUMP_DIR"] = args.graph_dump
    from vllm import LLM, SamplingParams

    import tqkv_compile.vllm as tqkv_vllm
    from tqkv_compile.vllm import serving

    kwargs = dict(
        model=args.model, load_format="auto" if args.real_weights else "dummy", skip_tokenizer_init=True,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len, enforce_eager=args.mode == "eager", seed=0,
        max_num_seqs=max(args.prompts, 1), dtype=args.dtype,
    )
    if args.max_num_batched_tokens:  # below the prompt length: chunked prefill
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.prefix_caching is not None:
        kwargs["enable_prefix_caching"] = args.prefix_caching
    if args.async_scheduling is not None:
        kwargs["async_scheduling"] = args.async_scheduling
    forced = _forced_tokens(args)
    if forced is not None:  # teacher-forced decoding (tqkv_compile.vllm.forced_tokens)
        from tqkv_compile.vllm import forced_tokens

        kwargs["logits_processors"] = [forced_tokens.processor()]
    if args.ngram:  # speculative decoding: n-gram proposals from the prompt, verified by the model
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram,
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    report_dir = None
    if args.tensor_parallel_size > 1:
        # the model runs in worker processes: they report through files, and get the same dummy weights
        import tempfile

        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
        report_dir = tempfile.mkdtemp(prefix="tqkv-ranks-")
        os.environ[serving.REPORT_DIR_ENV] = report_dir
        if args.init_std > 0 and not args.real_weights:
            os.environ[DUMMY_WEIGHT_STD_ENV] = str(args.init_std)
        if (os.cpu_count() or 1) >= args.tensor_parallel_size:  # vllm-cpu binds one core set per rank
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                                  "|".join(str(i) for i in range(args.tensor_parallel_size)))
    if args.tqkv and args.tqkv_via == "plugin":
        os.environ["TQKV_ENABLE"] = "1"  # nothing else: the vllm.general_plugins entry point does the rest
        if args.tqkv_preset:
            os.environ[tqkv_vllm.PRESET_ENV] = args.tqkv_preset
    elif args.tqkv:
        if args.mode == "compiled":
            kwargs["compilation_config"] = tqkv_vllm.compilation_config(preset=args.tqkv_preset)
        else:
            tqkv_vllm.enable(args.tqkv_preset)
    if args.init_std > 0 and not args.real_weights:
        scaled_dummy_weights(args.init_std)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    config = llm.llm_engine.vllm_config
    from tqkv_compile.model_config import text_config

    with open(os.path.join(args.model, "config.json")) as f:
        vocab = text_config(json.load(f))["vocab_size"]
    if args.prompt_ids:
        with open(args.prompt_ids) as f:
            prompts = [{"prompt_token_ids": p} for p in json.load(f)]
    else:
        prompts = [{"prompt_token_ids": p}
                   for p in _prompts(args.prompts, args.prompt_len, vocab, seed=1, shared_prefix=args.shared_prefix)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, logprobs=args.logprobs, ignore_eos=True)
    if forced is not None and len(forced) != len(prompts):
        raise SystemExit(f"--force-tokens: {len(forced)} token lists for {len(prompts)} prompts")
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    # warm-up with decode steps and the timed run's logprobs: what the first decode step compiles or loads (vLLM
    # compiles its logprobs gather at first use, ~0.6 s on 2 cores) stays out of the timing
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, logprobs=args.logprobs, ignore_eos=True),
                 use_tqdm=False)
    # decode time = t(new-tokens) - t(1 token), the median over --timed-pairs pairs: one pair on a small model is
    # a second or less, where a busy 2-core machine swings by 1.5x
    pairs = []
    for _ in range(args.timed_pairs):
        t0 = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        t1 = time.perf_counter()
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        t2 = time.perf_counter()
        pairs.append(max((t2 - t1) - (t1 - t0), 1e-9))
    decode_s = statistics.median(pairs)
    if forced is not None:  # after the timed (free) run: forcing costs host work per step
        from tqkv_compile.vllm.forced_tokens import FORCED_TOKENS_KEY

        outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=len(ids), logprobs=args.logprobs,
                                                        ignore_eos=True, extra_args={FORCED_TOKENS_KEY: ids})
                                         for ids in forced], use_tqdm=False)
    tokens, logprobs, top1 = [], [], []
    for out in outputs:
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        logprobs.append([{str(k): v.logprob for k, v in step.items()} for step in completion.logprobs])
        # the model's own first choice at each position (= the token itself unless decoding was forced)
        top1.append([next((k for k, v in step.items() if v.rank == 1), None) for step in completion.logprobs])
    if forced is not None and tokens != forced:
        bad = next(i for i, (t, f) in enumerate(zip(tokens, forced)) if t != f)
        raise RuntimeError(f"forced decoding did not hold: prompt {bad} generated {tokens[bad][:12]}... for "
                           f"{forced[bad][:12]}...")
    from tqkv_compile.passes import attention_rewrite

    reports = [r for r in attention_rewrite.reports if r.attention_nodes]
    report = reports[-1] if reports else attention_rewrite.last_report
    layers = sorted(config.compilation_config.static_forward_context)
    cache = config.cache_config
    ranks = []
    if report_dir:
        import glob

        ranks = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(report_dir, "*.json")))]
    return {
        "ranks": ranks,
        "tensor_parallel_size": args.tensor_parallel_size,
        "model": args.model,
        "mode": args.mode,
        "tqkv": args.tqkv,
        "kv_cache_dtype": args.kv_cache_dtype,
        "tqkv_preset": args.tqkv_preset,
        "dtype": args.dtype,
        "start_s": round(start_s, 2),
        "decode_tok_s": round(len(prompts) * (args.new_tokens - 1) / decode_s, 1),
        "decode_tok_s_pairs": [round(len(prompts) * (args.new_tokens - 1) / s, 1) for s in pairs],
        "kv_capacity_tokens": int(cache.num_gpu_blocks or 0) * int(cache.block_size),
        "layers": layers,
        "served_compiled": serving.served_layers("compiled"),
        "served_impl": serving.served_layers("impl"),
        "memory_backend": _memory_backend(ranks),
        "fallbacks": dict(serving.fallbacks),
        "pass": {"attention_nodes": report.attention_nodes, "layers_known": report.layers_known, "rewritten": report.rewritten,
                 "fallbacks": report.fallbacks, "error": report.error},
        "forced": forced is not None,
        "tokens": tokens,
        "top1": top1,
        "logprobs": logprobs,
    }


def _memory_backend(ranks: list[dict]) -> str | None:
    """The tqkv memory backends that served attention (this process's and the tensor-parallel workers'), comma
    separated; None where tqkv served no layer."""
    from tqkv_compile.vllm import serving

    names = set(serving.memory_backends.values()).union(*(rank.get("memory_backends", []) for rank in ranks))
    return ", ".join(sorted(names)) or None


def _forced_tokens(args: argparse.Namespace) -> list[list[int]] | None:
    if not args.force_tokens:
        return None
    if args.ngram:
        raise SystemExit("--force-tokens with --ngram: vLLM takes no logits processor with speculative decoding")
    with open(args.force_tokens) as f:
        forced = json.load(f)
    if not isinstance(forced, list) or not all(isinstance(ids, list) and ids for ids in forced):
        raise SystemExit(f"--force-tokens {args.force_tokens}: expected a JSON list of non-empty token-id lists")
    return forced


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tqkv_compile.vllm.engine_run")
    p.add_argument("--model", required=True)
    p.add_argument("--kv-cache-dtype", default="turboquant_4bit_nc")
    p.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    p.add_argument("--tqkv", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tqkv-via", choices=("config", "plugin"), default="config",
                   help="enable tqkv through compilation_config() / enable(), or only TQKV_ENABLE=1 and the plugin")
    p.add_argument("--tqkv-preset", default=None, help="a preset of ours, stored in the kv cache dtype's caches")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--real-weights", action="store_true", help="load the model folder's weights (default: dummy)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--timed-pairs", type=positive_int, default=1,
                   help="(1-token, new-tokens) generate pairs timed; decode speed is their median (default 1)")
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="vLLM's token budget per step; below the prompt length, prefill is chunked")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's enable_prefix_caching (default: vLLM's)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's async_scheduling (default: vLLM's)")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--prompt-ids", default=None, help="JSON file: a list of prompts as token-id lists (instead of "
                   "random ones)")
    p.add_argument("--force-tokens", default=None,
                   help="JSON file: per prompt, the token ids to decode (teacher-forced), in a run after the timed "
                        "free one; the tokens and logprobs reported are the forced run's (the model's own "
                        "logprobs at each forced position)")
    p.add_argument("--ngram", type=int, default=0, help="n-gram speculative decoding with this many proposed tokens")
    p.add_argument("--dtype", default=None,
                   help="activation dtype (vLLM's --dtype); default float32 on the CPU, bfloat16 on CUDA (vLLM's "
                        "TurboQuant backend takes fp16 / bf16 only)")
    p.add_argument("--graph-partition", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA: Inductor graph partition (default) or one graph with full CUDA graphs for decode only")
    p.add_argument("--init-std", type=float, default=0.08,
                   help="std of the dummy weights (0: vLLM's own, within 1e-3)")
    p.add_argument("--graph-dump", default=None, help="folder for the graph before/after the pass")
    return p.parse_args(argv)


def default_dtype() -> str:
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


#: seconds: dump every thread's Python stack to stderr this often while the run lasts (0 / unset: never); for
#: harnesses whose child may hang (where it hangs is then in its log)
STACK_DUMP_ENV = "TQKV_STACK_DUMP_S"


def _dump_stacks_every(period: float) -> None:
    """A daemon thread printing every thread's Python stack to stderr every ``period`` seconds. (A Python thread,
    not faulthandler's C watchdog: that one crashed a run under Triton's interpreter on the CPU. Blocking CUDA
    calls in torch release the GIL, so a stuck sync still shows.)"""
    import threading
    import traceback

    def loop() -> None:
        while True:
            time.sleep(period)
            frames = sys._current_frames()
            lines = [f"[tqkv stack dump] {len(frames)} threads"]
            for ident, frame in frames.items():
                if ident != threading.get_ident():
                    lines += [f"-- thread {ident}", *traceback.format_stack(frame)[-40:], *_layers_on(frame)]
            print("\n".join(lines), file=sys.stderr, flush=True)

    threading.Thread(target=loop, name="tqkv-stack-dump", daemon=True).start()


def _layers_on(frame) -> list[str]:
    """The named modules on a thread's stack (``layer_name`` of attention layers, else vLLM's ``prefix``),
    innermost first: which layer a stuck call belongs to."""
    found = []
    while frame is not None:
        owner = frame.f_locals.get("self")
        try:
            name = getattr(owner, "layer_name", None) or getattr(owner, "prefix", None)
        except Exception:  # an object whose attribute access raises: not a layer
            name = None
        if isinstance(name, str) and name:
            found.append(f"   on the stack: {type(owner).__name__} {name}")
        frame = frame.f_back
    return found[:6]


def main(argv: list[str] | None = None) -> int:
    period = float(os.environ.get(STACK_DUMP_ENV) or 0)
    if period > 0:
        _dump_stacks_every(period)
    args = parse(argv)
    args.dtype = args.dtype or default_dtype()
    if args.graph_partition is not None:
        from tqkv_compile.vllm import GRAPH_PARTITION_ENV

        os.environ[GRAPH_PARTITION_ENV] = "1" if args.graph_partition else "0"
    result = run(args)
    sys.stdout.write("TQKV_RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
