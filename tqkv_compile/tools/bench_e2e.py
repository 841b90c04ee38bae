"""End-to-end decode benchmark: the real vLLM engine, one configuration per process, every case in it.

    tqkv bench e2e --out bench/results/h200-e2e.json --plot bench/results/h200-e2e.png       # GPU defaults
    tqkv bench e2e --model DIR --configs bf16,tqkv:turboquant_4bit_nc --cases 2x64x8         # anything smaller

Configurations (``--configs``): ``bf16`` (vLLM's default cache), ``fp8``, ``vllm_tq:<preset>`` (vLLM's own
TurboQuant path), ``tqkv:<preset>`` (the same cache, our pass, compiled: vLLM's default mode, CUDA graphs on a
GPU), ``tqkv_eager:<preset>`` (our ops without compilation). Cases ``BxPxN``: B prompts of P tokens, N new
tokens each (N >= 3). Weights are vLLM's dummy weights; the default model is the Llama-3-8B shape (32 layers,
32 / 8 heads, head 128), written as a config-only folder.

Per case, after a warm-up on other prompts (decode steps included; twice, so that the second run takes the
prefix-cached path the timed runs take), on B fresh prompts P:

- ``prefill_s``: one token on P (the whole prefill of B x P tokens, one sampling step);
- ``decode_tok_s``: P again, two tokens (t_short) and N tokens (t_long); ``B * (N - 2) / (t_long - t_short)``,
  from the median of ``--repeats`` such pairs (default 3; every pair's step time is kept in
  ``decode_step_ms_runs``: the spread).
  The first run left P in vLLM's prefix cache (on by default), so each of these recomputes only the prompts'
  last block and then runs decode steps of the whole batch: the difference is N - 2 pure decode steps, without
  the prefill's time or noise and without steps that mix prefill and decode. ``decode_step_ms`` is one such
  step, ``(t_long - t_short) / (N - 2)``. ``prefix_cached_decode`` says whether prefix caching was on and
  ``cached_prompt_tokens`` how many prompt tokens the N-token run found cached (mean per prompt, where vLLM
  reports it). With prefix caching off the difference still holds (both runs pay the same full prefill), with
  more noise;
- the engine start time and the KV capacity vLLM reports (tokens).

``--profile DIR`` runs one more generate per case after the timed ones (P again: the last block's prefill and
min(N, 16) - 1 decode steps) under ``torch.profiler`` and writes ``DIR/<config>-<case>.txt`` (the
``key_averages`` table, top 40 by device time, CPU time without a GPU) and ``DIR/<config>-<case>.json`` (the
same rows: name, count, total and self device and CPU times in us), config with ``:`` and the like as ``_``.

Each configuration's engine runs in a child process (``--worker``): vLLM keeps per-process state, and a crash
or out-of-memory in one configuration is recorded as that configuration's error, not the benchmark's end.
Progress goes to stderr, while each configuration runs too (the child's stages: engine started, each case's
warm-up, prefill and timed pairs); a configuration that fails or passes ``--timeout`` is recorded with the last
stage it reached and the end of its log, progress bars left out; records (and a ``{"meta": ...}`` record) to
``--out`` as a JSON list. Before the first configuration with a TurboQuant cache, on a GPU vLLM's
FlashAttention-2 has no native code for (Hopper), its modules are compiled ahead, several at once
(``tqkv warm-fa2``; the result in the meta record as ``fa2_warm``; ``--no-warm-fa2`` skips it). The tqkv ops'
value checks (host syncs) are off while timing unless ``--check-values``. With dummy weights vLLM's own
TurboQuant path runs with overwritten centroids (its dummy loader fills every buffer): fine for speed, not for
comparing outputs; agreement is checked with a real model (SmolLM2), not here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqkv_compile.argtypes import plot_path
from tqkv_compile.children import kill_group, terminate_raises

DEFAULT_CONFIGS = ["bf16", "fp8", "vllm_tq:turboquant_4bit_nc", "tqkv:turboquant_4bit_nc",
                   "tqkv_eager:turboquant_4bit_nc"]
DEFAULT_CASES = [(64, 4096, 128), (1, 32768, 128)]
LLAMA3_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001,
}
QWEN25_7B_SHAPE = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
MODEL_SHAPES = {"llama3-8b": LLAMA3_8B_SHAPE, "qwen2.5-7b": QWEN25_7B_SHAPE}  # config-only, dummy weights


def _log(msg: str) -> None:
    print(f"[tqkv bench e2e] {msg}", file=sys.stderr, flush=True)


STAGE = "TQKV_E2E_STAGE "  # the child's progress lines on stdout (the parent logs them as they come)
_BAR = re.compile(r"\d+%\|")  # a tqdm progress bar (vLLM's CUDA graph capture, compilation, loading)


def _stage(msg: str) -> None:
    print(STAGE + msg, flush=True)


def log_tail(text: str, chars: int = 400) -> str:
    """The end of a child's log for an error record: each line as a terminal shows it (the text after its last
    carriage return), progress-bar lines and blank lines left out, the last ``chars`` characters."""
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
    kept = [line for line in lines if line.strip() and not _BAR.search(line)]
    return "\n".join(kept)[-chars:]


def parse_config(config: str) -> dict:
    """``bf16`` / ``fp8`` / ``vllm_tq:P`` / ``tqkv:P`` / ``tqkv_eager:P`` -> engine settings; ValueError otherwise."""
    from tqkv_compile.codec import PRESETS, own_preset_names

    kind, _, preset = config.partition(":")
    if kind in ("bf16", "fp8") and not preset:
        return dict(kv_cache_dtype="auto" if kind == "bf16" else "fp8", tqkv=False, eager=False, own=None)
    if kind in ("vllm_tq", "tqkv", "tqkv_eager") and preset:
        own = None
        if preset in own_preset_names():
            from tqkv_compile.codec import OWN_PRESETS

            own, preset = preset, OWN_PRESETS[preset].rides_on
            if kind == "vllm_tq":
                raise ValueError(f"config {config!r}: vLLM does not know presets of ours")
        if preset not in PRESETS:
            raise ValueError(f"config {config!r}: unknown TurboQuant preset {preset!r}")
        return dict(kv_cache_dtype=preset, tqkv=kind != "vllm_tq", eager=kind == "tqkv_eager", own=own)
    raise ValueError(f"config {config!r}: expected bf16, fp8, vllm_tq:<preset>, tqkv:<preset> or tqkv_eager:<preset>")


_TOKENS = re.compile(r"(\d+)(k?)")


def _tokens(text: str) -> int | None:
    """``4096`` or ``4k`` (x 1024) -> tokens; None where it is neither."""
    match = _TOKENS.fullmatch(text)
    return None if match is None else int(match[1]) * (1024 if match[2] else 1)


def parse_cases(text: str) -> list[tuple]:
    """``BxPxN,...`` -> [(B, P, N), ...]: B prompts of P tokens, N new tokens each. P is a count (``4096`` or
    ``4k``) or a range ``LO-HI`` (``1k-8k``: ragged prompts, lengths spread evenly over it, see
    :func:`prompt_lengths`), kept as the string ``"1024-8192"``. ValueError for anything else, and for N < 3
    (decode speed is the difference of a 2-token and an N-token run)."""
    cases = []
    for item in filter(None, text.split(",")):
        parts = item.split("x")
        bounds = [_tokens(p) for p in parts[1].split("-")] if len(parts) == 3 else [None]
        if len(parts) != 3 or not (parts[0].isdigit() and parts[2].isdigit()) or len(bounds) > 2 or \
                None in bounds or min(int(parts[0]), int(parts[2]), *bounds) <= 0:
            raise ValueError(f"case {item!r}: expected BxPxN with positive integers, P a count or a range LO-HI "
                             "(ragged prompts), e.g. 64x4096x128 or 64x1k-8kx128")
        if int(parts[2]) < 3:
            raise ValueError(f"case {item!r}: N must be at least 3 (decode speed is the N-token run minus the "
                             f"2-token run)")
        if len(bounds) == 2 and bounds[0] > bounds[1]:
            raise ValueError(f"case {item!r}: the prompt range {parts[1]} runs backwards")
        prompt = bounds[0] if len(bounds) == 1 or bounds[0] == bounds[1] else f"{bounds[0]}-{bounds[1]}"
        cases.append((int(parts[0]), prompt, int(parts[2])))
    if not cases:
        raise ValueError("cases: none given")
    return cases


def prompt_lengths(batch: int, prompt) -> list[int]:
    """A case's prompt lengths: ``batch`` x P, or for a range ``"LO-HI"`` lengths spread evenly from LO to HI
    (both ends included) in a fixed shuffled order, so that long and short prompts share the batch."""
    if isinstance(prompt, int):
        return [prompt] * batch
    low, high = map(int, prompt.split("-"))
    lengths = [round(low + (high - low) * i / max(batch - 1, 1)) for i in range(batch)]
    import random

    random.Random(batch).shuffle(lengths)
    return lengths


def longest_prompt(prompt) -> int:
    """P, or HI of a range ``"LO-HI"``."""
    return prompt if isinstance(prompt, int) else int(prompt.split("-")[1])


def _case_key(case: tuple) -> tuple:
    """A sort key for (B, P, N) cases whose P may be a range string."""
    b, p, n = case
    return (b, longest_prompt(p), str(p), n)


def default_model(folder: Path, shape: str = "llama3-8b") -> str:
    """A config-only model folder of one of :data:`MODEL_SHAPES` (dummy weights need no checkpoint)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MODEL_SHAPES[shape], indent=1))
    return str(folder)


