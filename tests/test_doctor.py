"""``tqkv doctor``: what the environment has and whether tqkv serves it, with what to do where it does not."""

from __future__ import annotations

import json

import pytest

from tqkv_compile.tools import doctor
from tqkv_compile.vllm import adapter


def test_this_cpu_environment_is_served_and_names_its_backend(capsys):
    assert doctor.main([]) == 0
    text = capsys.readouterr().out
    assert "vllm: 0.32" in text and "gpu: none (CPU only)" in text and "cpu backend:" in text
    assert "tqkv will serve" in text


def test_an_unknown_vllm_version_is_not_served_and_the_supported_ones_are_named(monkeypatch, capsys):
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.35.0")
    assert doctor.main(["--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["serves"] is False
    vllm = next(f for f in report["findings"] if f["topic"] == "vllm")
    assert "0.35.0" in vllm["found"] and not vllm["ok"]
    assert "0.32.x" in vllm["action"]  # the version proven on this platform (the CPU)


def test_a_version_not_yet_proven_on_a_gpu_says_so_and_how_to_run_it_anyway(monkeypatch):
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.34.0")
    monkeypatch.setattr(adapter, "on_cuda", lambda: True)
    monkeypatch.delenv(adapter.UNPROVEN_ENV, raising=False)
    finding = doctor._vllm("0.34.0")
    assert finding.found == "0.34.0 (code support, not yet proven on a GPU): tqkv stays off" and not finding.ok
    assert "TQKV_ALLOW_UNPROVEN_VLLM=1" in finding.action and "0.20.x" in finding.action
    monkeypatch.setenv(adapter.UNPROVEN_ENV, "1")
    finding = doctor._vllm("0.34.0")
    assert finding.ok and "not yet proven on a GPU" in finding.found and "TQKV_ALLOW_UNPROVEN_VLLM=1" in finding.found


def test_a_gpu_only_version_on_the_cpu_is_not_served_whatever_the_opt_in(monkeypatch):
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.34.0")
    monkeypatch.setenv(adapter.UNPROVEN_ENV, "1")
    finding = doctor._vllm(adapter.vllm_version())
    assert not finding.ok and "no support on the CPU" in finding.found and "0.32.x" in finding.action


@pytest.mark.parametrize("torch_version, vllm_version, ok", [
    ("2.14.0+cu130", "0.34.0", True), ("2.13.0+cpu", "0.34.0", False), ("2.11.0", "0.20.0", True),
    ("2.13.0", None, True)])
def test_torch_is_checked_against_the_one_vllm_pins(torch_version, vllm_version, ok):
    finding = doctor._torch(torch_version, vllm_version)
    assert finding.ok == ok
    if not ok:
        assert "built against torch 2.14" in finding.found and "vllm==0.34.0" in finding.action


def test_no_flash_attention_library_is_said_as_such_not_as_native_code(monkeypatch):
    monkeypatch.setattr(adapter, "fa2_native_archs", lambda: None)
    finding = doctor._flash_attention_2()
    assert finding.ok and "no vLLM FlashAttention-2 library" in finding.found


def test_a_hopper_gpu_under_a_sm80_only_flash_attention_is_told_to_warm_it(monkeypatch):
    """vLLM 0.20, 0.33 and 0.34 all ship FA2 with sm_80 code only."""
    from tqkv_compile.vllm import fa2_warm

    archs = {"sass": [80], "ptx": [80]}
    monkeypatch.setattr(adapter, "fa2_native_archs", lambda: archs)
    monkeypatch.setattr(fa2_warm, "needed", lambda: adapter.fa2_jit_warning(archs, (9, 0), None))
    finding = doctor._flash_attention_2()
    assert not finding.ok and "sm_90" in finding.found and "tqkv warm-fa2" in finding.action


def test_a_gpu_below_ampere_gets_no_kernels_and_is_told_why():
    (finding,) = doctor._gpu_kernels((7, 5))
    assert not finding.ok and "8.0" in finding.found


def test_the_cli_runs_it(capsys):
    from tqkv_compile.tools import cli

    assert cli.main(["doctor", "--json"]) == 0
    assert '"serves": true' in capsys.readouterr().out
