"""Presets of our own: they fit the slot of the vLLM preset they ride on, beat it per bit, and work end to end
through the codec and the tqkv ops on the CPU's (PyTorch) backend."""

import pytest
import torch

import tqkv_compile  # noqa: F401
from tqkv_compile.codec import OWN_PRESETS, get_preset, own_preset_names, preset_names, unpack_codes

from paged import build, decoded, sdpa_over

HEAD_DIMS = (64, 128, 256)
SCALE = 0.125
OWN = own_preset_names()


def relative_error(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x_hat - x) ** 2).sum() / (x**2).sum())


def outlier_kv(dim: int, tokens: int = 256, heads: int = 2, seed: int = 0):
    """Gaussian K/V with one dominant key channel (a third of the energy at head 64, as measured on
    SmolLM2's keys) and a large value channel."""
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(tokens, heads, dim, generator=g)
    key[..., 3] *= (dim / 2) ** 0.5
    value = torch.randn(tokens, heads, dim, generator=g)
    value[..., 5] *= 6.0
    return key, value


def test_own_presets_are_named_apart_from_vllms():
    assert OWN and not any(name.startswith("turboquant_") for name in OWN)
    assert preset_names() == ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("name", OWN)
def test_slot_fits_the_vllm_preset_it_rides_on(name, dim):
    host = OWN_PRESETS[name].rides_on
    assert host in preset_names()
    assert get_preset(name, dim).slot_bytes <= get_preset(host, dim).slot_bytes


def test_bits_per_element_at_head_64():
    assert get_preset("tqkv_k4o1v225", 64).bits_per_element == pytest.approx(3.5)
    assert get_preset("tqkv_k5v3", 64).bits_per_element == pytest.approx(4.25)


@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("name", [*preset_names(), *OWN])
def test_round_trip_equals_decode_of_encode(name, dim):
    p = get_preset(name, dim)
    key, value = outlier_kv(dim, tokens=64)
    expected = p.decode(p.encode(key.bfloat16(), value.bfloat16()))
    got = p.round_trip(key.bfloat16(), value.bfloat16())
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dim", HEAD_DIMS)
def test_k4o1v225_keys_beat_4bit_nc_in_the_bytes_of_k3v4_nc(dim):
    ours, k4, k3v4 = (get_preset(n, dim) for n in ("tqkv_k4o1v225", "turboquant_4bit_nc", "turboquant_k3v4_nc"))
    key, value = outlier_kv(dim)
    k_ours, v_ours = ours.decode(ours.encode(key, value))
    assert ours.slot_bytes < k3v4.slot_bytes
    assert relative_error(k_ours, key) < 0.8 * relative_error(k4.decode(k4.encode(key, value))[0], key)
    assert relative_error(v_ours, value) < 0.12  # 2.25-bit values: the cheap half (quality-notes.md)


def test_key_outlier_channel_is_stored_to_fp8_precision():
    p = get_preset("tqkv_k4o1v225", 64)
    key, value = outlier_kv(64, tokens=32)
    key_hat, _ = p.decode(p.encode(key, value))
    top = key.abs().argmax(-1, keepdim=True)
    expected = key.gather(-1, top).to(torch.float8_e4m3fn).float()
    assert torch.equal(key_hat.gather(-1, top), expected)


@pytest.mark.parametrize("dim", HEAD_DIMS)
def test_k5v3_keys_beat_4bit_nc_threefold_in_fewer_bytes(dim):
    ours, host = get_preset("tqkv_k5v3", dim), get_preset("turboquant_4bit_nc", dim)
    key, value = outlier_kv(dim)
    k_ours, v_ours = ours.decode(ours.encode(key, value))
    assert ours.slot_bytes < host.slot_bytes
    assert relative_error(k_ours, key) < relative_error(host.decode(host.encode(key, value))[0], key) / 3
    assert relative_error(v_ours, value) < 0.04


@pytest.mark.parametrize("name", OWN)
def test_attention_equals_fp32_sdpa_over_decoded_kv(name):
    s = build(name, lens=(5, 17, 9), new=(1, 3, 9), group=3, strided=True, dtype=torch.float32)
    out = torch.ops.tqkv.attention(s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, name)
    keys, values = decoded(s)
    torch.testing.assert_close(out, sdpa_over(s, keys, values, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", OWN)
def test_kv_dot_gives_logits_of_decoded_keys(name):
    s = build(name, lens=(6, 13), new=(1, 1), group=2, dtype=torch.float32)
    logits = torch.ops.tqkv.kv_dot(s.query, s.kv_cache, s.block_table, s.seq_lens, SCALE, name)
    keys, _ = decoded(s)
    for b, length in enumerate(s.seq_lens.tolist()):
        expected = torch.einsum("hd,lhd->hl", s.query[b], keys[b].repeat_interleave(2, 1)) * SCALE
        torch.testing.assert_close(logits[b, :, :length], expected, atol=1e-5, rtol=1e-5)
        assert torch.isneginf(logits[b, :, length:]).all()


@pytest.mark.parametrize("name, min_cos", [("tqkv_k4o1v225", 0.93), ("tqkv_k5v3", 0.97), ("tqkv_4bit_pc", 0.98)])
def test_attention_is_close_to_sdpa_over_original_kv(name, min_cos):
    s = build(name, dim=128, lens=(64, 200, 300), new=(1, 1, 1), group=4, dtype=torch.float32, seed=3)
    out = torch.ops.tqkv.attention(s.query, s.kv_cache, s.block_table, s.seq_lens, s.query_start_loc, SCALE, name)
    exact = sdpa_over(s, s.keys, s.values, SCALE)
    assert torch.nn.functional.cosine_similarity(out.flatten(0, 1), exact.flatten(0, 1)).mean() > min_cos


@pytest.mark.parametrize("dim", HEAD_DIMS)
def test_4bit_pc_is_4bit_nc_with_its_norm_corrected_at_the_write(dim):
    """Same bytes as 4bit_nc but the key norm, stored as ||k|| / ||c|| (c the centroids the codes select); read
    without renormalising, it gives 4bit_nc's keys up to the fp16 rounding of one factor."""
    pc, nc = get_preset("tqkv_4bit_pc", dim), get_preset("turboquant_4bit_nc", dim)
    assert pc.vllm_layout and pc.slot_bytes == nc.slot_bytes and not pc.norm_correction
    key, value = outlier_kv(dim)
    ours, theirs = pc.encode(key, value), nc.encode(key, value)
    norm = slice(nc.key_code_bytes, nc.key_code_bytes + 2)
    rest = torch.ones(nc.slot_bytes, dtype=torch.bool)
    rest[norm] = False
    assert torch.equal(ours[..., rest], theirs[..., rest])
    raw = nc.centroids()[unpack_codes(theirs[..., : nc.key_code_bytes], 4, dim)]  # c, not renormalised
    stored = ours[..., norm].contiguous().view(torch.float16)[..., 0].float()
    expected = (key.norm(dim=-1) / raw.norm(dim=-1)).half().float()
    torch.testing.assert_close(stored, expected, atol=0, rtol=1e-3)
    assert (stored != theirs[..., norm].contiguous().view(torch.float16)[..., 0].float()).float().mean() > 0.5
    torch.testing.assert_close(pc.decode_keys(ours), nc.decode_keys(theirs), atol=1e-2, rtol=2e-3)