# -- the child: one engine, every case --------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    settings = parse_config(args.worker)
    cases = parse_cases(args.cases)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    import tqkv_compile.vllm as tqkv_vllm

    longest = max(longest_prompt(p) + n for _, p, n in cases)
    kwargs = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True,
                  kv_cache_dtype=settings["kv_cache_dtype"], max_model_len=longest + 16, seed=0,
                  max_num_seqs=max(b for b, _, _ in cases), dtype=args.dtype,
                  enforce_eager=settings["eager"] or args.enforce_eager)
    if args.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if settings["tqkv"]:
        if settings["eager"] or args.enforce_eager:
            tqkv_vllm.enable(settings["own"])
        else:
            kwargs["compilation_config"] = tqkv_vllm.compilation_config(preset=settings["own"])
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    cache = llm.llm_engine.vllm_config.cache_config
    capacity = int(cache.num_gpu_blocks or 0) * int(cache.block_size)
    _stage(f"engine started in {start_s:.0f} s, KV capacity {capacity} tokens")
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    import random

    def tokens(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def timed(prompts: list, n: int) -> tuple[float, list]:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, tokens(n), use_tqdm=False)
        return time.perf_counter() - t0, outputs

    for B, P, N in cases:
        case = f"{B}x{P}x{N}"
        _stage(f"{case}: warm-up")  # (the first decode steps load or compile their kernels)
        rng = random.Random(B * 1_000_003 + sum(prompt_lengths(B, P)))
        lengths = prompt_lengths(B, P)
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in lengths]
        # warm-up, decode steps included: what the first decode step compiles or loads (our kernels' decode
        # variants; vLLM 0.20's FA2 decode module, compiled from PTX on sm_90) stays out of the timing
        llm.generate(prompts, tokens(3), use_tqdm=False)
        # and once more on the same prompts, now in the prefix cache: the path the timed runs take (the last
        # block's prefill over a cached prefix, then decode). Its first use costs ~1 s in the tqkv engine (the
        # first timed pair's 2-token run took that much longer than the later ones)
        llm.generate(prompts, tokens(3), use_tqdm=False)
        # fresh prompts: the prefill is timed whole, and leaves them in the prefix cache for the decode runs
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in lengths]
        _stage(f"{case}: prefill")
        prefill_s, _ = timed(prompts, 1)
        _stage(f"{case}: prefill {prefill_s:.2f} s")
        pairs = []
        for i in range(args.repeats):  # short and long alternate: a drift of the machine hits both alike
            short_s, _ = timed(prompts, 2)
            long_s, outputs = timed(prompts, N)
            pairs.append((short_s, long_s))
            _stage(f"{case}: timed pair {i + 1}/{args.repeats}: {1000 * (long_s - short_s) / (N - 2):.3f} ms a step")
        try:
            rate = decode_rate(pairs, B, N)
        except ValueError as exc:  # nothing to divide by: this case's error, not a meaningless rate
            print("TQKV_E2E " + json.dumps(dict(config=args.worker, B=B, P=P, N=N, error=str(exc))), flush=True)
            continue
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        cached = [o.num_cached_tokens for o in outputs if getattr(o, "num_cached_tokens", None) is not None]
        record = dict(config=args.worker, B=B, P=P, N=N, **rate, prefill_s=round(prefill_s, 4),
                      prefix_cached_decode=bool(cache.enable_prefix_caching),
                      cached_prompt_tokens=round(sum(cached) / len(cached), 1) if cached else None,
                      start_s=round(start_s, 2), kv_capacity_tokens=capacity, generated_tokens=generated)
        print("TQKV_E2E " + json.dumps(record), flush=True)
        if args.profile:  # after the timed runs: they stay as they are
            _profile(llm, prompts, tokens(min(N, 16)), Path(args.profile), f"{_safe(args.worker)}-{B}x{P}x{N}")
    return 0


