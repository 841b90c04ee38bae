"""Triton kernels defined under the interpreter for a test module (they run on the CPU, slowly)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

KERNEL_MODULES = [
    "tqkv_compile.lowerings.general_decode",
    "tqkv_compile.lowerings.general_kv_write",
    "tqkv_compile.lowerings.general_kv_dot",
    "tqkv_compile.lowerings.general_dequant",
    "tqkv_compile.lowerings.general_fields",
    "tqkv_compile.lowerings.triton_kv_dot",
    "tqkv_compile.lowerings.triton_attention",
    "tqkv_compile.lowerings.decode_stream",
    "tqkv_compile.lowerings.decode_bytes",
    "tqkv_compile.lowerings.decode_merge",
    "tqkv_compile.lowerings.device_helpers",
    "tqkv_compile.lowerings.triton_query",
    "tqkv_compile.lowerings.triton_kv_write",
    "tqkv_compile.lowerings.triton_dequant",
    "tqkv_compile.lowerings.dependent_launch",
]


@contextlib.contextmanager
def interpreted_kernels():
    """``TRITON_INTERPRET=1`` while the kernel modules are defined again (a module imported earlier without the
    interpreter would keep its compiled kernels); the environment restored afterwards, so that other test
    modules keep their backend selection."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    for name in KERNEL_MODULES:
        sys.modules.pop(name, None)
    for name in reversed(KERNEL_MODULES):
        importlib.import_module(name)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
