"""tqkv_compile: a fast TurboQuant-compressed KV cache for vLLM, through torch.compile.

``import tqkv_compile`` registers the ``tqkv`` custom ops and the built-in memory backends.
"""

from tqkv_compile import ops  # noqa: F401  (registers torch.ops.tqkv.*)
from tqkv_compile.backends import (
    available_backends,
    get_backend,
    register_backend,
    unregister_backend,
    select_backend,
    set_backend,
    set_validate,
    use_backend,
    validation_reports,
)
from tqkv_compile.backends.pytorch import PyTorchBackend
from tqkv_compile.backends.reference import ReferenceBackend
from tqkv_compile.backends.triton import TritonBackend
from tqkv_compile.codec import Preset, get_preset, preset_names

register_backend(ReferenceBackend(), priority=0)  # the oracle
register_backend(PyTorchBackend(), priority=5)  # the CPU's (any device's without Triton): reference decode + SDPA
register_backend(TritonBackend(), priority=10)  # imports no triton until a kernel runs; supports() checks it

__all__ = [
    "Preset",
    "available_backends",
    "get_backend",
    "get_preset",
    "preset_names",
    "register_backend",
    "unregister_backend",
    "select_backend",
    "set_backend",
    "set_validate",
    "use_backend",
    "validation_reports",
]
__version__ = "0.1.0"