def decode_rate(pairs: list[tuple[float, float]], B: int, N: int) -> dict:
    """From (t_short, t_long) pairs (2 and N tokens on the same prefix-cached prompts): decode_step_ms (the
    median over pairs of (t_long - t_short) / (N - 2); with an even count the mean of the middle two),
    decode_tok_s (B per step), and every pair's step time (decode_step_ms_runs) so that the spread is on
    record. An odd pair (say a 2-token run that paid a one-time cost) does not decide the result; ValueError
    when the median step is not positive (nothing to divide by)."""
    if not pairs:
        raise ValueError("no timed runs")
    steps = [(l - s) / (N - 2) for s, l in pairs]
    runs = [round(step * 1000, 3) for step in steps]
    median = statistics.median(steps)
    if median <= 0:
        raise ValueError(f"the {N}-token runs were not slower than the 2-token runs (step ms per pair: {runs}); "
                         "was something else running on this machine?")
    return dict(decode_tok_s=round(B / median, 1), decode_step_ms=round(median * 1000, 3), decode_step_ms_runs=runs)


def _safe(name: str) -> str:
    """A configuration name as a file name: anything but letters, digits, ``.``, ``_``, ``-`` as ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _profile(llm, prompts: list, params, folder: Path, stem: str, rows: int = 40) -> None:
    """One generate under ``torch.profiler``: ``folder/stem.txt`` (the key_averages table) and ``stem.json``
    (its top rows), sorted by device time with a GPU, CPU time without."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _log(f"profiling {stem}: {len(prompts)} prompts, {params.max_tokens} tokens")
    with profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.txt").write_text(
        averages.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=rows) + "\n")

    top = sorted(averages, key=lambda e: e.device_time_total if cuda else e.cpu_time_total, reverse=True)[:rows]
    (folder / f"{stem}.json").write_text(json.dumps(dict(
        sort_by="device_time_total" if cuda else "cpu_time_total", max_tokens=params.max_tokens,
        prompts=len(prompts),
        rows=[dict(name=e.key, count=e.count, device_time_total_us=round(e.device_time_total, 1),
                   self_device_time_total_us=round(e.self_device_time_total, 1),
                   cpu_time_total_us=round(e.cpu_time_total, 1),
                   self_cpu_time_total_us=round(e.self_cpu_time_total, 1)) for e in top]), indent=1) + "\n")
    _log(f"profile written: {folder / stem}.txt, .json")


