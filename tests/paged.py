"""Builds paged-cache scenarios for op tests: sequences written with tqkv.kv_write, their metadata and K/V."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import tqkv_compile  # noqa: F401
from tqkv_compile import get_preset


@dataclass
class Scenario:
    preset: str
    kv_cache: torch.Tensor  # [NB, BS, Hk, S] (possibly a strided view)
    block_table: torch.Tensor  # i32 [B, M]
    seq_lens: torch.Tensor  # i32 [B]
    query_start_loc: torch.Tensor  # i32 [B + 1]
    query: torch.Tensor  # [T, Hq, D]
    keys: list  # per sequence fp32 [L, Hk, D], the original keys
    values: list


def build(preset, dim=64, kv_heads=2, group=2, lens=(5, 17), new=(1, 1), block_size=4, dtype=torch.bfloat16,
          strided=False, seed=0) -> Scenario:
    g = torch.Generator().manual_seed(seed)
    p = get_preset(preset, dim)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in lens]
    width = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 3
    if strided:  # vLLM's CPU allocation: heads before positions, 2*D bytes per token and head
        base = torch.zeros(num_blocks, kv_heads, block_size, 2 * dim, dtype=torch.uint8)
        kv_cache = base.permute(0, 2, 1, 3)[..., : p.slot_bytes]
    else:
        kv_cache = torch.zeros(num_blocks, block_size, kv_heads, p.slot_bytes, dtype=torch.uint8)
    order = torch.randperm(num_blocks, generator=g)
    block_table = torch.full((len(lens), width), 10_000, dtype=torch.int32)  # junk past a sequence's blocks
    keys, values, used = [], [], 0
    for b, length in enumerate(lens):
        row = order[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_table[b, : len(row)] = row.to(torch.int32)
        k = (torch.randn(length, kv_heads, dim, generator=g)).to(dtype)
        v = torch.randn(length, kv_heads, dim, generator=g).to(dtype)
        pos = torch.arange(length)
        slots = (block_table[b, pos // block_size].long() * block_size + pos % block_size)
        torch.ops.tqkv.kv_write(k, v, kv_cache, slots, preset)
        keys.append(k.float())
        values.append(v.float())
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], kv_heads * group, dim, generator=g).to(dtype)
    return Scenario(preset, kv_cache, block_table, torch.tensor(lens, dtype=torch.int32),
                    torch.tensor(starts, dtype=torch.int32), query, keys, values)


def sdpa_over(s: Scenario, keys: list, values: list, scale: float) -> torch.Tensor:
    """fp32 causal SDPA of the scenario's queries over the given per-sequence K/V: [T, Hq, D]."""
    out = torch.zeros(s.query.shape, dtype=torch.float32)
    starts = s.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(keys, values)):
        q = s.query[starts[b] : starts[b + 1]].float()
        n, heads, length = q.shape[0], q.shape[1], k.shape[0]
        group = heads // k.shape[1]
        kk = k.repeat_interleave(group, 1).transpose(0, 1)
        vv = v.repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=scale)
        out[starts[b] : starts[b + 1]] = o.transpose(0, 1)
    return out


def decoded(s: Scenario):
    """Per-sequence (key_hat, value_hat): the codec's decode of the bytes kv_write stored."""
    p = get_preset(s.preset, s.query.shape[-1])
    block_size, pairs = s.kv_cache.shape[1], []
    for b, length in enumerate(s.seq_lens.tolist()):
        pos = torch.arange(length)
        pairs.append(p.decode(s.kv_cache[s.block_table[b, pos // block_size].long(), pos % block_size]))
    return [k for k, _ in pairs], [v for _, v in pairs]


def step_kv(s: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's keys and values [T, Hk, D] in the query's dtype, one row per query row: each sequence's last
    ``new`` original keys and values (the ones kv_write stored this step)."""
    starts = s.query_start_loc.tolist()
    news = [b - a for a, b in zip(starts, starts[1:])]
    key = torch.cat([k[k.shape[0] - n :] for k, n in zip(s.keys, news)]).to(s.query.dtype)
    value = torch.cat([v[v.shape[0] - n :] for v, n in zip(s.values, news)]).to(s.query.dtype)
    return key, value
