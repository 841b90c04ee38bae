"""Whether a process is gone, for the tests of children that must not outlive their parents."""

from __future__ import annotations

import os
import time


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """True once ``pid`` has exited (no longer in /proc, or a zombie until init reaps it), polled for up to
    ``wait_s`` seconds (0: asked once)."""
    deadline = time.monotonic() + wait_s
    while True:
        stat = f"/proc/{pid}/stat"
        try:
            if open(stat).read().split(") ")[1].startswith("Z"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
