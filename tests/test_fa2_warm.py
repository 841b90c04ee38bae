"""``tqkv warm-fa2``: its parallel runner with stand-in commands, what it does where there is nothing to warm (this
CPU machine), and the commands it would run. (The FA2 calls themselves need a Hopper GPU: ``bench/hopper_session.sh
fa2`` measured them on an H200, ``bench/results/h200-fa2-first-call.json``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from processes import gone
from tqkv_compile.vllm import fa2_warm


def _script(tmp_path, name: str, body: str) -> list[str]:
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return [sys.executable, str(path), name]  # the last argument is the label run_parallel reports


def test_run_parallel_runs_jobs_at_a_time_and_names_what_failed(tmp_path):
    log = tmp_path / "spans.jsonl"
    body = (f"import json, sys, time\nt0 = time.time(); time.sleep(1.0)\n"
            f"open({str(log)!r}, 'a').write(json.dumps([t0, time.time()]) + '\\n')\n"
            "sys.exit(3 if sys.argv[1] == 'bad' else 0)\n")
    commands = [_script(tmp_path, name, body) for name in ("a", "b", "bad", "c")]
    lines = []
    result = fa2_warm.run_parallel(commands, jobs=2, timeout=60, log=lines.append)
    assert result["ran"] == 4 and result["failed"] == ["bad"] and result["not_run"] == []
    assert not result["timed_out"]
    spans = [json.loads(line) for line in log.read_text().splitlines()]
    # never more than 2 at once: at each start, count the spans that cover it
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) == 2
    assert any(line.startswith("bad: FAILED (exit 3)") for line in lines)


def test_run_parallel_stops_at_its_time_limit_and_leaves_nothing_running(tmp_path):
    pid_file = tmp_path / "pids"
    body = f"import os, time\nopen({str(pid_file)!r}, 'a').write(f'{{os.getpid()}}\\n')\ntime.sleep(60)\n"
    commands = [_script(tmp_path, name, body) for name in ("x", "y", "z")]
    started = time.perf_counter()
    result = fa2_warm.run_parallel(commands, jobs=2, timeout=2, log=lambda msg: None)
    assert time.perf_counter() - started < 15
    assert result["timed_out"] and sorted(result["failed"]) == ["x", "y"] and result["not_run"] == ["z"]
    for pid in map(int, pid_file.read_text().split()):
        assert gone(pid, wait_s=0)  # already, when run_parallel returns


def test_run_parallel_takes_its_children_down_when_terminated(tmp_path):
    """A shell's ``timeout`` sends SIGTERM to the command's group, which the children (groups of their own) are
    not in: the runner kills them itself before it exits."""
    pid_file = tmp_path / "pids"
    child = tmp_path / "child.py"
    child.write_text(f"import os, time\nopen({str(pid_file)!r}, 'a').write(f'{{os.getpid()}}\\n')\ntime.sleep(60)\n")
    parent = tmp_path / "parent.py"
    parent.write_text("import sys\nfrom tqkv_compile.vllm import fa2_warm\n"
                      f"fa2_warm.run_parallel([[sys.executable, {str(child)!r}, 'a'], [sys.executable, {str(child)!r}, 'b']],"
                      " jobs=2, timeout=60, log=lambda m: None)\n")
    proc = subprocess.Popen([sys.executable, str(parent)])
    for _ in range(200):
        if pid_file.exists() and len(pid_file.read_text().split()) == 2:
            break
        time.sleep(0.1)
    proc.terminate()
    assert proc.wait(timeout=30) == 143
    for pid in map(int, pid_file.read_text().split()):
        assert gone(pid), f"child {pid} outlived its terminated parent"


def test_warm_has_nothing_to_do_without_a_gpu_that_needs_it_and_refuses_bad_input(monkeypatch):
    monkeypatch.setattr(fa2_warm, "needed", lambda: None)  # (this machine: no CUDA GPU; a GPU host may need it)
    assert "skipped" in fa2_warm.warm([128])
    with pytest.raises(ValueError, match="head size 96"):
        fa2_warm.warm([96])
    with pytest.raises(ValueError, match="jobs"):
        fa2_warm.warm([128], jobs=0)


def test_warm_runs_one_child_a_case_with_the_jit_cache_kept(monkeypatch):
    seen = {}

    def fake_run_parallel(commands, jobs, timeout, env=None, log=print):
        seen.update(commands=commands, jobs=jobs, timeout=timeout, env=env)
        return dict(ran=len(commands), failed=[], not_run=[], seconds=0.0, timed_out=False)

    monkeypatch.setattr(fa2_warm, "run_parallel", fake_run_parallel)
    monkeypatch.delenv("CUDA_CACHE_MAXSIZE", raising=False)
    result = fa2_warm.warm([64, 128], jobs=3, timeout=100, force=True, log=lambda msg: None)
    labels = [c[-1] for c in seen["commands"]]
    assert labels == [f"{h}:{c}" for h in (64, 128) for c in ("decode", "decode_long", "prefill", "prefill_contiguous")]
    assert all(c[1:4] == ["-m", "tqkv_compile.vllm.fa2_warm", "--only"] for c in seen["commands"])
    assert seen["jobs"] == 3 and seen["timeout"] == 100 and result["ran"] == 8
    assert seen["env"]["CUDA_CACHE_MAXSIZE"] == fa2_warm.CACHE_MAXSIZE  # the driver keeps what it compiled


def test_a_child_runs_its_one_case(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(fa2_warm, "run_case", lambda *a: calls.append(a) or [12.5, 0.0004])
    assert fa2_warm.main(["--only", "128:prefill"]) == 0
    assert calls == [(128, 32, 8, [176, 180, 184, 190], [176, 180, 184, 190], True)]
    assert json.loads(capsys.readouterr().out) == dict(head=128, case="prefill", first_s=12.5, second_s=0.0004)


@pytest.mark.skipif(fa2_warm.needed() is not None, reason="this GPU needs the warm: the command would run it")
def test_the_command_says_when_there_is_nothing_to_warm_and_refuses_bad_head_sizes():
    env = dict(os.environ)
    done = subprocess.run([sys.executable, "-m", "tqkv_compile.tools.cli", "warm-fa2"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0 and "skipped" in json.loads(done.stdout)
    bad = subprocess.run([sys.executable, "-m", "tqkv_compile.tools.cli", "warm-fa2", "--head-sizes", "96"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "head size 96" in bad.stderr


def test_bench_e2e_warms_the_models_head_size_and_never_fails_on_it(tmp_path, monkeypatch):
    from tqkv_compile.tools import bench_e2e

    heads = []
    monkeypatch.setattr(fa2_warm, "warm", lambda h, **kw: heads.append((h, kw["timeout"])) or {"ran": 4})
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(num_hidden_layers=6, hidden_size=2048, num_attention_heads=32)))
    assert bench_e2e._warm_fa2(str(model), 100) == {"ran": 4} and heads == [([64], 100)]  # 2048 / 32
    (model / "config.json").write_text(json.dumps(dict(num_hidden_layers=6, hidden_size=2048, num_attention_heads=32, head_dim=128)))
    bench_e2e._warm_fa2(str(model), 100)
    assert heads[-1] == ([128], 100)
    (model / "config.json").write_text("{}")  # an error is recorded, not raised
    assert bench_e2e._warm_fa2(str(model), 100)["error"].startswith("KeyError")
