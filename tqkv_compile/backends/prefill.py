"""Attention for sequences with many new tokens (prefill, long prefill chunks): the sequence's slots decoded
with the codec, then one fused SDPA call (flash / memory-efficient on CUDA) with a lower-right causal mask.

The decode kernels serve any number of new tokens, but each query row re-reads the whole context: at a
4096-token prompt that is 4096 passes over the cache per layer, hours for a batch of long prompts. Decoding
the context once (O(context)) and handing it to a tensor-core attention kernel is what vLLM's own TurboQuant
backend does for continuation chunks too. The semantics stay the ops' (every key and value read through the
codec, as decode reads them); the decoded keys and values are rounded to the query dtype for SDPA.

Planning needs the per-sequence token counts on the host (one sync), so the split is only looked at when the
batch has more query rows than sequences, which never happens in a pure decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tqkv_compile.backends.reference import decoded_keys_values, rotated_query
from tqkv_compile.codec import Preset

#: sequences with more new tokens than this take the dense path (vLLM 0.20's continuation threshold too)
DENSE_MIN_NEW_TOKENS = 128


def plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, rows: int) -> tuple[list[int], list[int]] | None:
    """(query_start_loc on the host, the sequences with more than DENSE_MIN_NEW_TOKENS new tokens), or None when
    there are none; None without a host sync when the batch cannot have any."""
    num_seqs = seq_lens.shape[0]
    if rows <= num_seqs or rows <= DENSE_MIN_NEW_TOKENS:
        return None
    if query_start_loc.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # no host reads inside CUDA-graph capture; the kernels serve every row
    starts = query_start_loc[: num_seqs + 1].tolist()
    dense = [b for b in range(num_seqs) if starts[b + 1] - starts[b] > DENSE_MIN_NEW_TOKENS]
    return (starts, dense) if dense else None


def dense_attention(query, kv_cache, block_table, seq_lens, starts: list[int], scale: float, preset: Preset,
                    seqs: list[int], out: torch.Tensor) -> None:
    """Writes the attention of sequences ``seqs`` (their rows of ``query``, from ``starts``: query_start_loc on
    the host) into ``out``."""
    lengths = seq_lens.tolist()
    group = query.shape[1] // kv_cache.shape[2]
    for b in seqs:
        start, end, length = starts[b], starts[b + 1], lengths[b]
        new = end - start
        keys, values = decoded_keys_values(kv_cache, block_table[b], length, preset)  # [L, Hk, D], stored basis
        q = rotated_query(query[start:end], preset).to(query.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hq, new, D]
        k = keys.to(query.dtype).transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)  # [1, Hq, L, D]
        v = values.to(query.dtype).transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
        if new == length:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:  # the new tokens are the last `new` of `length`: causal aligned bottom-right
            from torch.nn.attention.bias import causal_lower_right

            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(new, length), scale=scale)
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
