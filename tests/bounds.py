"""A bounds checker for Triton kernels under the interpreter: every load and store a program makes (mask on)
must fall inside the span of one of the tensors its launch was given, else AssertionError names the address.

On the GPU a read past a tensor is silent until it crosses into an unmapped page (vLLM's caches are allocated
in whole 2 MiB pages, so a read one byte past the last slot faults only when the cache ends on a page
boundary); here every such read fails, whatever the size.

Limit: an address is accepted when it falls inside any of the launch's tensors, so an over-read of one
argument that lands inside another (say the cache's end next to a partial-output buffer) is not caught.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from triton.runtime import interpreter


def _spans(values) -> list[tuple[int, int]]:
    spans = []
    for value in values:
        if isinstance(value, (tuple, list)):
            spans += _spans(value)
        elif isinstance(value, torch.Tensor) and value.numel():
            last = sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()))
            spans.append((value.data_ptr(), value.data_ptr() + (last + 1) * value.element_size()))
    return spans


@contextlib.contextmanager
def checked_bounds():
    """Within it, interpreted kernels fail on any access outside their tensor arguments."""
    state = {"spans": []}
    launch, load, store = (interpreter.GridExecutor.__call__, interpreter.InterpreterBuilder.create_masked_load,
                           interpreter.InterpreterBuilder.create_masked_store)

    def check(ptrs, mask, what):
        addresses = np.asarray(ptrs.data, dtype=np.uint64)[np.broadcast_to(mask.data, ptrs.data.shape)]
        if not addresses.size:
            return
        width = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(addresses.shape, dtype=bool)
        for begin, end in state["spans"]:
            inside |= (addresses >= begin) & (addresses + width <= end)
        if not inside.all():
            bad = int(addresses[~inside][0])
            near = min(state["spans"], key=lambda s: min(abs(bad - s[0]), abs(bad - s[1])))
            raise AssertionError(f"{what} outside every tensor argument: address {bad:#x}, nearest tensor "
                                 f"[{near[0]:#x}, {near[1]:#x}) ({bad - near[1]:+d} bytes past its end); "
                                 f"{int((~inside).sum())} of {addresses.size} accesses")

    def checked_launch(self, *args, **kwargs):
        outer = state["spans"]
        state["spans"] = _spans(list(args) + list(kwargs.values()))
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["spans"] = outer

    def checked_load(self, ptrs, mask, other, *rest):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)

    interpreter.GridExecutor.__call__ = checked_launch
    interpreter.InterpreterBuilder.create_masked_load = checked_load
    interpreter.InterpreterBuilder.create_masked_store = checked_store
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = launch
        interpreter.InterpreterBuilder.create_masked_load = load
        interpreter.InterpreterBuilder.create_masked_store = store
