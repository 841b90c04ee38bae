"""Attention for sequences with many new tokens (prefill, long prefill chunks), and for whole prompts.

Whole prompts (sequences whose new tokens are all their tokens), where the op is handed the step's keys and
values: they attend those as the model made them, in one FlashAttention varlen call (CUDA) or SDPA per
sequence (:func:`whole_prompt_attention`). Nothing is read from the cache. vLLM's TurboQuant backend does the
same for a first chunk, so that prefill costs what it costs on a bf16 cache; the prompt's later tokens (and
every later step) read the keys and values through the codec.

Continuation chunks with many new tokens (:func:`dense_attention`): the decode kernels serve any number of
new tokens, but each query row re-reads the whole context: at a 4096-token chunk that is 4096 passes over the
cache per layer. Decoding the context once (O(context)) and handing it to a tensor-core attention kernel is
what vLLM's own TurboQuant backend does for continuation chunks too. Every key and value is read through the
codec, as decode reads them; the decoded keys and values are rounded to the query dtype. The decode is one
call for all the batch's dense sequences: the codec in PyTorch (:func:`codec_decode`, any preset) or the Triton
backend's kernels (``triton_dequant`` for vLLM's layouts, ``general_dequant`` for ours). Attention: where vLLM
brings FlashAttention (CUDA), one varlen call for all of them (GQA, causal aligned bottom-right; FA3 on
Hopper); else SDPA per sequence with a lower-right mask, which takes the memory-efficient kernel, which has no
GQA, so its keys and values are repeated per query head.

:func:`serve` is a backend's whole attention with these paths (the Triton backend's and the PyTorch backend's,
each with its own decode for the other rows).

Planning needs the per-sequence token counts on the host (one sync), so the split is only looked at when the
batch has more query rows than sequences, which never happens in a pure decode step.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from tqkv_compile.backends.reference import decoded_slots
from tqkv_compile.codec import Preset

#: sequences with more new tokens than this take the dense path (vLLM 0.20's continuation threshold too)
DENSE_MIN_NEW_TOKENS = 128


def plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, rows: int, whole_prompts: bool = False,
         dense_path: bool = True) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """(query_start_loc on the host, seq_lens on the host, the dense sequences, the whole prompts) from one
    host read, or None when the batch has neither; None without a host read when it cannot have any.

    Whole prompts (only with ``whole_prompts``: the op was handed the step's keys and values) are the
    sequences whose new tokens are all their tokens, however few; dense ones are the others with more than
    DENSE_MIN_NEW_TOKENS new tokens (none without ``dense_path``). A batch with no more query rows than sequences
    (pure decode) has no whole prompts: a one-token prompt there reads its slot like the rest (no host read where
    the padded row count already says so)."""
    num_seqs = seq_lens.shape[0]
    if rows <= num_seqs or ((rows <= DENSE_MIN_NEW_TOKENS or not dense_path) and not whole_prompts):
        return None
    if query_start_loc.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # no host reads inside CUDA-graph capture; the kernels serve every row
    host = torch.cat([query_start_loc[: num_seqs + 1], seq_lens.to(query_start_loc.dtype)]).tolist()
    starts, lengths = host[: num_seqs + 1], host[num_seqs + 1 :]
    news = [starts[b + 1] - starts[b] for b in range(num_seqs)]
    # whole prompts only in a batch with more query rows (query_start_loc[-1], not the padded row count) than
    # sequences: a batch of one new token per sequence reads the cache (the reference's rule too)
    whole = []
    if whole_prompts and starts[-1] > num_seqs:
        whole = [b for b in range(num_seqs) if 0 < news[b] == lengths[b]]
    taken = set(whole)
    dense = [b for b in range(num_seqs) if dense_path and news[b] > DENSE_MIN_NEW_TOKENS and b not in taken]
    return (starts, lengths, dense, whole) if dense or whole else None


def _consecutive(seqs: list[int]) -> bool:
    """Whether ``seqs`` are consecutive sequence indices (vLLM puts prefills last): one slice of the block
    table's rows and of the query's."""
    return seqs == list(range(seqs[0], seqs[-1] + 1))


def _query_rows(seqs: list[int], starts: list[int], device: torch.device) -> slice | torch.Tensor:
    """The query rows of sequences ``seqs``: a slice (a view) when they are consecutive, else an index."""
    if _consecutive(seqs):
        return slice(starts[seqs[0]], starts[seqs[-1] + 1])
    return torch.cat([torch.arange(starts[b], starts[b + 1]) for b in seqs]).to(device)


def slot_ids(block_table: torch.Tensor, seqs: list[int], lengths: list[int], block_size: int) -> torch.Tensor:
    """int64 [sum of lengths of seqs]: the flat cache slots (``block * block_size + position``) of positions
    0..length-1 of each sequence in ``seqs``, one sequence after another. Every slot of the sequences' first
    blocks in one broadcast, then each sequence's first ``length`` (a view when they fill their blocks alike):
    a few kernels however many sequences, no host-to-device copy when ``seqs`` are consecutive (repeat_interleave
    and a gather took 230-430 us on the H200 at 16384 positions)."""
    device = block_table.device
    if _consecutive(seqs):
        rows = block_table[seqs[0] : seqs[-1] + 1]
    else:
        rows = block_table[torch.tensor(seqs, device=device)]
    counts = [lengths[b] for b in seqs]
    blocks = -(-max(counts) // block_size)
    if blocks > rows.shape[1]:
        raise ValueError(f"seq_lens: a sequence of {max(counts)} positions needs {blocks} blocks, but the block "
                         f"table has {rows.shape[1]} per sequence")
    every = (rows[:, :blocks].to(torch.int64)[:, :, None] * block_size
             + torch.arange(block_size, device=device)).reshape(len(seqs), blocks * block_size)
    if all(n == blocks * block_size for n in counts):
        return every.reshape(-1)
    return torch.cat([every[i, :n] for i, n in enumerate(counts)])


def codec_decode(kv_cache: torch.Tensor, slots: torch.Tensor, preset: Preset,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) ``dtype`` [T, Hk, D] of the flat cache slots ``slots`` through the codec (PyTorch; any
    preset, any device): keys in the stored basis times their norm, values in the original basis."""
    block_size = kv_cache.shape[1]
    keys, values = decoded_slots(kv_cache[slots // block_size, slots % block_size], preset)
    return keys.to(dtype), values.to(dtype)


def stored_basis(query: torch.Tensor, preset: Preset, scale: float) -> tuple[torch.Tensor, float]:
    """(the query in the keys' stored basis, in its dtype; the softmax scale that goes with it): the fp32 product
    with the rotation, rounded once to the query's dtype."""
    if preset.key_fp8:
        return query, scale
    return (query.float() @ preset.rotation(query.device)).to(query.dtype), scale


def dense_dtype(query_dtype: torch.dtype) -> torch.dtype:
    """The dtype the dense path decodes into and attends in: fp16 for bf16 queries, else the query's. The decoded
    keys and the rotated query rounded to bf16 (8-bit significands) move peaked logits enough to miss the
    kernels' tolerance against exact attention (max 3-5% at 20000 positions, H100); fp16's 11 bits keep it. The
    decoded keys and values fit fp16 (the slots hold their norms, scales and zero points as fp16); a query
    element past fp16's range (65504) would not."""
    return torch.float16 if query_dtype == torch.bfloat16 else query_dtype


def dense_attention(query, kv_cache, block_table, lengths: list[int], starts: list[int], scale: float,
                    preset: Preset, seqs: list[int], out: torch.Tensor, decode=codec_decode, varlen=None) -> None:
    """Writes the attention of sequences ``seqs`` (their rows of ``query``, from ``starts`` and ``lengths``:
    query_start_loc and seq_lens on the host) into ``out``. ``decode(kv_cache, slots, preset, dtype)`` turns
    flat cache slots into dense keys and values (:func:`codec_decode`, or a kernel with its contract); it runs
    once for all of ``seqs``. ``varlen``: a FlashAttention ``flash_attn_varlen_func``
    (``tqkv_compile.vllm.adapter.flash_attn_varlen``), which then attends every sequence in one call; without
    it, SDPA per sequence. bf16 queries attend in fp16 (:func:`dense_dtype`)."""
    dtype = dense_dtype(query.dtype)
    keys, values = decode(kv_cache, slot_ids(block_table, seqs, lengths, kv_cache.shape[1]), preset, dtype)
    if varlen is not None:
        news = [starts[b + 1] - starts[b] for b in seqs]
        rows = _query_rows(seqs, starts, query.device)
        q, q_scale = stored_basis(query[rows].to(dtype), preset, scale)
        cu = torch.tensor([0, *itertools.accumulate(news), 0, *itertools.accumulate(lengths[b] for b in seqs)],
                          dtype=torch.int32, device=query.device).view(2, -1)  # one host-to-device copy
        _varlen_into(varlen, out, rows, dtype, q=q, k=keys, v=values, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1],
                     max_seqlen_q=max(news), max_seqlen_k=max(lengths[b] for b in seqs), softmax_scale=q_scale,
                     causal=True)  # bottom-right
        return
    kv_heads = kv_cache.shape[2]
    at = 0
    for b in seqs:
        start, end, length = starts[b], starts[b + 1], lengths[b]
        new = end - start
        q, q_scale = stored_basis(query[start:end].to(dtype), preset, scale)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, new, D]
        k = keys[at : at + length].transpose(0, 1).unsqueeze(0)  # [1, Hk, L, D]
        v = values[at : at + length].transpose(0, 1).unsqueeze(0)
        at += length
        if new == length:  # flash attention reads the kv head of each query head group itself
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=q_scale, enable_gqa=True)
        else:  # the new tokens are the last `new` of `length`: causal aligned bottom-right
            from torch.nn.attention.bias import causal_lower_right

            group = query.shape[1] // kv_heads  # the lower-right mask takes the memory-efficient kernel: no GQA
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(new, length), scale=q_scale)
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)


