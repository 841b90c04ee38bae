"""Agreement on a real model: tqkv compiled (CUDA graphs, chunked prefill, prefix caching, n-gram speculative
decoding) against tqkv eager, and tqkv against vLLM's own TurboQuant path and the bf16 cache.

    python bench/agreement.py --model /tmp/smollm2 --real-weights --out bench/results/h200-agreement.json

Every run is one vLLM engine in its own process (tqkv_compile.vllm.engine_run) on the same prompts (random
token ids sharing a prefix, so that prefix caching has something to share, or text with --text), with top-5
logprobs. Teacher-forced by default: the first run to finish decodes greedily, later runs are forced onto its
tokens (tqkv_compile.vllm.forced_tokens), so all runs read the same text at every position. Free greedy runs
of two engines that differ only in rounding part at the first near-tie (SmolLM2 on random-id prompts, H200
2026-12-03: after 1-26% of 200 tokens) and say nothing after it. For each forced pair: the fraction of
positions where the two models' own first choices agree, and the largest and mean difference of the forced
token's logprob. Runs that cannot be forced (n-gram speculative decoding: vLLM takes no logits processor with
it) and --no-forced runs are compared free-running: whether the greedy tokens match, the fraction of generated
tokens before each sequence's first difference, and the largest top-k logprob difference up to it. Every run's
decode tok/s comes from its free greedy run (engine_run times it before the forced one). Runs that fail are
recorded with their error; the JSON is rewritten after every run, so a run that hangs loses nothing before it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from tqkv_compile.vllm.engine_runs import compare_forced, compare_logprobs, run_engine

# name -> engine_run arguments on top of the common ones (most important first: the order they run in)
RUNS = {
    "tqkv_eager": ["--mode", "eager"],
    "tqkv": ["--mode", "compiled"],
    "tqkv_full_graphs": ["--mode", "compiled", "--no-graph-partition"],
    "vllm_tq": ["--mode", "compiled", "--no-tqkv"],
    "vllm_tq_eager": ["--mode", "eager", "--no-tqkv"],
    "tqkv_ngram": ["--mode", "compiled", "--ngram", "3"],
    "tqkv_chunked": ["--mode", "compiled", "--max-num-batched-tokens", "64"],
    "tqkv_no_prefix_cache": ["--mode", "compiled", "--no-prefix-caching"],
    "bf16": ["--mode", "compiled", "--no-tqkv", "--kv-cache-dtype", "auto"],
}
# (a, b, what it shows)
PAIRS = [
    ("tqkv", "tqkv_eager", "compiled (CUDA graphs) vs eager, our ops"),
    ("tqkv_full_graphs", "tqkv_eager", "compiled without graph partition (full decode graphs) vs eager"),
    ("tqkv_ngram", "tqkv_eager", "n-gram speculative decoding, compiled, vs eager"),
    ("tqkv_chunked", "tqkv_eager", "chunked prefill (64-token steps), compiled, vs eager"),
    ("tqkv_no_prefix_cache", "tqkv", "prefix caching off vs on, compiled"),
    ("tqkv", "vllm_tq", "ours vs vLLM's own TurboQuant, both compiled"),
    ("tqkv_eager", "vllm_tq_eager", "ours vs vLLM's own TurboQuant, both eager"),
    ("vllm_tq", "vllm_tq_eager", "vLLM's own TurboQuant: compiled vs eager (its noise floor)"),
    ("tqkv", "bf16", "ours vs vLLM's bf16 cache"),
    ("vllm_tq", "bf16", "vLLM's own TurboQuant vs its bf16 cache"),
]


# Real text for the prompts (--text): a model's greedy continuation of random token ids sits on near-ties, so
# any two numerically different runs part within a few tokens; on text they agree long enough to compare.
# Jane Austen, Pride and Prejudice (1813), chapter 1 (public domain); the shared opening gives prefix caching
# something to share.
SHARED_TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
               "want of a wife. However little known the feelings or views of such a man may be on his first entering "
               "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
               "considered the rightful property of some one or other of their daughters. ")
PASSAGES = [
    "\"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard that Netherfield Park is let at last?\" "
    "Mr. Bennet replied that he had not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and she "
    "told me all about it.\" Mr. Bennet made no answer. \"Do you not want to know who has taken it?\" cried his "
    "wife impatiently. \"You want to tell me, and I have no objection to hearing it.\" This was invitation enough.",
    "\"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune from "
    "the north of England; that he came down on Monday in a chaise and four to see the place, and was so much "
    "delighted with it, that he agreed with Mr. Morris immediately; that he is to take possession before "
    "Michaelmas, and some of his servants are to be in the house by the end of next week.\"",
    "\"What is his name?\" \"Bingley.\" \"Is he married or single?\" \"Oh! Single, my dear, to be sure! A single "
    "man of large fortune; four or five thousand a year. What a fine thing for our girls!\" \"How so? How can it "
    "affect them?\" \"My dear Mr. Bennet,\" replied his wife, \"how can you be so tiresome! You must know that I am "
    "thinking of his marrying one of them.\"",
    "\"Is that his design in settling here?\" \"Design! Nonsense, how can you talk so! But it is very likely that he "
    "may fall in love with one of them, and therefore you must visit him as soon as he comes.\" \"I see no occasion "
    "for that. You and the girls may go, or you may send them by themselves, which perhaps will be still better, "
    "for as you are as handsome as any of them, Mr. Bingley may like you the best of the party.\"",
]


def text_prompts(model: str, count: int, path: str) -> str:
    """Token ids of ``count`` text prompts (the model folder's tokenizer) written to ``path`` as JSON."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer(SHARED_TEXT + PASSAGES[i % len(PASSAGES)])["input_ids"] for i in range(count)]
    Path(path).write_text(json.dumps(prompts))
    return path


def compare(a: dict, b: dict) -> dict:
    if a["tokens"] == b["tokens"] and (a.get("forced") or b.get("forced")) and "top1" in a and "top1" in b:
        return compare_forced(a, b)
    same, diff, agree = compare_logprobs(a, b)
    return dict(mode="free", tokens_match=same, prefix_agreement=round(agree, 4), topk_logprob_diff_max=round(diff, 5))


def _say(message: str) -> None:
    print(f"[agreement] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--real-weights", action="store_true")
    p.add_argument("--kv-cache-dtype", default="turboquant_4bit_nc")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--shared-prefix", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--text", action="store_true",
                   help="prompts from English text (the model folder's tokenizer) instead of random token ids")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated, of: " + ", ".join(RUNS))
    p.add_argument("--forced", action=argparse.BooleanOptionalAction, default=True,
                   help="force the runs after the first finished one onto its greedy tokens (default)")
    p.add_argument("--timeout", type=float, default=180, help="seconds per run")
    p.add_argument("--out", required=True)
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        p.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    common = ["--kv-cache-dtype", args.kv_cache_dtype, "--dtype", args.dtype, "--prompts", str(args.prompts),
              "--prompt-len", str(args.prompt_len), "--shared-prefix", str(args.shared_prefix),
              "--new-tokens", str(args.new_tokens), "--max-model-len", str(args.max_model_len)]
    if args.real_weights:
        common.append("--real-weights")
    # vLLM's compile cache would hand a later run an earlier run's graph (its key ignores e.g. prefix caching),
    # and then no pass runs to report what it rewrote
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    os.environ.setdefault("TQKV_STACK_DUMP_S", "60")  # a run that hangs shows where, in its log
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tqkv-agreement-")
    os.makedirs(log_dir, exist_ok=True)
    if args.text:
        try:
            common += ["--prompt-ids", text_prompts(args.model, args.prompts, os.path.join(log_dir, "prompts.json"))]
        except Exception as exc:  # noqa: BLE001  (no tokenizer: say so, and go on with random token ids)
            _say(f"--text: no tokenizer for {args.model} ({exc}); random token-id prompts instead")
    from tqkv_compile.run_meta import run_meta

    meta = run_meta("python bench/agreement.py " + " ".join(argv if argv is not None else sys.argv[1:]))["meta"]
    results: dict[str, dict] = {}
    summary: dict[str, dict] = {}
    forced_file = None
    for i, name in enumerate(runs, 1):
        argv_run = list(common)
        extra = RUNS[name]
        if "--kv-cache-dtype" in extra:  # the run's own cache dtype replaces the common one
            at = argv_run.index("--kv-cache-dtype")
            del argv_run[at:at + 2]
        if forced_file and "--ngram" not in extra:
            argv_run += ["--force-tokens", forced_file]
        try:
            result = run_engine(f"({i}/{len(runs)}) {name}", args.model, [*argv_run, *extra], log_dir,
                                timeout=args.timeout)
            results[name] = result
            Path(log_dir, f"{name}.json").write_text(json.dumps(result))  # tokens and logprobs, for later pairs
            if args.forced and forced_file is None and "--ngram" not in extra:  # the first run that ends
                forced_file = os.path.join(log_dir, "forced_tokens.json")
                Path(forced_file).write_text(json.dumps(result["tokens"]))
                meta["forced_by"] = name
            summary[name] = {k: result[k] for k in ("start_s", "decode_tok_s", "kv_capacity_tokens", "served_compiled",
                                                    "served_impl", "fallbacks", "forced")}
            summary[name]["rewritten"] = result["pass"]["rewritten"]
            summary[name]["pass_error"] = result["pass"]["error"]
        except Exception as exc:  # noqa: BLE001  (recorded; the other runs go on)
            summary[name] = {"error": str(exc)[-1500:]}
            _say(f"{name}: FAILED: {str(exc)[-600:]}")
        pairs = []
        for a, b, what in PAIRS:
            if a in results and b in results:
                pairs.append(dict(a=a, b=b, what=what, **compare(results[a], results[b])))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "runs": summary, "pairs": pairs}, indent=1) + "\n")
    for pair in pairs:
        how = (f"forced: first choices agree {pair['first_choice_agreement']:.3f}, forced token's logprob differs "
               f"{pair['forced_token_logprob_diff_mean']:.4f} on average, {pair['forced_token_logprob_diff_max']:.4f} "
               "at most" if pair["mode"] == "forced" else
               f"free: tokens {'match' if pair['tokens_match'] else 'DIFFER'}, {pair['prefix_agreement']:.3f} of them "
               f"before the first difference, top-k logprobs differ {pair['topk_logprob_diff_max']:.4f} at most")
        print(f"{pair['a']:>22s} vs {pair['b']:<14s} {how}  ({pair['what']})")
    return 0 if all("error" not in s for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
