"""Triton ``kv_dot``: attention logits ``scale * <q, k>`` straight from the packed keys.

Grid ``(sequences, kv heads, position tiles)``; one program computes the logits of one tile of positions for
the kv head's whole query-head group (one fp32 IEEE ``tl.dot``: these logits are read as they are, so they are
computed at full precision). The query arrives rotated (Lloyd-Max keys) and scaled. Positions at or past
``seq_lens[b]`` get -inf; their block-table entries are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import Preset
from tqkv_compile.lowerings.cache_tables import require_vllm_layout
from tqkv_compile.lowerings.device_helpers import key_scores, load_query, logit_tile, store_logits


@triton.jit
def _kv_dot_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, cent_ptr, out_ptr, width,
    s_qb, s_qh, s_qd, s_bt, s_bm, s_blk, s_pos, s_head, s_byte, s_ob, s_oh, s_on,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr, NORM_CORRECTION: tl.constexpr,
):
    seq, q_heads, head_ok, pos, valid, base = logit_tile(block_table_ptr, seq_lens_ptr, s_bt, s_bm, s_blk, s_pos,
                                                         s_head, GROUP, BLOCK_H, BLOCK_SIZE, BLOCK_N)
    q_a, q_b = load_query(q_ptr, seq, q_heads, head_ok, s_qb, s_qh, s_qd, D, KEY_FP8, KEY_BITS, tl.float32,
                          tl.float32)
    logits = key_scores(q_a, q_b, cache_ptr, cent_ptr, base, valid, s_byte, D, KEY_FP8, KEY_BITS, KEY_CODE_BYTES,
                        NORM_CORRECTION, tl.float32, "ieee", tl.float32)
    store_logits(out_ptr, logits, seq, q_heads, head_ok, pos, valid, width, s_ob, s_oh, s_on)


def kv_dot(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           scale: float, preset: Preset, rotation: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """query [B, Hq, D] -> f32 [B, Hq, M * BS] logits; -inf at or past seq_lens[b]."""
    require_vllm_layout(preset)
    batch, heads, dim = query.shape
    kv_heads = kv_cache.shape[2]
    width = block_table.shape[1] * kv_cache.shape[1]
    out = torch.empty(batch, heads, width, dtype=torch.float32, device=query.device)
    if batch == 0 or width == 0:
        return out
    q = (query.float() if preset.key_fp8 else torch.matmul(query.float(), rotation)) * scale
    block_n = 32
    group = heads // kv_heads
    _kv_dot_kernel[(batch, kv_heads, triton.cdiv(width, block_n))](
        q, kv_cache, block_table, seq_lens, centroids, out, width,
        *q.stride(), *block_table.stride(), *kv_cache.stride(), *out.stride(),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_N=block_n, KEY_FP8=preset.key_fp8, KEY_BITS=preset.key_bits, KEY_CODE_BYTES=preset.key_code_bytes,
        NORM_CORRECTION=preset.norm_correction,
        num_warps=4,
    )
    return out
