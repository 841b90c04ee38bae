"""The Triton memory backend: the ``tqkv`` ops as Triton kernels reading and writing the packed cache.

Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (tests). The kernels live in
``tqkv_compile.lowerings``: ``triton_kv_write``, ``triton_attention`` (split-KV decode + merge) and
``triton_kv_dot``. Per-device tables (Hadamard matrix, centroids, midpoints) are built once and kept, so
calls inside CUDA-graph capture allocate only their outputs and split scratch.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch

from tqkv_compile.codec import Preset


@lru_cache(maxsize=None)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend:
    name = "triton"

    def __init__(self) -> None:
        self._tables: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def supports(self, device: torch.device) -> bool:
        device = torch.device(device)
        usable = device.type == "cuda" or (device.type == "cpu" and _interpreting())
        return usable and _triton_importable()

    def supports_preset(self, preset: Preset) -> bool:
        """vLLM's four presets; presets of ours (their own key/value formats) are not in the kernels yet."""
        return preset.spec.vllm_name is not None

    def auto_selects(self, device: torch.device) -> bool:
        """Chosen automatically on CUDA only; the CPU interpreter is for tests that ask for it by name."""
        return torch.device(device).type == "cuda" and self.supports(device)

    def tables(self, preset: Preset, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rotation fp32 [D, D], centroids fp32 [2^b], midpoints fp32 [2^b - 1]) on device; placeholders
        for fp8 keys, which use none of them."""
        key = (preset.name, preset.head_dim, str(device))
        if key not in self._tables:
            rotation = preset.rotation(device).contiguous()
            if preset.key_fp8:
                centroids = midpoints = torch.zeros(1, device=device)
            else:
                centroids = preset.centroids(device).contiguous()
                midpoints = preset.midpoints(device).contiguous()
            self._tables[key] = (rotation, centroids, midpoints)
        return self._tables[key]

    def kv_write(self, key, value, kv_cache, slot_mapping, preset: Preset) -> None:
        from tqkv_compile.lowerings.triton_kv_write import kv_write

        rotation, _, midpoints = self.tables(preset, kv_cache.device)
        kv_write(key, value, kv_cache, slot_mapping, preset, rotation, midpoints)

    def attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset: Preset):
        from tqkv_compile.lowerings.triton_attention import decode_attention

        rotation, centroids, _ = self.tables(preset, query.device)
        return decode_attention(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset,
                                rotation, centroids)

    def kv_dot(self, query, kv_cache, block_table, seq_lens, scale, preset: Preset):
        from tqkv_compile.lowerings.triton_kv_dot import kv_dot

        rotation, centroids, _ = self.tables(preset, query.device)
        return kv_dot(query, kv_cache, block_table, seq_lens, scale, preset, rotation, centroids)
