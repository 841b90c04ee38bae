"""The key rotation: the orthonormal Sylvester-Hadamard matrix (vLLM's choice; symmetric, its own inverse)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def _hadamard_cpu(dim: int) -> torch.Tensor:
    if dim <= 0 or dim & (dim - 1):
        raise ValueError(f"head_dim must be a power of two for the Hadamard rotation, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float32)  # explicit: vLLM loads models under a bf16 default dtype
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)


_on_device: dict[tuple[int, object], torch.Tensor] = {}  # (dim, device as asked or as a str) -> H


def hadamard(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 [dim, dim] orthonormal Hadamard matrix H with H == H.T == inverse(H)."""
    made = _on_device.get((dim, device))  # as asked (a str or device already seen: no torch.device() a call)
    if made is None:
        key = (dim, str(torch.device(device)))
        if key not in _on_device:
            _on_device[key] = _hadamard_cpu(dim).to(device)
        made = _on_device[(dim, device)] = _on_device[key]
    return made
