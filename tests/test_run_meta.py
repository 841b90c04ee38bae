"""Every result file's metadata comes from one helper and says the same things."""

from __future__ import annotations

import torch

from tqkv_compile import run_meta


def test_the_meta_names_command_commit_device_versions_and_settings(monkeypatch):
    monkeypatch.setenv("TQKV_COMMIT", "abc123")
    monkeypatch.setenv("TQKV_FRAGMENT_KERNEL", "0")
    meta = run_meta.run_meta("tqkv bench e2e --x", model="m")["meta"]
    assert meta["command"] == "tqkv bench e2e --x" and meta["commit"] == "abc123" and meta["model"] == "m"
    assert meta["torch"] == torch.__version__ and meta["date"].endswith("+00:00")
    assert meta["tqkv_env"] == {"TQKV_FRAGMENT_KERNEL": "0"}  # TQKV_COMMIT is the commit, not a setting
    assert "CPU" in meta["device"] or torch.cuda.is_available()


def test_without_a_named_commit_the_checkouts_head_is_read(monkeypatch):
    monkeypatch.delenv("TQKV_COMMIT", raising=False)
    found = run_meta.commit()
    assert found is None or len(found.split("+")[0]) == 40
