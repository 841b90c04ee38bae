"""vLLM's own TurboQuant kernels, run on the CPU under TRITON_INTERPRET=1: the compatibility oracle.

vLLM swaps `triton` for a placeholder when no GPU driver is active; point its shim at the real triton
before importing the kernel modules.
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")


def _kernels():
    import triton
    import triton.language as tl
    import vllm.triton_utils as shim

    shim.triton, shim.tl, shim.HAS_TRITON = triton, tl, True
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.ops import triton_turboquant_decode as decode
    from vllm.v1.attention.ops import triton_turboquant_store as store

    return TurboQuantConfig, get_centroids, store, decode


def vllm_hadamard(dim: int) -> torch.Tensor:
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard

    return _build_hadamard(dim, "cpu")


def vllm_centroids(dim: int, bits: int) -> torch.Tensor:
    return _kernels()[1](dim, bits)


def vllm_store(preset: str, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping) -> None:
    """vLLM's store kernel writing key/value [T, Hk, D] into kv_cache [NB, BS, Hk, S] (in place)."""
    config_cls, get_centroids, store, _ = _kernels()
    dim = key.shape[-1]
    cfg = config_cls.from_cache_dtype(preset, dim)
    c_sorted = get_centroids(dim, cfg.centroid_bits).float().sort().values
    midpoints = (c_sorted[:-1] + c_sorted[1:]) / 2
    store.triton_turboquant_store(
        key,
        value,
        kv_cache,
        slot_mapping,
        vllm_hadamard(dim),
        midpoints,
        mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
    )


def vllm_dequant(preset: str, kv_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """vLLM's full-dequant kernel for sequence 0: (keys in the rotated basis times norm, values), fp16 [L, Hk, D]."""
    config_cls, get_centroids, _, decode = _kernels()
    _, block_size, heads, _ = kv_cache.shape
    dim = None
    for d in (64, 128, 256):
        if config_cls.from_cache_dtype(preset, d).slot_size_aligned == kv_cache.shape[-1]:
            dim = d
    cfg = config_cls.from_cache_dtype(preset, dim)
    k_out = torch.zeros(1, heads, length, dim, dtype=torch.float16)
    v_out = torch.zeros_like(k_out)
    decode._tq_full_dequant_kv[(length, heads)](
        kv_cache, block_table, get_centroids(dim, cfg.centroid_bits).float(), k_out, v_out,
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        v_out.stride(0), v_out.stride(1), v_out.stride(2),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0),
        HEAD_DIM=dim, BLOCK_SIZE=block_size, NUM_KV_HEADS=heads,
        MSE_BYTES=(dim * cfg.key_mse_bits + 7) // 8, KPS=cfg.key_packed_size,
        VQB=cfg.effective_value_quant_bits, VAL_DATA_BYTES=(dim * cfg.effective_value_quant_bits + 7) // 8,
        MSE_BITS=cfg.key_mse_bits, KEY_FP8=1 if cfg.key_fp8 else 0, BLOCK_D=dim,
        NORM_CORRECTION=1 if cfg.norm_correction else 0, FP8_E4B15=0,
    )
    return k_out[0].transpose(0, 1), v_out[0].transpose(0, 1)


def vllm_decode_attention(preset, query, kv_cache, block_table, seq_lens, scale):
    """vLLM's TurboQuant decode attention (one query per sequence): out [B, Hq, D]."""
    config_cls, get_centroids, _, decode = _kernels()
    dim = query.shape[-1]
    cfg = config_cls.from_cache_dtype(preset, dim)
    h = vllm_hadamard(dim)
    return decode.triton_turboquant_decode_attention(
        query=query, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens, Pi=h,
        centroids=get_centroids(dim, cfg.centroid_bits).float(), scale=scale,
        mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction, PiT=h, max_num_kv_splits=4,
    )
