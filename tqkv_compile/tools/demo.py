"""``tqkv demo`` and ``tqkv inspect``: real vLLM on the CPU with a TurboQuant cache served by tqkv.

The demo runs three engines, each in its own process (see :mod:`tqkv_compile.vllm.engine_run`):
compiled with the tqkv pass, eager with the tqkv ops (the reference for the compiled run), and compiled
with vLLM's bf16 cache (the quality baseline). Progress goes to stderr; ``--json`` prints one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from tqkv_compile.argtypes import positive_int
from tqkv_compile.model_config import builtin_model, check_model, kv_bytes_per_token
from tqkv_compile.vllm.engine_runs import compare_logprobs, run_engine


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model and --kv-cache-dtype (demo and inspect)."""
    from tqkv_compile.codec import preset_names

    p.add_argument("--model", default=None, help="model folder (config.json is enough: dummy weights); default: "
                   "a built-in 6-layer Llama")
    p.add_argument("--kv-cache-dtype", default="turboquant_4bit_nc", choices=preset_names(), metavar="PRESET",
                   help="vLLM's TurboQuant preset (default %(default)s; one of: %(choices)s). Presets of ours ride "
                        "on one of these: the demo's --preset, or TQKV_PRESET=NAME in the environment (README)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tqkv_compile.codec import own_preset_names

    add_model_arguments(p)
    p.add_argument("--preset", default=None, choices=own_preset_names(), metavar="OURS",
                   help="a preset of tqkv's to store in the caches of the --kv-cache-dtype it rides on (one of: "
                        "%(choices)s; sets TQKV_PRESET for the runs); default: the cache dtype's own")
    p.add_argument("--prompts", type=positive_int, default=4, help="sequences decoded together (default %(default)s)")
    p.add_argument("--prompt-len", type=positive_int, default=40, help="prompt tokens each (default %(default)s)")
    p.add_argument("--new-tokens", type=positive_int, default=24,
                   help="tokens generated each (default %(default)s)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="activation dtype; on the CPU fp32 by default because in bf16 vLLM's own compiled and eager "
                        "runs already diverge on random weights (no tqkv involved), which would hide what the check "
                        "tests; on CUDA bf16 (vLLM's TurboQuant backend takes fp16 / bf16 only)")
    p.add_argument("--timed-pairs", type=positive_int, default=5,
                   help="each run's decode speed is the median of this many timed generate calls (default "
                        "%(default)s; the machine's noise is ~1.5x a call on 2 cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object on one line")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the run with vLLM's uncompressed cache (the activation dtype)")


def _say(message: str) -> None:
    print(f"[tqkv] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    model = os.path.abspath(args.model) if args.model else builtin_model()
    if args.dtype is None:
        from tqkv_compile.vllm.engine_run import default_dtype

        args.dtype = default_dtype()
    check_model("demo", model)
    if args.preset:
        from tqkv_compile.codec import OWN_PRESETS

        host = OWN_PRESETS[args.preset].rides_on
        if host != args.kv_cache_dtype:
            raise SystemExit(f"tqkv demo: --preset {args.preset} rides on {host}; add --kv-cache-dtype {host}")
        os.environ["TQKV_PRESET"] = args.preset  # the engine runs' environment, and stored_preset below
    # prompts of prompt-len + 7 i tokens (engine_run), then new-tokens: the engine must hold the longest
    longest = args.prompt_len + 7 * (args.prompts - 1) + args.new_tokens
    common = ["--kv-cache-dtype", args.kv_cache_dtype, "--dtype", args.dtype, "--prompts", str(args.prompts),
              "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
              "--max-model-len", str(max(512, -(-longest // 16) * 16)), "--timed-pairs", str(args.timed_pairs)]
    log_dir = tempfile.mkdtemp(prefix="tqkv-demo-")
    steps = 2 if args.no_baseline else 3
    _say(f"model {model}, cache {args.kv_cache_dtype}, {args.dtype} activations; {steps} vLLM runs, about a "
         "minute each")
    compiled = run_engine(f"[1/{steps}] compiled + tqkv pass", model, [*common, "--mode", "compiled"], log_dir)
    eager = run_engine(f"[2/{steps}] eager + tqkv ops", model, [*common, "--mode", "eager"], log_dir)
    plain = None
    if not args.no_baseline:
        plain_args = [*common, "--mode", "compiled", "--no-tqkv"]
        plain_args[1] = "auto"
        plain = run_engine(f"[3/{steps}] compiled, uncompressed cache", model, plain_args, log_dir)

    same, diff, _ = compare_logprobs(compiled, eager)
    rewritten = compiled["served_compiled"]
    from tqkv_compile.vllm.serving import stored_preset

    stored = stored_preset(args.kv_cache_dtype)  # a preset of ours (TQKV_PRESET) riding on the cache dtype
    per_token, per_token_bf16 = kv_bytes_per_token(model, stored, len(rewritten))
    summary = {
        "model": model,
        "kv_cache_dtype": args.kv_cache_dtype,
        "stored_preset": stored,
        "dtype": args.dtype,
        "layers_total": len(compiled["layers"]),
        "layers_rewritten": len(rewritten),
        "rewritten": rewritten,
        "memory_backend": compiled.get("memory_backend"),
        "fallbacks": compiled["fallbacks"],
        "pass_error": compiled["pass"]["error"],
        "tokens_match_eager": same,
        "max_logprob_diff": round(diff, 6),
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_token_bf16": per_token_bf16,
        "kv_capacity_tokens": compiled["kv_capacity_tokens"],
        "decode_tok_s_compiled": compiled["decode_tok_s"],
        "decode_tok_s_eager": eager["decode_tok_s"],
        "start_s_compiled": compiled["start_s"],
        "timed_pairs": args.timed_pairs,
        "max_context_tokens": longest,
    }
    if plain is not None:
        same_plain, diff_plain, agree_plain = compare_logprobs(compiled, plain)
        summary.update({
            "tokens_match_uncompressed": same_plain,
            "token_agreement_uncompressed": round(agree_plain, 4),
            "max_logprob_diff_uncompressed": round(diff_plain, 6),
            "decode_tok_s_uncompressed": plain["decode_tok_s"],
            "kv_capacity_tokens_uncompressed": plain["kv_capacity_tokens"],
        })
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary)
    # a run where tqkv served no layer (a model of 4 layers or fewer, an unknown vLLM, a preset that does not
    # ride on the cache dtype) shows nothing, however well the tokens agree
    return 0 if same and not summary["pass_error"] and summary["layers_rewritten"] else 1


def _print_summary(s: dict) -> None:
    stored = "" if s["stored_preset"] == s["kv_cache_dtype"] else f", stored as {s['stored_preset']}"
    print(f"\nModel {s['model']}  ({s['kv_cache_dtype']}{stored})")
    backend = f" (tqkv's {s['memory_backend']} backend)" if s["memory_backend"] else ""
    print(f"Attention layers: {s['layers_total']}, served by tqkv in the compiled graph: {s['layers_rewritten']}"
          f"{backend}")
    for name in s["rewritten"]:
        print(f"  rewritten  {name}")
    for name, reason in sorted(s["fallbacks"].items()):
        print(f"  vLLM path  {name}: {reason}")
    if s["pass_error"]:
        print(f"  the pass failed and left the graph as it was: {s['pass_error']}")
    if not s["layers_rewritten"]:
        print("  tqkv served no layer, so this run shows nothing (the reasons are above); exit status 1")
    print(f"Compiled vs eager (greedy): tokens {'match' if s['tokens_match_eager'] else 'DIFFER'}, "
          f"largest top-k logprob difference {s['max_logprob_diff']:.2e}")
    if "tokens_match_uncompressed" in s:
        print(f"Compiled vs vLLM's uncompressed cache: {100 * s['token_agreement_uncompressed']:.0f}% of tokens "
              f"before the first difference, largest top-k logprob difference up to it "
              f"{s['max_logprob_diff_uncompressed']:.3f}")
    ratio = s["kv_bytes_per_token_bf16"] / max(s["kv_bytes_per_token"], 1)
    print(f"KV bytes per token (all layers): {s['kv_bytes_per_token']} vs {s['kv_bytes_per_token_bf16']} in bf16 "
          f"({ratio:.2f}x smaller)")
    capacity = f"KV cache capacity vLLM reports: {s['kv_capacity_tokens']} tokens"
    if s.get("kv_capacity_tokens_uncompressed"):
        capacity += (f" vs {s['kv_capacity_tokens_uncompressed']} uncompressed "
                     f"({s['kv_capacity_tokens'] / s['kv_capacity_tokens_uncompressed']:.2f}x)")
    print(capacity)
    line = f"Decode tokens/s: compiled {s['decode_tok_s_compiled']}, eager {s['decode_tok_s_eager']}"
    if "decode_tok_s_uncompressed" in s:
        line += (f", uncompressed cache (vLLM) {s['decode_tok_s_uncompressed']} (compiled tqkv at "
                 f"{s['decode_tok_s_compiled'] / max(s['decode_tok_s_uncompressed'], 1e-9):.2f}x)")
    line += f"; each the median of {s['timed_pairs']} timed generate calls"
    print(line)
    if "decode_tok_s_uncompressed" in s:  # what the speed ratio can show at the demo's sizes
        print(f"  (the cache's speed shows with long contexts and many served layers: here {s['layers_rewritten']} of "
              f"{s['layers_total']} layers, contexts of at most {s['max_context_tokens']} tokens; `tqkv bench e2e` times "
              "real shapes: the README's results)")


def inspect(args: argparse.Namespace) -> int:
    from tqkv_compile.passes.graph_text import attention_blocks

    model = os.path.abspath(args.model) if args.model else builtin_model()
    check_model("inspect", model)
    log_dir = tempfile.mkdtemp(prefix="tqkv-inspect-")
    dump = os.path.join(log_dir, "graphs")
    result = run_engine("compiled + tqkv pass", model, ["--kv-cache-dtype", args.kv_cache_dtype, "--prompts", "1",
                        "--new-tokens", "2", "--graph-dump", dump], log_dir)
    files = sorted(os.listdir(dump)) if os.path.isdir(dump) else []
    pairs = [(f, f.replace("-before", "-after")) for f in files if f.endswith("-before.txt")]
    for before_file, after_file in pairs:
        before = open(os.path.join(dump, before_file)).read()
        after = open(os.path.join(dump, after_file)).read()
        if not args.full and not attention_blocks(before):
            continue
        for tag, text in (("before", before), ("after", after)):
            print(f"===== graph {tag} the tqkv pass =====")
            if args.full:
                print(text)
                continue
            for index, block in enumerate(attention_blocks(text)):
                print(f"# attention block {index} (graph order)\n{block}\n")
    print(f"===== rewritten: {len(result['pass']['rewritten'])} of {result['pass']['attention_nodes']} attention "
          f"layers; fallbacks: {json.dumps(result['pass']['fallbacks'])}")
    return 0
