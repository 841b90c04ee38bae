"""The general ``kv_dot`` kernel: attention logits ``scale * <q, k>`` for the presets of ours (the layout:
:mod:`~tqkv_compile.lowerings.general_fields`), fp32, the decode kernel's scores (outlier channel included).
Grid and output as :mod:`~tqkv_compile.lowerings.triton_kv_dot`'s: ``(sequences, kv heads, position tiles)``,
-inf at or past ``seq_lens[b]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkv_compile.codec import Preset
from tqkv_compile.lowerings.device_helpers import logit_tile, store_logits
from tqkv_compile.lowerings.general_fields import general_scores


@triton.jit
def _general_kv_dot_kernel(
    q_ptr, q_raw_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, cent_ptr, rot_ptr, out_ptr, width,
    s_bt, s_bm, s_blk, s_pos, s_head, s_byte, s_ob, s_oh, s_on,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    KEY_BITS: tl.constexpr, KEY_WIDE: tl.constexpr, KEY_CODE_BYTES: tl.constexpr, OUTLIERS: tl.constexpr,
    KC: tl.constexpr, KCW: tl.constexpr,
):
    seq, q_heads, head_ok, pos, valid, base = logit_tile(block_table_ptr, seq_lens_ptr, s_bt, s_bm, s_blk, s_pos,
                                                         s_head, GROUP, BLOCK_H, BLOCK_SIZE, BLOCK_N)
    heads = GROUP * tl.num_programs(1)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (seq * heads + q_heads)[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0)
    logits = general_scores(q, q_raw_ptr + seq * heads * D, q_heads, head_ok, cache_ptr, cent_ptr, rot_ptr, base, valid,
                            s_byte, D, KEY_BITS, KEY_WIDE, KEY_CODE_BYTES, OUTLIERS, KC, KCW, tl.float32, "ieee")
    store_logits(out_ptr, logits, seq, q_heads, head_ok, pos, valid, width, s_ob, s_oh, s_on)


def kv_dot(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           scale: float, preset: Preset, rotation: torch.Tensor, centroids: torch.Tensor, offsets: dict) -> torch.Tensor:
    """As ``triton_kv_dot.kv_dot`` for a preset of ours."""
    batch, heads, dim = query.shape
    kv_heads = kv_cache.shape[2]
    width = block_table.shape[1] * kv_cache.shape[1]
    out = torch.empty(batch, heads, width, dtype=torch.float32, device=query.device)
    if batch == 0 or width == 0:
        return out
    q_raw = (query.float() * scale).contiguous()
    q = torch.matmul(q_raw, rotation).contiguous()
    block_n = 32
    group = heads // kv_heads
    _general_kv_dot_kernel[(batch, kv_heads, triton.cdiv(width, block_n))](
        q, q_raw, kv_cache, block_table, seq_lens, centroids, rotation, out, width,
        *block_table.stride(), *kv_cache.stride(), *out.stride(),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_N=block_n, KEY_BITS=preset.key_bits, KEY_WIDE=preset.key_wide_coords,
        KEY_CODE_BYTES=preset.key_code_bytes, OUTLIERS=preset.key_outliers,
        KC=offsets["KC"], KCW=offsets["KCW"], num_warps=4,
    )
    return out
