"""A paged batch for the kernel tests against the oracle: a cache written by the reference's kv_write with its
blocks shuffled, a block table, lengths, query_start_loc and queries (tests/test_cpu_kernel.py,
tests/test_kernel_oracle.py)."""

from __future__ import annotations

import math

import torch

import tqkv_compile


def paged_batch(preset, lens, rows, kv_heads, group, q_scale=1.0, dtype=torch.bfloat16, block=16, strided=False,
                seed=0, kv_dtype=torch.float32):
    """A cache with ``lens`` positions a sequence (N(0, 1) keys and values written by the reference's kv_write,
    blocks shuffled, junk block ids past each sequence's blocks) and ``rows`` query rows a sequence: (cache,
    block table, seq_lens, query_start_loc, query ``dtype``). The keys and values are drawn in fp32 and given to
    kv_write in ``kv_dtype``. ``strided``: vLLM's CPU allocation [NB, Hk, BS, 2 D] permuted and sliced to the
    slot."""
    g = torch.Generator().manual_seed(seed)
    dim = preset.head_dim
    blocks = [math.ceil(length / block) for length in lens]
    num_blocks = sum(blocks) + 2
    if strided:
        base = torch.zeros(num_blocks, kv_heads, block, 2 * dim, dtype=torch.uint8)
        cache = base.permute(0, 2, 1, 3)[..., : preset.slot_bytes]
    else:
        cache = torch.zeros(num_blocks, block, kv_heads, preset.slot_bytes, dtype=torch.uint8)
    order = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(lens), max(blocks) + 1), 10_000, dtype=torch.int32)
    used = 0
    reference = tqkv_compile.get_backend("reference")
    for b, length in enumerate(lens):
        table[b, : blocks[b]] = order[used : used + blocks[b]].to(torch.int32)
        used += blocks[b]
        pos = torch.arange(length)
        slots = table[b, pos // block].long() * block + pos % block
        k = torch.randn(length, kv_heads, dim, generator=g).to(kv_dtype)
        v = torch.randn(length, kv_heads, dim, generator=g).to(kv_dtype)
        reference.kv_write(k, v, cache, slots, preset)
    qsl = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    query = (torch.randn(int(qsl[-1]), kv_heads * group, dim, generator=g) * q_scale).to(dtype)
    return cache, table, torch.tensor(lens, dtype=torch.int32), qsl, query
