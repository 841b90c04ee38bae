"""The Triton memory backend: the ``tqkv`` ops as Triton kernels reading and writing the packed cache.

Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (tests). The kernels live in
``tqkv_compile.lowerings``: ``triton_kv_write``, ``triton_attention`` (split-KV decode + merge: it picks
among ``decode_stream``, ``decode_bytes`` and ``gluon_decode``, then ``decode_merge``) and ``triton_kv_dot``.
Per-device tables (Hadamard matrix, centroids, midpoints) are built once and kept, so calls inside CUDA-graph
capture allocate only their outputs and split scratch.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch

from tqkv_compile.backends import prefill
from tqkv_compile.codec import Preset


@lru_cache(maxsize=None)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _flash_varlen(query: torch.Tensor):
    """vLLM's FlashAttention varlen function for this query where vLLM brings one (the adapter): CUDA, fp16 or
    bf16 (FlashAttention takes no fp32); else None (the dense path then takes SDPA)."""
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    from tqkv_compile.vllm import adapter

    return adapter.flash_attn_varlen()


class TritonBackend:
    name = "triton"

    def __init__(self) -> None:
        self._tables: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._general: dict[tuple, tuple] = {}

    def supports(self, device: torch.device) -> bool:
        device = torch.device(device)
        usable = device.type == "cuda" or (device.type == "cpu" and _interpreting())
        return usable and _triton_importable()

    def supports_preset(self, preset: Preset) -> bool:
        """vLLM's four layouts (tuned kernels) and the presets of ours that the general kernels read
        (``general_fields.supports``)."""
        if preset.vllm_layout:
            return True
        from tqkv_compile.lowerings import general_fields

        return general_fields.supports(preset)

    def general_tables(self, preset: Preset, device: torch.device):
        """(rotation, centroids, midpoints, offsets) for a preset of ours (``general_fields.tables``)."""
        from tqkv_compile.lowerings import general_fields

        key = ("general", preset.name, preset.head_dim, str(device))
        if key not in self._general:
            self._general[key] = (preset.rotation(device).contiguous(), *general_fields.tables(preset, device))
        return self._general[key]

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
                centroids = midpoints = torch.zeros(1, dtype=torch.float32, device=device)
            else:
                centroids = preset.centroids(device).contiguous()
                midpoints = preset.midpoints(device).contiguous()
            self._tables[key] = (rotation, centroids, midpoints)
        return self._tables[key]

    def warm(self, preset: Preset, device: torch.device) -> None:
        """Build every table the kernels read for ``preset`` on ``device`` now (vLLM calls this before CUDA-graph
        capture, where host-to-device copies are not allowed)."""
        if not preset.vllm_layout:
            self.general_tables(preset, device)
            return
        from tqkv_compile.lowerings import gluon_decode
        from tqkv_compile.lowerings.arrivals import arrival_counts
        from tqkv_compile.lowerings.cache_tables import key_lut
        from tqkv_compile.lowerings.decode_stream import rotation_signs

        self.tables(preset, device)
        key_lut(preset, device)
        rotation_signs(preset.head_dim, device)
        if gluon_decode.enabled() and device.type == "cuda" and preset.head_dim in (128, 256):
            gluon_decode.key_lut(preset, device)  # the fragment kernel's tables
            if gluon_decode.has_key_table(preset):
                gluon_decode.key_pairs(preset, device)
            gluon_decode.orders(preset.head_dim, device)
        # kept arrival counts for 1024 row blocks of a write, zeroed now (not inside CUDA-graph capture)
        arrival_counts("kv_write_norm", 1024, device)

    def kv_write(self, key, value, kv_cache, slot_mapping, preset: Preset) -> None:
        if not preset.vllm_layout:
            from tqkv_compile.lowerings import general_kv_write

            rotation, _, midpoints, offsets = self.general_tables(preset, kv_cache.device)
            general_kv_write.kv_write(key, value, kv_cache, slot_mapping, preset, rotation, midpoints, offsets)
            return
        from tqkv_compile.lowerings.triton_kv_write import kv_write

        rotation, centroids, midpoints = self.tables(preset, kv_cache.device)
        kv_write(key, value, kv_cache, slot_mapping, preset, rotation, midpoints, centroids=centroids)

    def attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset: Preset, key=None,
                  value=None, out=None):
        """The decode kernels for every sequence, except whole prompts (given the step's ``key`` and ``value``)
        and those with many new tokens, which get the prefill paths (:mod:`tqkv_compile.backends.prefill`).
        ``out``: where to write (a pure decode batch: the merge kernel stores there)."""
        return prefill.serve(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, key, value,
                             out, decode=self.decode_kernels, dense_decode=self.dense_decode,
                             find_varlen=lambda: _flash_varlen(query))

    def dense_decode(self, kv_cache, slots, preset: Preset, dtype: torch.dtype):
        """The prefill path's keys and values (``prefill.dense_attention``'s ``decode``): one Triton kernel,
        ``triton_dequant``'s for vLLM's layouts, ``general_dequant``'s for presets of ours (the codec in PyTorch
        for a layout neither reads)."""
        from tqkv_compile.lowerings import general_dequant, general_fields, triton_dequant

        if triton_dequant.supports(preset):
            _, centroids, _ = self.tables(preset, kv_cache.device)
            return triton_dequant.decode_slots(kv_cache, slots, preset, centroids, dtype)
        if general_fields.supports(preset):
            rotation, centroids, _, offsets = self.general_tables(preset, kv_cache.device)
            return general_dequant.decode_slots(kv_cache, slots, preset, rotation, centroids, offsets, dtype)
        return prefill.codec_decode(kv_cache, slots, preset, dtype)

    def decode_kernels(self, query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset: Preset,
                       out=None):
        """The decode kernels alone for every row (no prefill plan): vLLM's presets on
        :mod:`~tqkv_compile.lowerings.triton_attention`'s (their merge stores into ``out`` where given), ours on
        :mod:`~tqkv_compile.lowerings.general_decode`'s (what ``tqkv bench kernels`` times)."""
        if not preset.vllm_layout:
            from tqkv_compile.lowerings import general_decode

            rotation, centroids, _, offsets = self.general_tables(preset, query.device)
            result = general_decode.decode_attention(query, kv_cache, block_table, seq_lens, query_start_loc,
                                                     scale, preset, rotation, centroids, offsets)
            return result if out is None else out.copy_(result)
        from tqkv_compile.lowerings.triton_attention import decode_attention

        rotation, centroids, _ = self.tables(preset, query.device)
        return decode_attention(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset,
                                rotation, centroids, out=out)

    def kv_dot(self, query, kv_cache, block_table, seq_lens, scale, preset: Preset):
        if not preset.vllm_layout:
            from tqkv_compile.lowerings import general_kv_dot

            rotation, centroids, _, offsets = self.general_tables(preset, query.device)
            return general_kv_dot.kv_dot(query, kv_cache, block_table, seq_lens, scale, preset, rotation, centroids,
                                         offsets)
        from tqkv_compile.lowerings.triton_kv_dot import kv_dot

        rotation, centroids, _ = self.tables(preset, query.device)
        return kv_dot(query, kv_cache, block_table, seq_lens, scale, preset, rotation, centroids)
