"""vLLM engines run in child processes (:mod:`tqkv_compile.vllm.engine_run`) and their outputs compared: what the
demo and the agreement runs are made of."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time


def _say(message: str) -> None:
    print(f"[tqkv] {message}", file=sys.stderr, flush=True)


def run_engine(label: str, model: str, argv: list[str], log_dir: str, timeout: float | None = None) -> dict:
    """One engine run in a child process, with a heartbeat while vLLM starts; returns its result dict.
    ``timeout``: seconds, after which the child is killed and this raises."""
    log_path = os.path.join(log_dir, re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") + ".log")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the demo runs the CPU's PyTorch backend, not interpreted kernels
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    command = [sys.executable, "-m", "tqkv_compile.vllm.engine_run", "--model", model, *argv]
    _say(f"{label}: starting vLLM (log: {log_path})")
    started = time.monotonic()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        while True:
            try:
                child.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                _say(f"{label}: {time.monotonic() - started:.0f} s ...")
                if timeout is not None and time.monotonic() - started > timeout:
                    child.kill()
                    child.wait()
                    break
    with open(log_path) as log:
        lines = log.read().splitlines()
    results = [line for line in lines if line.startswith("TQKV_RESULT ")]
    if child.returncode != 0 or not results:
        tail = "\n".join(lines[-25:])
        raise RuntimeError(f"{label}: the vLLM run failed (exit {child.returncode}); last lines of {log_path}:\n{tail}")
    _say(f"{label}: done in {time.monotonic() - started:.0f} s")
    return json.loads(results[-1].split(" ", 1)[1])


def compare_logprobs(a: dict, b: dict) -> tuple[bool, float, float]:
    """(same greedy tokens, largest |logprob difference| over the tokens both runs report in their top-k,
    fraction of generated tokens before each sequence's first differing token). Logprobs are compared up to
    and including each sequence's first differing step (after it the two runs see different text)."""
    same, largest, agree, total = True, 0.0, 0, 0
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        total += len(ta)
        for step, (x, y) in enumerate(zip(ta, tb)):
            for token in set(la[step]) & set(lb[step]):
                if math.isfinite(la[step][token]) and math.isfinite(lb[step][token]):
                    largest = max(largest, abs(la[step][token] - lb[step][token]))
            if x != y:
                same = False
                break
            agree += 1
    return same, largest, agree / max(total, 1)


def compare_forced(a: dict, b: dict) -> dict:
    """Two runs on the same tokens: the fraction of positions where their first choices agree, and the largest /
    mean |difference| of the token's logprob."""
    agree = total = 0
    diffs = []
    for ids, top_a, top_b, la, lb in zip(a["tokens"], a["top1"], b["top1"], a["logprobs"], b["logprobs"]):
        for step, token in enumerate(ids):
            total += 1
            agree += top_a[step] == top_b[step]
            x, y = la[step].get(str(token)), lb[step].get(str(token))
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y):
                diffs.append(abs(x - y))
    return dict(mode="forced", positions=total, first_choice_agreement=round(agree / max(total, 1), 4),
                forced_token_logprob_diff_max=round(max(diffs, default=0.0), 5),
                forced_token_logprob_diff_mean=round(sum(diffs) / max(len(diffs), 1), 5))