# -- the parent -------------------------------------------------------------------------------------------


WARM_FA2_TIMEOUT = 240  # s: the slowest module took 127 s on an H200 with 8 compiling at once; past this the
# engine compiles what is left itself, and the configuration keeps its own --timeout


def _write(out: str | None, records: list[dict]) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(records, indent=1) + "\n")


def _warm_fa2(model: str, timeout: float) -> dict:
    """``tqkv warm-fa2`` for the model's head size, before the first engine with a TurboQuant cache: where this
    GPU has no native code in vLLM's FA2 (its boundary layers' kernels), that engine would otherwise compile
    them one by one in its first steps (minutes; on an H100 the first such engine of a bare machine passed a
    330 s limit). Never in the way of the benchmark: any error is recorded and the configurations run."""
    from tqkv_compile.model_config import model_shape
    from tqkv_compile.vllm import fa2_warm

    try:
        head = model_shape(model)[2]
        result = fa2_warm.warm([head], jobs=min(8, os.cpu_count() or 1), timeout=timeout,
                               log=lambda msg: _log(f"warm-fa2: {msg}"))
    except Exception as exc:  # noqa: BLE001
        result = dict(error=f"{type(exc).__name__}: {exc}")
    if "skipped" not in result:
        _log(f"warm-fa2: {json.dumps(result)}")
    return result


