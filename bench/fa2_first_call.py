"""Time vLLM's FlashAttention-2 on the calls an engine with a TurboQuant cache makes (its boundary layers).

vLLM 0.20 forces FlashAttention-2 whenever the cache is TurboQuant, and its FA2 library carries code for sm_80
only (plus sm_80 PTX; see tqkv_compile.vllm.fa2_native_archs): on an H200 (sm_90) the driver compiles each FA2
kernel module from PTX on its first launch. This script measures that: one JSON line per call, first and second
launch in this process. Run it twice (two processes): the second run's first launches show whether the
driver's JIT cache (``CUDA_CACHE_PATH``, ``CUDA_CACHE_MAXSIZE``) kept the compiled code.

usage: python bench/fa2_first_call.py [--head-sizes 64,128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _cases(head: int):
    """(label, q heads, kv heads, query lengths, context lengths): decode (one new token per sequence, where
    FA2 may split the context) and prefill, as in the engine's steps."""
    groups = {64: (9, 3), 128: (32, 8), 256: (16, 8)}[head]
    yield "decode", *groups, [1] * 4, [176, 180, 184, 190]
    yield "decode_long", *groups, [1] * 4, [4096] * 4
    yield "prefill", *groups, [176, 180, 184, 190], [176, 180, 184, 190]


def run_case(head: int, label: str, hq: int, hk: int, q_lens: list[int], k_lens: list[int], block: int = 16):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    dev = torch.device("cuda")
    blocks_per_seq = max(k_lens) // block + 1
    cache = torch.randn(2, len(k_lens) * blocks_per_seq, block, hk, head, device=dev, dtype=torch.bfloat16)
    table = torch.arange(len(k_lens) * blocks_per_seq, device=dev, dtype=torch.int32).view(len(k_lens), -1)
    q = torch.randn(sum(q_lens), hq, head, device=dev, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    seqused = torch.tensor(k_lens, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        flash_attn_varlen_func(q=q, k=cache[0], v=cache[1], out=out, cu_seqlens_q=cu_q, max_seqlen_q=max(q_lens),
                               seqused_k=seqused, max_seqlen_k=max(k_lens), softmax_scale=head ** -0.5, causal=True,
                               block_table=table, fa_version=2)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/fa2_first_call.py")
    p.add_argument("--head-sizes", default="64,128")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    args = p.parse_args(argv)
    import os

    from tqkv_compile.vllm.adapter import fa2_native_archs

    info = dict(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                fa2_native_archs=fa2_native_archs(), cuda_cache_path=os.environ.get("CUDA_CACHE_PATH"),
                cuda_cache_maxsize=os.environ.get("CUDA_CACHE_MAXSIZE"))
    lines = [json.dumps({"meta": info})]
    print(lines[-1], flush=True)
    for head in (int(h) for h in args.head_sizes.split(",")):
        for label, hq, hk, q_lens, k_lens in _cases(head):
            print(f"[fa2] head {head} {label}: first launch (a driver JIT compile can take minutes) ...",
                  file=sys.stderr, flush=True)
            first, second = run_case(head, label, hq, hk, q_lens, k_lens)
            lines.append(json.dumps(dict(head=head, case=label, first_s=round(first, 3), second_s=round(second, 5))))
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
