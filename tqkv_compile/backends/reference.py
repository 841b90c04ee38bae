"""The reference memory backend: plain PyTorch on any device; the fallback and the oracle.

It decodes the slots a sequence owns with the codec and runs exact fp32 attention over them, so it is
slow at long context by design (it reads every position once per query step) and simple to trust.
"""

from __future__ import annotations

import torch

from tqkv_compile.codec import Preset


def gather_slots(kv_cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """uint8 [length, Hk, S]: the slots of positions 0..length-1 of one sequence (any cache strides)."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(length, device=kv_cache.device)
    blocks = block_row.to(kv_cache.device, torch.int64)[pos // block_size]
    return kv_cache[blocks, pos % block_size]


class ReferenceBackend:
    name = "reference"

    def supports(self, device: torch.device) -> bool:
        return True

    def kv_write(self, key, value, kv_cache, slot_mapping, preset: Preset) -> None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].to(torch.int64)
        if slots.numel() == 0:
            return
        block_size = kv_cache.shape[1]
        encoded = preset.encode(key[keep], value[keep]).to(kv_cache.device)
        kv_cache[slots // block_size, slots % block_size] = encoded

    def _keys_values(self, kv_cache, block_row, length, preset: Preset, group: int):
        keys, values = preset.decode(gather_slots(kv_cache, block_row, length))
        return keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # [L, Hq, D]

    def attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset: Preset):
        out = torch.zeros_like(query)
        group = query.shape[1] // kv_cache.shape[2]
        starts = query_start_loc.tolist()
        lengths = seq_lens.tolist()
        for b, length in enumerate(lengths):
            start, end = starts[b], starts[b + 1]
            new = end - start
            if new <= 0:
                continue
            keys, values = self._keys_values(kv_cache, block_table[b], length, preset, group)
            q = query[start:end].float()
            scores = torch.einsum("nhd,lhd->hnl", q, keys) * scale
            query_pos = torch.arange(length - new, length, device=q.device)
            future = torch.arange(length, device=q.device)[None, :] > query_pos[:, None]
            scores = scores.masked_fill(future[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.einsum("hnl,lhd->nhd", probs, values).to(query.dtype)
        return out

    def kv_dot(self, query, kv_cache, block_table, seq_lens, scale, preset: Preset):
        batch, heads, _ = query.shape
        width = block_table.shape[1] * kv_cache.shape[1]
        logits = torch.full((batch, heads, width), float("-inf"), dtype=torch.float32, device=query.device)
        group = heads // kv_cache.shape[2]
        for b, length in enumerate(seq_lens.tolist()):
            if length <= 0:
                continue
            keys, _ = self._keys_values(kv_cache, block_table[b], length, preset, group)
            logits[b, :, :length] = torch.einsum("hd,lhd->hl", query[b].float(), keys) * scale
        return logits