def _run_config(config: str, args: argparse.Namespace, model: str) -> list[dict]:
    cmd = [sys.executable, "-m", "tqkv_compile.tools.bench_e2e", "--worker", config, "--model", model,
           "--cases", args.cases, "--dtype", args.dtype, "--repeats", str(args.repeats)]
    for flag in ("gpu_memory_utilization", "max_num_batched_tokens", "profile"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    env = dict(os.environ)
    # keep what the CUDA driver compiles from PTX (vLLM 0.20's FA2 on sm_90) for the next configurations
    env.setdefault("CUDA_CACHE_MAXSIZE", "4294967296")
    from tqkv_compile.vllm import ENABLE_ENV, PRESET_ENV

    env.pop(ENABLE_ENV, None)
    env.pop(PRESET_ENV, None)
    if not args.check_values:  # the ops' value checks sync with the host per layer and step: off for timing
        env["TQKV_CHECK_VALUES"] = "0"
    started = time.perf_counter()
    stages: list[str] = []

    def on_stdout(line: str) -> None:  # the child's progress, logged as it comes
        if line.startswith(STAGE):
            stages.append(line[len(STAGE):].rstrip())
            _log(f"{config}: {stages[-1]} ({time.perf_counter() - started:.0f} s)")

    stdout, stderr, code = _run_child(cmd, env, args.timeout, on_stdout)
    if code is None:
        status = f"timed out after {args.timeout} s"
    elif code < 0:
        status = f"killed by signal {-code}" + (" (SIGKILL: out of host memory?)" if code == -9 else "")
    else:
        status = f"exit {code}"
    records = [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("TQKV_E2E ")]
    if code != 0 or not records:
        status += f", last stage: {stages[-1] if stages else 'starting the engine'}"
        tail = log_tail(stderr or stdout, 1500)
        _log(f"{config}: FAILED ({status}) after {time.perf_counter() - started:.0f} s:\n{tail}")
        done = {(r["B"], r["P"], r["N"]) for r in records}
        return records + [dict(config=config, B=B, P=P, N=N, error=f"{status}\n{tail[-400:]}")
                          for B, P, N in parse_cases(args.cases) if (B, P, N) not in done]
    return records


def _run_child(cmd: list[str], env: dict, timeout: float, on_stdout) -> tuple[str, str, int | None]:
    """Run ``cmd`` in its own process group; ``on_stdout`` sees each stdout line as it comes. Returns (stdout,
    stderr, exit code), the code None where the child passed ``timeout`` seconds. The group is killed when the
    child ends, however it ends (what it left running, say a compile worker holding the pipes or GPU memory,
    goes with it; so does the child itself when this process is interrupted or terminated), and what it printed until then is
    kept, carriage returns included (``log_tail`` reads them as a terminal would)."""
    import io
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    out: list[str] = []
    err: list[str] = []

    def pump(pipe, sink, each=None):
        for line in io.TextIOWrapper(pipe, encoding="utf-8", errors="replace", newline=""):  # "\r" kept
            sink.append(line)
            if each is not None:
                try:
                    each(line)
                except Exception:  # noqa: BLE001  (progress only: the pipe must keep draining)
                    pass

    readers = [threading.Thread(target=pump, args=(proc.stdout, out, on_stdout), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, err), daemon=True)]
    for reader in readers:
        reader.start()

    try:
        with terminate_raises():
            code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    except BaseException:  # interrupted (Ctrl-C, SIGTERM: a shell's timeout): the engine must not outlive us
        kill_group(proc)
        proc.wait()
        raise
    kill_group(proc)
    proc.wait()
    deadline = time.monotonic() + 10
    for reader in readers:
        reader.join(timeout=max(0.0, deadline - time.monotonic()))
    return "".join(out), "".join(err), code


