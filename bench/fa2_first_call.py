"""Time vLLM's FlashAttention-2 on the calls an engine with a TurboQuant cache makes (its boundary layers).

vLLM 0.20 forces FlashAttention-2 whenever the cache is TurboQuant, and its FA2 library carries code for sm_80
only (plus sm_80 PTX; see tqkv_compile.vllm.fa2_native_archs): on an H200 (sm_90) the driver compiles each FA2
kernel module from PTX on its first launch. This script measures that: one JSON line per call, first and second
launch in this process. Run it twice (two processes): the second run's first launches show whether the
driver's JIT cache (``CUDA_CACHE_PATH``, ``CUDA_CACHE_MAXSIZE``) kept the compiled code.

usage: python bench/fa2_first_call.py [--head-sizes 64,128] [--jobs N] [--out FILE]

``--jobs N`` runs the cases in N processes at once: the driver compiles one module at a time per process, so on
a many-core host the first launches of all modules cost about the slowest one rather than their sum. (The cases
and the runner are ``tqkv_compile.vllm.fa2_warm``'s, which ``tqkv warm-fa2`` runs to compile them ahead.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from tqkv_compile.vllm.fa2_warm import cases, run_case, run_parallel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/fa2_first_call.py")
    p.add_argument("--head-sizes", default="64,128")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    p.add_argument("--jobs", type=int, default=1, help="cases run in this many processes at once")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # HEAD:CASE, for --jobs' children
    args = p.parse_args(argv)
    def emit(record: dict) -> None:  # line by line: a run cut by its time limit keeps what it measured
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    if args.only is None:  # the parent, once (--jobs' children only measure)
        from tqkv_compile.vllm.adapter import fa2_native_archs

        emit({"meta": dict(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                           fa2_native_archs=fa2_native_archs(), cuda_cache_path=os.environ.get("CUDA_CACHE_PATH"),
                           cuda_cache_maxsize=os.environ.get("CUDA_CACHE_MAXSIZE")),
              "jobs": args.jobs})
    if args.jobs > 1:  # one child process per case, at most --jobs at a time; they print and append their lines
        child = [sys.executable, __file__, "--head-sizes", args.head_sizes, *(["--out", args.out] if args.out else [])]
        labels = [f"{h}:{c[0]}" for h in map(int, args.head_sizes.split(",")) for c in cases(h)]
        result = run_parallel([[*child, "--only", label] for label in labels], args.jobs, timeout=float("inf"),
                              log=lambda msg: print(f"[fa2] {msg}", file=sys.stderr, flush=True))
        return 1 if result["failed"] else 0
    for head in (int(h) for h in args.head_sizes.split(",")):
        for label, hq, hk, q_lens, k_lens, paged in cases(head):
            if args.only and args.only != f"{head}:{label}":
                continue
            print(f"[fa2] head {head} {label}: first launch (a driver JIT compile can take minutes) ...",
                  file=sys.stderr, flush=True)
            first, second = run_case(head, hq, hk, q_lens, k_lens, paged)
            emit(dict(head=head, case=label, first_s=round(first, 3), second_s=round(second, 5),
                      parallel=bool(args.only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
