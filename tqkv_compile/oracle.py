"""The correctness oracle for every attention kernel: exact attention over the codec's decode of the cache bytes.

A kernel is judged against what the bytes it reads mean, not against another kernel: the keys and values are
``get_preset(name, D).decode`` of the very slots in the cache (fp32, the original basis), and the attention
over them is computed in fp64, causal and bottom-right aligned for several rows a sequence (row ``j`` of a
sequence with ``n`` new rows and ``L`` positions sees positions ``0 .. L - n + j``), as ``ops.attention``
defines it. Used by the CPU tests (interpreted kernels) and by ``tqkv bench kernels --check`` on the GPU.

Errors (:func:`errors`): ``l2_rel`` = ||out - exact|| / ||exact|| over the whole output; ``max_rel`` = the
largest, over (row, query head), of max|out - exact| / max|exact| within that head's output vector (a
per-element relative error is undefined where the exact value is near zero).
"""

from __future__ import annotations

import torch

from tqkv_compile.codec import Preset


def context_slots(kv_cache: torch.Tensor, block_table: torch.Tensor, seq: int, length: int) -> torch.Tensor:
    """The slots of sequence ``seq``'s first ``length`` positions: uint8 [length, Hk, slot_bytes], read through
    the block table from a cache view [num_blocks, block_size, Hk, slot_bytes] (any strides)."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(length, device=kv_cache.device)
    blocks = block_table[seq].to(kv_cache.device).long()[pos // block_size]
    return kv_cache[blocks, pos % block_size]


def exact_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, preset: Preset) -> torch.Tensor:
    """query [T, Hq, D] -> fp32 [T, Hq, D]: ``ops.attention``'s contract computed in fp64 over the codec's decode
    of the cache. Rows past ``query_start_loc[-1]`` are zero."""
    rows, heads, dim = query.shape
    kv_heads = kv_cache.shape[2]
    group = heads // kv_heads
    out = torch.zeros(rows, heads, dim, dtype=torch.float32, device=query.device)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    for seq, length in enumerate(lengths):
        first, stop = starts[seq], starts[seq + 1]
        n = stop - first
        if n == 0:
            continue
        keys, values = preset.decode(context_slots(kv_cache, block_table, seq, length))  # [L, Hk, D] fp32
        keys = keys.to(query.device, torch.float64)
        values = values.to(query.device, torch.float64)
        q = query[first:stop].to(torch.float64).view(n, kv_heads, group, dim)
        scores = torch.einsum("nhgd,lhd->hgnl", q, keys) * scale
        last = length - n + torch.arange(n, device=query.device)  # each row's last visible position
        hidden = torch.arange(length, device=query.device)[None, :] > last[:, None]
        scores.masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[first:stop] = torch.einsum("hgnl,lhd->nhgd", weights, values).reshape(n, heads, dim).float()
    return out


def exact_logits(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, preset: Preset) -> torch.Tensor:
    """``ops.kv_dot``'s contract in fp64 over the codec's decode: query [B, Hq, D] -> fp32 [B, Hq, M * BS],
    ``scale * <q, k>``, -inf at and past each sequence's length."""
    batch, heads, dim = query.shape
    kv_heads = kv_cache.shape[2]
    width = block_table.shape[1] * kv_cache.shape[1]
    out = torch.full((batch, heads, width), float("-inf"), dtype=torch.float32, device=query.device)
    for seq, length in enumerate(seq_lens.tolist()):
        keys = preset.decode_keys(context_slots(kv_cache, block_table, seq, length)).to(query.device, torch.float64)
        q = query[seq].to(torch.float64).view(kv_heads, heads // kv_heads, dim)
        out[seq, :, :length] = (torch.einsum("hgd,lhd->hgl", q, keys) * scale).reshape(heads, length).float()
    return out


def errors(out: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(l2_rel, max_rel) of ``out`` against ``exact``, both [T, H, D] (see the module docstring); NaN or inf
    anywhere in ``out`` gives inf."""
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf"), float("inf")
    diff = out - exact
    l2 = float(diff.norm() / exact.norm().clamp_min(1e-30))
    per_head = diff.abs().amax(-1) / exact.abs().amax(-1).clamp_min(1e-30)
    return l2, float(per_head.max())