def _meta(argv: list[str], model: str) -> dict:
    from tqkv_compile.run_meta import run_meta

    return run_meta("tqkv bench e2e " + " ".join(argv), model=model)


def summary(records: list[dict]) -> str:
    rows = [r for r in records if "config" in r]
    lines = [f"{'config':36s} {'case':>16s} {'decode tok/s':>13s} {'step ms':>9s} {'prefill s':>10s} {'start s':>8s} "
             f"{'KV tokens':>11s}"]
    for r in rows:
        case = f"{r['B']}x{r['P']}x{r['N']}"
        if "error" in r:
            lines.append(f"{r['config']:36s} {case:>16s}  error: {_error_line(r['error'])}")
        else:
            step = r.get("decode_step_ms")  # absent in records of the old measurement (older result files)
            lines.append(f"{r['config']:36s} {case:>16s} {r['decode_tok_s']:13.1f} "
                         f"{'-' if step is None else f'{step:.3f}':>9s} {r['prefill_s']:10.3f} "
                         f"{r['start_s']:8.1f} {r['kv_capacity_tokens']:11d}")
    return "\n".join(lines)


def _error_line(error: str) -> str:
    """An error record in one line: its first line (a failed child's status: exit code or time-out, and the last
    stage) and, where there are more, its last (the log's end), each cut to fit."""
    lines = error.splitlines() or [""]
    return lines[0][:160] if len(lines) == 1 else f"{lines[0][:90]} | {lines[-1][:110]}"


