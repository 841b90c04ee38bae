"""The reference memory backend: plain PyTorch on any device; the oracle (the validate mode compares every other
backend with it; ``TQKV_BACKEND=reference`` serves with it). The CPU is served by the PyTorch backend
(:mod:`tqkv_compile.backends.pytorch`), which runs this decode and SDPA for prefill.

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


def rotated_query(query: torch.Tensor, preset: Preset) -> torch.Tensor:
    """fp32 query in the basis the keys are stored in: q @ H (H symmetric), so <q, k_hat> = <q @ H, k_rot>
    and no key is rotated back (the fp8 preset stores keys unrotated)."""
    q = query.float()
    return q if preset.key_fp8 else q @ preset.rotation(q.device)


def decoded_slots(slots: torch.Tensor, preset: Preset) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys in the stored basis (times their norms) and values, fp32 [..., D], from slots [..., slot_bytes]."""
    unit, norm = preset.decode_keys_rotated(slots)
    return unit * norm[..., None], preset.decode_values(slots)


def decoded_keys_values(kv_cache, block_row, length, preset: Preset) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys in the stored basis (times their norms) and values, fp32 [L, Hk, D]."""
    return decoded_slots(gather_slots(kv_cache, block_row, length), preset)


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

    def attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset: Preset, key=None,
                  value=None, out=None):
        """Every sequence through the codec, except, given the step's ``key`` and ``value``, whole prompts in a
        batch with more query rows (``query_start_loc[-1]``) than sequences: they attend those rows as they are."""
        out = torch.zeros_like(query) if out is None else out.zero_()
        kv_heads = kv_cache.shape[2]
        group = query.shape[1] // kv_heads
        starts = query_start_loc.tolist()
        lengths = seq_lens.tolist()
        if lengths and all(b - a == 1 for a, b in zip(starts, starts[1:])):
            self._decode(query, kv_cache, block_table, seq_lens, starts, max(lengths), scale, preset, out)
            return out
        for b, length in enumerate(lengths):
            start, end = starts[b], starts[b + 1]
            new = end - start
            if new <= 0:
                continue
            if key is not None and new == length and starts[-1] > len(lengths):  # a whole prompt: as given
                keys, values, q = key[start:end].float(), value[start:end].float(), query[start:end].float()
            else:
                keys, values = decoded_keys_values(kv_cache, block_table[b], length, preset)
                q = rotated_query(query[start:end], preset)
            q = q.view(new, kv_heads, group, -1)
            scores = torch.einsum("nkgd,lkd->kgnl", q, keys) * scale
            query_pos = torch.arange(length - new, length, device=q.device)
            future = torch.arange(length, device=q.device)[None, :] > query_pos[:, None]
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            o = torch.einsum("kgnl,lkd->nkgd", probs, values)
            out[start:end] = o.reshape(new, kv_heads * group, -1).to(query.dtype)
        return out

    def _decode(self, query, kv_cache, block_table, seq_lens, starts, longest, scale, preset: Preset, out):
        """One new token per sequence: all sequences at once, padded to the longest."""
        batch, kv_heads, block_size = len(starts) - 1, kv_cache.shape[2], kv_cache.shape[1]
        pos = torch.arange(longest, device=kv_cache.device)
        valid = pos[None, :] < seq_lens.to(kv_cache.device, torch.int64)[:, None]  # [B, L]
        blocks = block_table.to(kv_cache.device, torch.int64)[:, pos // block_size]
        blocks = torch.where(valid, blocks, torch.zeros_like(blocks))  # entries past a sequence may be junk
        keys, values = decoded_slots(kv_cache[blocks, pos % block_size], preset)  # [B, L, Hk, D]
        rows = torch.tensor(starts[:-1], device=query.device)
        q = rotated_query(query[rows], preset).view(batch, kv_heads, -1, query.shape[-1])
        scores = torch.einsum("bkgd,blkd->bkgl", q, keys) * scale
        probs = torch.softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
        o = torch.einsum("bkgl,blkd->bkgd", probs, values)
        out[rows] = o.reshape(batch, -1, query.shape[-1]).to(query.dtype)

    def kv_dot(self, query, kv_cache, block_table, seq_lens, scale, preset: Preset):
        batch, heads, _ = query.shape
        kv_heads = kv_cache.shape[2]
        width = block_table.shape[1] * kv_cache.shape[1]
        logits = torch.full((batch, heads, width), float("-inf"), dtype=torch.float32, device=query.device)
        for b, length in enumerate(seq_lens.tolist()):
            if length <= 0:
                continue
            keys, _ = decoded_keys_values(kv_cache, block_table[b], length, preset)
            q = rotated_query(query[b], preset).view(kv_heads, heads // kv_heads, -1)
            logits[b, :, :length] = torch.einsum("kgd,lkd->kgl", q, keys).reshape(heads, length) * scale
        return logits
