"""``tqkv doctor``: what the environment has and whether tqkv serves it, with what to do where it does not."""

from __future__ import annotations

import json

from tqkv_compile import doctor
from tqkv_compile.vllm import adapter


def test_this_cpu_environment_is_served_and_names_its_backend(capsys):
    assert doctor.main([]) == 0
    text = capsys.readouterr().out
    assert "vllm: 0.32" in text and "gpu: none (CPU only)" in text and "cpu backend:" in text
    assert "tqkv will serve" in text


def test_an_unknown_vllm_version_is_not_served_and_the_supported_ones_are_named(monkeypatch, capsys):
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.34.0")
    assert doctor.main(["--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["serves"] is False
    vllm = next(f for f in report["findings"] if f["topic"] == "vllm")
    assert "0.34.0" in vllm["found"] and not vllm["ok"]
    assert all(f"{v}.x" in vllm["action"] for v in adapter.KNOWN_VERSIONS)


def test_a_gpu_below_ampere_gets_no_kernels_and_is_told_why():
    (finding,) = doctor._gpu_kernels((7, 5))
    assert not finding.ok and "8.0" in finding.found


def test_the_cli_runs_it(capsys):
    from tqkv_compile import cli

    assert cli.main(["doctor", "--json"]) == 0
    assert '"serves": true' in capsys.readouterr().out