def plot(records: list[dict], path: str) -> None:
    """Bar chart: decode tokens/s per configuration, one group per case (matplotlib, imported here); no chart,
    and a line that says so, where no case has a rate."""
    rows = [r for r in records if "decode_tok_s" in r]
    if not rows:
        _log(f"no chart ({path}): no configuration measured a case")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["B"], r["P"], r["N"]) for r in rows}, key=_case_key)
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        values = [next((r["decode_tok_s"] for r in rows if r["config"] == c and (r["B"], r["P"], r["N"]) == case),
                       None) for c in configs]
        bars = ax.bar(range(len(configs)), [v or 0 for v in values], color=[f"C{i}" for i in range(len(configs))])
        top = max(v or 0 for v in values)
        for bar, v in zip(bars, values):  # the figure on each bar; a configuration without this case says so
            ax.text(bar.get_x() + bar.get_width() / 2, (v or 0) + 0.01 * top, "not run" if v is None else f"{v:g}",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(configs)), configs, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"batch {case[0]}, prompt {case[1]}, {case[2]} new")
        ax.set_ylabel("decode tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="tqkv bench e2e", description=__doc__.split("\n")[0],
        epilog="decode tok/s = B * (N - 2) / (t(N tokens) - t(2 tokens)), the median over --repeats such pairs, "
               "both runs on prompts already prefilled once (vLLM's prefix cache: each recomputes only the last "
               "block), so the difference is N - 2 decode steps of the whole batch, without prefill or mixed "
               "prefill+decode steps; decode_step_ms is one such step. prefill s: one token on fresh prompts. With "
               "prefix caching off both runs pay the same prefill and the difference still holds.")
    parser.add_argument("--model", help="model folder (config.json is enough) or a shape of dummy weights: "
                                         f"{', '.join(MODEL_SHAPES)} (default: llama3-8b)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help="comma-separated configurations: bf16, fp8, vllm_tq:<preset> (vLLM's TurboQuant), "
                             "tqkv:<preset> (compiled with tqkv's pass), tqkv_eager:<preset> (tqkv's ops, no "
                             "compilation); default %(default)s")
    parser.add_argument("--cases", default=",".join(f"{b}x{p}x{n}" for b, p, n in DEFAULT_CASES),
                        help="comma-separated BxPxN cases (batch x prompt tokens x new tokens; P a range LO-HI for "
                             "ragged prompts, e.g. 64x1k-8kx128); default %(default)s")
    parser.add_argument("--dtype", default="bfloat16", help="activation dtype (vLLM's --dtype; default %(default)s)")
    parser.add_argument("--enforce-eager", action="store_true", help="every configuration without compilation")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM's share of GPU memory (default: vLLM's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="vLLM's token budget a step (smaller than a prompt: chunked prefill; default: vLLM's)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="(2-token, N-token) run pairs per case; the median step time is reported, every "
                             "pair's in decode_step_ms_runs (default 3)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per configuration (default %(default)s)")
    parser.add_argument("--check-values", action="store_true",
                        help="keep the tqkv ops' value checks (host syncs) on while timing")
    parser.add_argument("--out", help="JSON path for the records")
    parser.add_argument("--plot", type=plot_path, help="PNG path: decode tokens/s per configuration and case")
    parser.add_argument("--profile", metavar="DIR",
                        help="after each case's timed runs, profile one more decode run (min(N, 16) tokens) with "
                             "torch.profiler: DIR/<config>-<case>.txt (top 40 ops) and .json")
    parser.add_argument("--no-warm-fa2", action="store_true",
                        help="do not compile vLLM's FlashAttention-2 ahead (``tqkv warm-fa2``) before the first "
                             "TurboQuant configuration on a GPU it has no native code for")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.repeats < 1:
            raise ValueError(f"--repeats: at least 1, got {args.repeats}")
        parse_cases(args.cases)
        configs = [c for c in args.configs.split(",") if c]
        for c in configs:
            parse_config(c)
    except ValueError as exc:
        parser.error(str(exc))
    if args.worker:
        return worker(args)
    shape = args.model or "llama3-8b"
    if shape in MODEL_SHAPES:
        model = default_model(Path(tempfile.gettempdir()) / f"tqkv-{shape}-shape", shape)
    elif Path(shape, "config.json").is_file():
        model = shape
    else:
        parser.error(f"--model {shape}: neither a model folder with a config.json nor one of "
                     f"{', '.join(MODEL_SHAPES)}")
    records: list[dict] = [_meta(argv, model)]
    if not args.no_warm_fa2 and any(parse_config(c)["kv_cache_dtype"].startswith("turboquant") for c in configs):
        records[0]["meta"]["fa2_warm"] = _warm_fa2(model, min(args.timeout, WARM_FA2_TIMEOUT))
        _write(args.out, records)
    for i, config in enumerate(configs, 1):
        _log(f"({i}/{len(configs)}) {config}: starting an engine for cases {args.cases}")
        started = time.perf_counter()
        got = [dict(r, model=shape) for r in _run_config(config, args, model)]
        records += got
        done = [r for r in got if "decode_tok_s" in r]
        _log(f"({i}/{len(configs)}) {config}: {len(done)}/{len(got)} cases in {time.perf_counter() - started:.0f} s"
             + "".join(f"; {r['B']}x{r['P']}x{r['N']}: {r['decode_tok_s']} tok/s" for r in done))
        _write(args.out, records)  # nothing lost if a later configuration hangs
    print(summary(records))
    if args.plot:
        plot(records, args.plot)
    failed = [r for r in records if "error" in r]
    return 1 if failed and len(failed) == len(records) - 1 else 0


if __name__ == "__main__":
    raise SystemExit(main())
