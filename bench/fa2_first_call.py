"""Time vLLM's FlashAttention-2 on the calls an engine with a TurboQuant cache makes (its boundary layers).

vLLM 0.20 forces FlashAttention-2 whenever the cache is TurboQuant, and its FA2 library carries code for sm_80
only (plus sm_80 PTX; see tqkv_compile.vllm.fa2_native_archs): on an H200 (sm_90) the driver compiles each FA2
kernel module from PTX on its first launch. This script measures that: one JSON line per call, first and second
launch in this process. Run it twice (two processes): the second run's first launches show whether the
driver's JIT cache (``CUDA_CACHE_PATH``, ``CUDA_CACHE_MAXSIZE``) kept the compiled code.

usage: python bench/fa2_first_call.py [--head-sizes 64,128] [--jobs N] [--out FILE]

``--jobs N`` runs the cases in N processes at once: the driver compiles one module at a time per process, so on
a many-core host the first launches of all modules cost about the slowest one rather than their sum.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def _cases(head: int):
    """(label, q heads, kv heads, query lengths, context lengths, paged): decode over the paged cache (one new
    token per sequence: FA2 then runs its non-causal split-KV kernels), prefill over the paged cache (causal
    split-KV kernels), and prefill over contiguous K/V (vLLM's own TurboQuant prefill: the non-split kernels)."""
    groups = {64: (9, 3), 128: (32, 8), 256: (16, 8)}[head]
    yield "decode", *groups, [1] * 4, [176, 180, 184, 190], True
    yield "decode_long", *groups, [1] * 4, [4096] * 4, True
    yield "prefill", *groups, [176, 180, 184, 190], [176, 180, 184, 190], True
    yield "prefill_contiguous", *groups, [176, 180, 184, 190], [176, 180, 184, 190], False


def _cumulative(lengths: list[int], dev) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)


def run_case(head: int, hq: int, hk: int, q_lens: list[int], k_lens: list[int], paged: bool, block: int = 16):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    dev = torch.device("cuda")
    q = torch.randn(sum(q_lens), hq, head, device=dev, dtype=torch.bfloat16)
    if paged:
        blocks_per_seq = max(k_lens) // block + 1
        cache = torch.randn(2, len(k_lens) * blocks_per_seq, block, hk, head, device=dev, dtype=torch.bfloat16)
        table = torch.arange(len(k_lens) * blocks_per_seq, device=dev, dtype=torch.int32).view(len(k_lens), -1)
        kv = dict(k=cache[0], v=cache[1], block_table=table,
                  seqused_k=torch.tensor(k_lens, device=dev, dtype=torch.int32))
    else:
        keys = torch.randn(2, sum(k_lens), hk, head, device=dev, dtype=torch.bfloat16)
        kv = dict(k=keys[0], v=keys[1], cu_seqlens_k=_cumulative(k_lens, dev))
    out = torch.empty_like(q)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        flash_attn_varlen_func(q=q, out=out, cu_seqlens_q=_cumulative(q_lens, dev), max_seqlen_q=max(q_lens),
                               max_seqlen_k=max(k_lens), softmax_scale=head ** -0.5, causal=True, fa_version=2, **kv)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


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
        import os

        from tqkv_compile.vllm.adapter import fa2_native_archs

        emit({"meta": dict(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                           fa2_native_archs=fa2_native_archs(), cuda_cache_path=os.environ.get("CUDA_CACHE_PATH"),
                           cuda_cache_maxsize=os.environ.get("CUDA_CACHE_MAXSIZE")),
              "jobs": args.jobs})
    if args.jobs > 1:
        return _run_in_parallel(args)
    for head in (int(h) for h in args.head_sizes.split(",")):
        for label, hq, hk, q_lens, k_lens, paged in _cases(head):
            if args.only and args.only != f"{head}:{label}":
                continue
            print(f"[fa2] head {head} {label}: first launch (a driver JIT compile can take minutes) ...",
                  file=sys.stderr, flush=True)
            first, second = run_case(head, hq, hk, q_lens, k_lens, paged)
            emit(dict(head=head, case=label, first_s=round(first, 3), second_s=round(second, 5),
                      parallel=bool(args.only)))
    return 0


def _run_in_parallel(args: argparse.Namespace) -> int:
    """One child process per case, at most ``args.jobs`` at a time; they print and append their own lines."""
    child = [sys.executable, __file__, "--head-sizes", args.head_sizes, *(["--out", args.out] if args.out else [])]
    waiting = [f"{h}:{c[0]}" for h in map(int, args.head_sizes.split(",")) for c in _cases(h)]
    running: list[subprocess.Popen] = []
    failed = 0
    while waiting or running:
        while waiting and len(running) < args.jobs:
            running.append(subprocess.Popen([*child, "--only", waiting.pop(0)]))
        time.sleep(0.2)
        failed += sum(r.returncode != 0 for r in running if r.poll() is not None)
        running = [r for r in running if r.returncode is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