def _varlen_into(varlen, out: torch.Tensor, rows, dtype: torch.dtype, **args) -> None:
    """One FlashAttention varlen call whose result lands in ``out[rows]``: written there in place when the rows
    are a slice and ``out`` has the query's dtype, else copied."""
    into = out[rows] if isinstance(rows, slice) and out.dtype == dtype else None
    o = varlen(out=into, **args)
    if into is None:
        out[rows] = o.to(out.dtype)


def whole_prompt_attention(query, key, value, starts: list[int], scale: float, seqs: list[int], out: torch.Tensor,
                           varlen=None) -> None:
    """Writes the attention of the whole prompts ``seqs`` (sequences whose new tokens are all their tokens;
    their rows of ``query``, from ``starts``: query_start_loc on the host) over the step's own ``key`` and
    ``value`` rows, as the model made them (no codec), into ``out``: what vLLM's TurboQuant does for a first
    chunk, and nothing to decode. One FlashAttention varlen call where ``varlen`` is given, else SDPA per
    sequence (causal, GQA)."""
    news = [starts[b + 1] - starts[b] for b in seqs]
    if varlen is not None:
        rows = _query_rows(seqs, starts, query.device)
        cu = torch.tensor([0, *itertools.accumulate(news)], dtype=torch.int32, device=query.device)
        _varlen_into(varlen, out, rows, query.dtype, q=query[rows], k=key[rows], v=value[rows], cu_seqlens_q=cu,
                     cu_seqlens_k=cu, max_seqlen_q=max(news), max_seqlen_k=max(news), softmax_scale=scale,
                     causal=True)
        return
    for b in seqs:
        q, k, v = (t[starts[b] : starts[b + 1]].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out[starts[b] : starts[b + 1]] = o[0].transpose(0, 1).to(out.dtype)


def serve(query, kv_cache, block_table, seq_lens, query_start_loc, scale: float, preset: Preset, key, value, out,
          *, decode, dense_decode=codec_decode, find_varlen=None, dense_path: bool = True) -> torch.Tensor:
    """A backend's attention for any batch: ``decode`` (the backend's decode path, with ``attention``'s arguments
    and ``out``) for every row, except whole prompts (given the step's ``key`` and ``value``:
    :func:`whole_prompt_attention`) and sequences with more than DENSE_MIN_NEW_TOKENS new tokens
    (:func:`dense_attention`, their keys and values by ``dense_decode``, :func:`codec_decode` unless given;
    ``dense_path=False``: ``decode`` serves them too, where it is the faster of the two).
    ``find_varlen()``: a FlashAttention varlen function for both, or None (SDPA); asked only when a prefill path
    runs (a pure decode batch looks nothing up). Writes into ``out`` where given."""
    planned = plan(query_start_loc, seq_lens, query.shape[0], whole_prompts=key is not None,
                   dense_path=dense_path)
    if planned is None:
        return decode(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, out=out)
    starts, lengths, dense, whole = planned
    varlen = find_varlen() if find_varlen is not None else None
    # rows past query_start_loc[-1] (padding) stay zero, as the reference's
    out = torch.zeros_like(query) if out is None else out.zero_()
    short = sorted(set(range(seq_lens.shape[0])) - set(dense) - set(whole))
    if short:
        if short == list(range(len(short))):  # vLLM's order: decodes first, so usually a plain prefix
            rows = slice(0, starts[len(short)])
            decode(query[rows], kv_cache, block_table[: len(short)], seq_lens[: len(short)],
                   query_start_loc[: len(short) + 1], scale, preset, out=out[rows])
        else:
            index = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in short]).to(query.device)
            counts = torch.tensor([0] + [starts[b + 1] - starts[b] for b in short]).cumsum(0)
            picked = torch.tensor(short, device=query.device)
            out[index] = decode(query[index], kv_cache, block_table[picked], seq_lens[picked],
                                counts.to(query_start_loc.device, query_start_loc.dtype), scale, preset)
    if dense:
        dense_attention(query, kv_cache, block_table, lengths, starts, scale, preset, dense, out,
                        decode=dense_decode, varlen=varlen)
    if whole:
        whole_prompt_attention(query, key, value, starts, scale, whole, out, varlen=varlen)
    return out
