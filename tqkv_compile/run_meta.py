"""The run's metadata every result file starts with: what ran (the command), when, on which commit and machine,
with which versions and ``TQKV_*`` settings. One place, so that every result file says the same things the same
way."""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import subprocess
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def commit() -> str | None:
    """``TQKV_COMMIT`` where set (a copied checkout, as on the device, may carry a stale .git), else the
    checkout's HEAD with ``+uncommitted`` where tracked files differ from it; None outside a git checkout."""
    named = os.environ.get("TQKV_COMMIT")
    if named:
        return named
    try:
        head = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=_ROOT, capture_output=True,
                              text=True).stdout.strip()
        if not head:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+uncommitted" if dirty else "")
    except OSError:
        return None


def device() -> str:
    """The GPU's name, or the CPU's architecture, model name (where the OS says it) and core count."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.machine()} CPU{f' ({cpu_model()})' if cpu_model() else ''}, {os.cpu_count()} cores"


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 (not installed, or broken)
        return None


def tqkv_settings() -> dict[str, str]:
    """The ``TQKV_*`` variables of the run (experimental paths change what is measured), TQKV_COMMIT aside."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("TQKV_") and k != "TQKV_COMMIT"}


def run_meta(command: str, **extra) -> dict:
    """``{"meta": {...}}``: command, date (UTC), commit, device, torch / triton / vLLM versions, tqkv_env, and
    ``extra``."""
    return {"meta": dict(command=command,
                         date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         commit=commit(), device=device(), torch=_version("torch"), triton=_version("triton"),
                         vllm=_version("vllm"), tqkv_env=tqkv_settings(), **extra)}
