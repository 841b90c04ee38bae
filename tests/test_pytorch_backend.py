"""The PyTorch serving backend (tqkv_compile/backends/pytorch.py): the CPU's default, the reference's answers
with SDPA for whole prompts and long chunks; the reference stays the oracle."""

from __future__ import annotations

import pytest
import torch

import tqkv_compile
from paged import build, step_kv
from tqkv_compile import get_backend, get_preset


def test_the_cpu_is_served_by_the_pytorch_backend_and_checked_against_the_reference():
    """Automatic selection on the CPU takes it for vLLM's presets and ours; the validate mode compares it with
    the reference (a report of its own, a difference at float rounding)."""
    for name in ("turboquant_4bit_nc", tqkv_compile.codec.own_preset_names()[0]):
        assert tqkv_compile.select_backend(torch.device("cpu"), get_preset(name, 64)).name == "pytorch"
    s = build("turboquant_4bit_nc", lens=(30, 160), new=(1, 160), dtype=torch.float32, seed=3)
    key, value = step_kv(s)
    tqkv_compile.validation_reports(clear=True)
    tqkv_compile.set_validate(True)
    try:
        torch.ops.tqkv.attention(s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, 0.125,
                                 s.preset, key=key, value=value)
    finally:
        tqkv_compile.set_validate(None)
    (report,) = tqkv_compile.validation_reports(clear=True)
    assert report.backend == "pytorch" and report.op == "attention"
    assert report.max_abs_diff < 1e-5  # SDPA's order of sums, not the einsum's


BATCHES = {  # (lens, new): seq 1 and 4 whole prompts, seq 3 a dense continuation, the others short
    "mixed_order": ((30, 160, 45, 200, 20, 12), (1, 160, 1, 140, 20, 3)),  # short rows apart: the indexed split
    "vllm_order": ((30, 45, 12, 160, 200, 20), (1, 1, 3, 160, 140, 20)),  # short rows first: one slice
}
ROUTES = {"mixed_order": ([1, 4], [3], (0, 2, 5)), "vllm_order": ([3, 5], [4], (0, 1, 2))}


@pytest.mark.parametrize("order", sorted(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset_name", ["turboquant_4bit_nc", "turboquant_k8v4", "turboquant_3bit_nc", "tqkv_k5v3"])
def test_every_kind_of_row_agrees_with_the_reference(preset_name, dtype, order, monkeypatch):
    """One batch of everything: decodes, a short chunk over cached positions and a long continuation (read
    through the codec), two whole prompts (their own keys and values), padding rows, written into a given
    buffer (vLLM's attention_into). Whole prompts take SDPA on their own keys and values; with the native CPU
    kernel every other row goes to it, the long continuation included (apart in the batch: the indexed split;
    first, as vLLM orders them: a slice); without it the continuation takes the dense path (SDPA over its decoded
    context) and the others the reference's attention. Every row agrees with the reference (bf16: the dense
    path rounds the decoded keys and values to the query's dtype), padding stays zero."""
    from tqkv_compile.backends import prefill

    calls = {"whole": [], "dense": []}
    whole_fn, dense_fn = prefill.whole_prompt_attention, prefill.dense_attention
    monkeypatch.setattr(prefill, "whole_prompt_attention",
                        lambda *a, **k: calls["whole"].append(a[5]) or whole_fn(*a, **k))
    monkeypatch.setattr(prefill, "dense_attention", lambda *a, **k: calls["dense"].append(a[7]) or dense_fn(*a, **k))
    lens, new = BATCHES[order]
    whole, dense, short = ROUTES[order]
    s = build(preset_name, lens=lens, new=new, group=2, dtype=dtype, strided=True, seed=21)
    key, value = step_kv(s)
    pad = lambda t: torch.cat([t, torch.randn(2, *t.shape[1:]).to(t.dtype)])  # noqa: E731
    query, key, value = pad(s.query), pad(key), pad(value)
    args = (query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, 64**-0.5, get_preset(preset_name, 64))
    out = torch.full_like(query, float("nan"))
    assert get_backend("pytorch").attention(*args, key=key, value=value, out=out) is out
    assert calls == {"whole": [whole], "dense": []}
    expected = get_backend("reference").attention(*args, key=key, value=value)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    assert not out[s.query.shape[0]:].any()
    rows = torch.cat([torch.arange(int(s.query_start_loc[b]), int(s.query_start_loc[b + 1])) for b in short])
    # without the native CPU decode kernel (TQKV_CPU_KERNEL=0), the reference's own attention, row for row: the
    # short rows' sub-batch (a 3-token chunk among them) takes its per-sequence loop, as the whole batch does
    # there (a batch of decodes alone would take its batched decode, equal only to rounding)
    monkeypatch.setenv("TQKV_CPU_KERNEL", "0")
    out = get_backend("pytorch").attention(*args, key=key, value=value, out=torch.full_like(query, float("nan")))
    assert calls == {"whole": [whole, whole], "dense": [dense]}
    assert torch.equal(out[rows], expected[rows])
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)


def test_a_pure_decode_batch_is_the_references_answer_written_into_out(monkeypatch):
    """Through the native CPU decode kernel: the reference's answer to fp32 rounding; without it
    (``TQKV_CPU_KERNEL=0``): the reference's answer itself."""
    s = build("turboquant_4bit_nc", lens=(9, 30, 17), new=(1, 1, 1), dtype=torch.float32, seed=5)
    args = (s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, 0.125, get_preset("turboquant_4bit_nc", 64))
    expected = get_backend("reference").attention(*args)
    out = torch.full_like(s.query, float("nan"))
    assert get_backend("pytorch").attention(*args, out=out) is out
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("TQKV_CPU_KERNEL", "0")
    out = torch.full_like(s.query, float("nan"))
    assert get_backend("pytorch").attention(*args, out=out) is out
    assert torch.equal(out, expected)
