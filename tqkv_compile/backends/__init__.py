"""Memory backends behind the ``tqkv`` ops: a registry, the selection rule and the validate mode.

A backend is any object with ``name``, ``supports(device) -> bool`` (optionally ``auto_selects(device)``
where automatic selection should be narrower, and ``supports_preset(preset)``) and the three op methods
``kv_write``, ``attention`` and ``kv_dot`` (same arguments as the ops, the preset resolved to a
:class:`tqkv_compile.codec.Preset`; ``attention`` gets ``key`` / ``value`` as keywords, and only when the
caller gave them). Third parties register theirs with :func:`register_backend`.

Selection, first that applies: :func:`set_backend` / :func:`use_backend`; the ``TQKV_BACKEND`` environment
variable; else the registered backend with the highest priority that supports the tensors' device.
Validate mode (:func:`set_validate`, or ``TQKV_VALIDATE=1``) runs the reference beside the chosen backend on
every call and records the largest difference (:func:`validation_reports`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from tqkv_compile import env

logger = logging.getLogger("tqkv_compile")


class MemoryBackend(Protocol):
    name: str

    def supports(self, device: torch.device) -> bool: ...

    def kv_write(self, key, value, kv_cache, slot_mapping, preset) -> None: ...

    def attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, key=None,
                  value=None, out=None) -> torch.Tensor:
        """The attention [T, Hq, D], in ``out`` where given (the query's shape and dtype), else a new tensor;
        rows past ``query_start_loc[-1]`` are zero."""
        ...

    def kv_dot(self, query, kv_cache, block_table, seq_lens, scale, preset) -> torch.Tensor: ...


_registry: dict[str, tuple[int, MemoryBackend]] = {}
_chosen: str | None = None
_validate: bool | None = None


@dataclass
class ValidationReport:
    op: str
    backend: str
    max_abs_diff: float  # kv_write: number of bytes that differ


_reports: list[ValidationReport] = []


def takes_out(backend: MemoryBackend) -> bool:
    """Whether ``backend.attention`` takes ``out`` (the built-in backends do; a third-party one may not).
    Looked up once a backend class (a signature costs ~25 us; eager engine steps ask once a layer)."""
    kind = type(backend)
    if kind not in _takes_out:
        try:
            _takes_out[kind] = "out" in inspect.signature(backend.attention).parameters
        except (TypeError, ValueError):
            _takes_out[kind] = False
    return _takes_out[kind]


_takes_out: dict[type, bool] = {}


def register_backend(backend: MemoryBackend, priority: int = 0) -> None:
    """Add (or replace) a backend; higher priority wins automatic selection where it ``supports`` the device."""
    for method in ("supports", "kv_write", "attention", "kv_dot"):
        if not callable(getattr(backend, method, None)):
            raise TypeError(f"backend: {type(backend).__name__} has no method {method}()")
    _registry[backend.name] = (priority, backend)
    _auto_selected.clear()


def unregister_backend(name: str) -> None:
    """Remove a registered backend (a ValueError for an unknown name)."""
    get_backend(name)
    del _registry[name]
    _auto_selected.clear()


def available_backends() -> list[str]:
    return sorted(_registry, key=lambda n: -_registry[n][0])


def get_backend(name: str) -> MemoryBackend:
    if name not in _registry:
        raise ValueError(f"backend: unknown memory backend {name!r}; registered: {', '.join(available_backends())}")
    return _registry[name][1]


def set_backend(name: str | None) -> None:
    """Pin a backend by name for all later calls (None: back to automatic selection)."""
    global _chosen
    if name is not None:
        get_backend(name)
    _chosen = name


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    global _chosen
    previous = _chosen
    set_backend(name)
    try:
        yield
    finally:
        _chosen = previous


def _supports_preset(backend: MemoryBackend, preset) -> bool:
    return preset is None or getattr(backend, "supports_preset", lambda p: True)(preset)


def select_backend(device: torch.device, preset=None) -> MemoryBackend:
    """The backend for tensors on ``device`` (and, if given, able to serve ``preset``)."""
    name = _chosen or env.get("TQKV_BACKEND") or None
    if name:
        backend = get_backend(name)
        if not backend.supports(device):
            hint = (" (Triton runs on the CPU only interpreted: set TRITON_INTERPRET=1 before triton is imported)"
                    if name == "triton" and torch.device(device).type == "cpu" else "")
            raise ValueError(f"backend: {name!r} does not support device {device}{hint}")
        if not _supports_preset(backend, preset):
            raise ValueError(f"backend: {name!r} does not support preset {preset.name!r}")
        return backend
    # automatic selection: decided once per device and preset until a backend is registered (every layer of
    # every step asks; the walk over the registry costs ~10 us a call on a 2-core CPU)
    key = (device, None if preset is None else (preset.name, preset.head_dim))
    backend = _auto_selected.get(key)
    if backend is None:
        for candidate in available_backends():
            entry = _registry[candidate][1]
            # a backend may support a device only for explicit use (Triton's interpreter on the CPU)
            if getattr(entry, "auto_selects", entry.supports)(device) and _supports_preset(entry, preset):
                backend = _auto_selected[key] = entry
                break
        else:
            raise ValueError(f"backend: no registered memory backend supports device {device}")
    return backend


#: (device, (preset name, head size) or None) -> the backend automatic selection chose there
_auto_selected: dict[tuple, MemoryBackend] = {}


def set_validate(enabled: bool | None) -> None:
    """Run the reference beside the chosen backend on every op call (None: follow ``TQKV_VALIDATE``)."""
    global _validate
    _validate = enabled


def validate_enabled() -> bool:
    if _validate is not None:
        return _validate
    return env.get("TQKV_VALIDATE", "0") not in ("", "0", "false", "False")


def record_validation(op: str, backend: str, diff: float) -> None:
    report = ValidationReport(op, backend, diff)
    _reports.append(report)
    logger.info("tqkv validate: %s on %s: largest difference %.3g", op, backend, diff)


def validation_reports(clear: bool = False) -> list[ValidationReport]:
    reports = list(_reports)
    if clear:
        _reports.clear()
    return reports
