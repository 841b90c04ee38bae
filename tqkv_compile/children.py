"""Child processes that must not outlive the command that started them.

The benchmarks run engines and compiles in child processes, each in its own process group (``killpg`` then
takes whatever the child started too). A group of its own is out of reach of the signal a shell's ``timeout``
sends to the command's group, and Python's default SIGTERM ends the parent without its ``finally`` blocks: so
while children run, :func:`terminate_raises` turns SIGTERM into ``SystemExit`` and the parent's cleanup kills
them (:func:`kill_group`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from typing import Iterator


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (started with ``start_new_session=True``); nothing if it is gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Inside: SIGTERM raises ``SystemExit(143)`` (so ``finally`` and ``except BaseException`` run); the previous
    handler comes back after. Only the main thread can set handlers: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
