"""``tqkv warm-fa2``: compile vLLM's FlashAttention-2 kernels for this GPU before an engine needs them.

vLLM 0.20 runs the layers a TurboQuant cache keeps uncompressed with FlashAttention-2, and its FA2 library has
native code for sm_80 only: on a Hopper GPU the CUDA driver compiles each FA2 module from PTX the first time it
runs, one module at a time per process (on an H200 16-143 s a module: ``bench/results/h200-fa2-first-call.json``),
so a new engine's first prefill and decode steps wait minutes. The driver keeps what it compiled in its JIT
cache (``CUDA_CACHE_PATH``, default ``~/.nv/ComputeCache``; ``CUDA_CACHE_MAXSIZE`` must hold it: 4 GB is set
here where unset). This runs the FA2 calls an engine makes (decode and prefill over the paged cache, prefill
over contiguous keys) for the given head sizes, each in its own process and several at once, so that the whole
set costs about its slowest module instead of the sum; later engines on the machine then find the modules
compiled (0.0-0.15 s a first launch). Where the GPU has native FA2 code, or there is no GPU or no vLLM FA2,
there is nothing to do and it says so.

    tqkv warm-fa2 [--head-sizes 128] [--jobs 8] [--timeout 900]

``tqkv bench e2e`` runs this first when a configuration has a TurboQuant cache (``--no-warm-fa2`` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Callable, Iterator

from tqkv_compile.children import kill_group, terminate_raises

CACHE_MAXSIZE = "4294967296"


def cases(head: int) -> Iterator[tuple]:
    """(label, q heads, kv heads, query lengths, context lengths, paged): decode over the paged cache (one new
    token per sequence: FA2 then runs its non-causal split-KV kernels), prefill over the paged cache (causal
    split-KV kernels), and prefill over contiguous K/V (vLLM's own TurboQuant prefill: the non-split kernels)."""
    groups = {64: (9, 3), 128: (32, 8), 256: (16, 8)}[head]
    yield "decode", *groups, [1] * 4, [176, 180, 184, 190], True
    yield "decode_long", *groups, [1] * 4, [4096] * 4, True
    yield "prefill", *groups, [176, 180, 184, 190], [176, 180, 184, 190], True
    yield "prefill_contiguous", *groups, [176, 180, 184, 190], [176, 180, 184, 190], False


HEAD_SIZES = (64, 128, 256)


def run_case(head: int, hq: int, hk: int, q_lens: list[int], k_lens: list[int], paged: bool, block: int = 16,
             launches: int = 2) -> list[float]:
    """``launches`` calls of vLLM's FA2 (bf16) on this case, each timed with a synchronize: the first one pays
    the driver's compile where the module is not in its cache."""
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    dev = torch.device("cuda")

    def cumulative(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)

    q = torch.randn(sum(q_lens), hq, head, device=dev, dtype=torch.bfloat16)
    if paged:
        blocks_per_seq = max(k_lens) // block + 1
        cache = torch.randn(2, len(k_lens) * blocks_per_seq, block, hk, head, device=dev, dtype=torch.bfloat16)
        table = torch.arange(len(k_lens) * blocks_per_seq, device=dev, dtype=torch.int32).view(len(k_lens), -1)
        kv = dict(k=cache[0], v=cache[1], block_table=table,
                  seqused_k=torch.tensor(k_lens, device=dev, dtype=torch.int32))
    else:
        keys = torch.randn(2, sum(k_lens), hk, head, device=dev, dtype=torch.bfloat16)
        kv = dict(k=keys[0], v=keys[1], cu_seqlens_k=cumulative(k_lens))
    out = torch.empty_like(q)
    times = []
    for _ in range(launches):
        t0 = time.perf_counter()
        flash_attn_varlen_func(q=q, out=out, cu_seqlens_q=cumulative(q_lens), max_seqlen_q=max(q_lens),
                               max_seqlen_k=max(k_lens), softmax_scale=head ** -0.5, causal=True, fa_version=2, **kv)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def needed() -> str | None:
    """Why FA2 should be warmed here (vLLM's FA2 has no native code for this GPU: the adapter's warning), or
    None where there is nothing to warm (native code, no CUDA GPU, no vLLM FA2 library, nothing readable)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from tqkv_compile.vllm import adapter

        return adapter.fa2_jit_warning(adapter.fa2_native_archs(), torch.cuda.get_device_capability(),
                                       os.environ.get("CUDA_CACHE_MAXSIZE"))
    except Exception:  # noqa: BLE001  (a diagnostic: an unreadable library means nothing is known)
        return None


def run_parallel(commands: list[list[str]], jobs: int, timeout: float, env: dict | None = None,
                 log: Callable[[str], None] = print) -> dict:
    """Run ``commands`` (each its own process group), at most ``jobs`` at once, all of them within ``timeout``
    seconds (what is still running then is killed, what has not started is not started; so on SIGTERM or
    Ctrl-C, before the exception goes on). Returns
    ``{"ran", "failed", "not_run", "seconds", "timed_out"}`` (failed: the commands' last argument, their label)."""
    waiting = list(commands)
    running: list[tuple[subprocess.Popen, list[str]]] = []
    failed: list[str] = []
    ran = 0
    started = time.monotonic()
    timed_out = False
    with terminate_raises():
        try:
            while waiting or running:
                if time.monotonic() - started > timeout:
                    timed_out = True
                    break
                while waiting and len(running) < jobs:
                    cmd = waiting.pop(0)
                    running.append((subprocess.Popen(cmd, env=env, start_new_session=True), cmd))
                time.sleep(0.2)
                still = []
                for proc, cmd in running:
                    if proc.poll() is None:
                        still.append((proc, cmd))
                        continue
                    ran += 1
                    if proc.returncode != 0:
                        failed.append(cmd[-1])
                    log(f"{cmd[-1]}: {'done' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'} "
                        f"at {time.monotonic() - started:.0f} s")
                running = still
        finally:  # timed out, interrupted or terminated: nothing left behind
            for proc, cmd in running:
                kill_group(proc)
                proc.wait()
                failed.append(cmd[-1])
    return dict(ran=ran, failed=failed, not_run=[c[-1] for c in waiting], seconds=round(time.monotonic() - started, 1),
                timed_out=timed_out)


def warm(head_sizes: list[int], jobs: int = 8, timeout: float = 900, force: bool = False,
         log: Callable[[str], None] = print) -> dict:
    """Compile vLLM's FA2 modules for ``head_sizes`` where this GPU needs it (:func:`needed`; ``force``: in any
    case), one process a case, ``jobs`` at once. Returns what :func:`run_parallel` returns, or
    ``{"skipped": why}``."""
    for head in head_sizes:
        if head not in HEAD_SIZES:
            raise ValueError(f"head size {head}: FA2 is warmed for {', '.join(map(str, HEAD_SIZES))}")
    if jobs < 1:
        raise ValueError(f"jobs: at least 1, got {jobs}")
    reason = needed()
    if reason is None and not force:
        return dict(skipped="this GPU runs vLLM's FA2 natively, or there is no CUDA GPU / vLLM FA2 here")
    labels = [f"{head}:{case[0]}" for head in head_sizes for case in cases(head)]
    log(f"compiling vLLM's FlashAttention-2 for head sizes {','.join(map(str, head_sizes))}: {len(labels)} "
        f"modules, {min(jobs, len(labels))} at a time (a module can take minutes)")
    env = dict(os.environ)
    env.setdefault("CUDA_CACHE_MAXSIZE", CACHE_MAXSIZE)
    commands = [[sys.executable, "-m", "tqkv_compile.vllm.fa2_warm", "--only", label] for label in labels]
    return run_parallel(commands, jobs, timeout, env=env, log=log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tqkv warm-fa2", description=__doc__.split("\n")[0])
    parser.add_argument("--head-sizes", default="128", help="comma-separated (64, 128, 256; default %(default)s)")
    parser.add_argument("--jobs", type=int, default=8, help="processes at once (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for all of it (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="run the calls even where no compile is expected")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # HEAD:CASE, one child's case
    args = parser.parse_args(argv)
    if args.only:
        head, label = args.only.split(":")
        case = next(c for c in cases(int(head)) if c[0] == label)
        first, second = run_case(int(head), *case[1:])
        print(json.dumps(dict(head=int(head), case=label, first_s=round(first, 3), second_s=round(second, 5))),
              flush=True)
        return 0
    try:
        heads = [int(h) for h in args.head_sizes.split(",") if h]
        result = warm(heads, args.jobs, args.timeout, args.force,
                      log=lambda msg: print(f"[tqkv warm-fa2] {msg}", file=sys.stderr, flush=True))
    except ValueError as exc:
        parser.error(str(exc))
    print(json.dumps(result))
    return 1 if result.get("failed") or result.get("timed_out") else 0


if __name__ == "__main__":
    sys.exit(main())
