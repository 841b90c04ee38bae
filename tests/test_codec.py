"""The codec speaks vLLM's TurboQuant cache format byte for byte."""

import pytest
import torch

from tqkv_compile import get_preset, lloyd_max, preset_names
from tqkv_compile.codec import FP8_MAX

from vllm_turboquant import vllm_centroids, vllm_dequant, vllm_store

HEAD_DIMS = (64, 128, 256)


def make_case(case: str, dim: int, dtype=torch.bfloat16, tokens=10, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(tokens, heads, dim, generator=g) * 2
    value = torch.randn(tokens, heads, dim, generator=g)
    if case == "zero_key_constant_value":
        key[0] = 0
        value[1] = 0.75
        value[2] = 0
    elif case == "outliers":
        key[:, :, 3] *= 40
        value[:, :, 5] *= 30
    elif case == "tiny":
        key *= 1e-3
        value *= 1e-4
    return key.to(dtype), value.to(dtype)


CASES = ["gaussian", "zero_key_constant_value", "outliers", "tiny"]


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("dim", HEAD_DIMS)
def test_lloyd_max_centroids_equal_vllms(dim, bits):
    assert torch.equal(lloyd_max.centroids(dim, bits), vllm_centroids(dim, bits).float())


def vllm_bytes(name, key, value):
    """What vLLM's store kernel writes for these tokens, read back per token: uint8 [T, Hk, S]."""
    p = get_preset(name, key.shape[-1])
    tokens, heads, _ = key.shape
    block_size = 4
    blocks = (tokens + block_size - 1) // block_size + 1
    cache = torch.zeros(blocks, block_size, heads, p.slot_bytes, dtype=torch.uint8)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(1))[:tokens].to(torch.int32)
    vllm_store(name, key, value, cache, slots)
    return cache.reshape(blocks * block_size, heads, -1)[slots.long()]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("name", [n for n in preset_names() if n != "turboquant_k8v4"])
def test_encode_equals_vllm_store_kernel_bytes(name, dim, case):
    key, value = make_case(case, dim)
    assert torch.equal(get_preset(name, dim).encode(key, value), vllm_bytes(name, key, value))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dim", HEAD_DIMS)
def test_k8v4_values_equal_vllm_and_keys_round_to_nearest_even(dim, case):
    """Values: vLLM's bytes. fp8 keys: the GPU's cvt.rn.satfinite (round to nearest even, saturate).

    Triton's interpreter casts fp32 -> fp8 with its own rounding (1.96875 -> 1.0, ties away from even), so on
    the CPU vLLM's key bytes are not the GPU's; the key part is checked against IEEE round-to-nearest-even.
    """
    p = get_preset("turboquant_k8v4", dim)
    key, value = make_case(case, dim)
    ours = p.encode(key, value)
    assert torch.equal(ours[..., dim : p.key_bytes + p.value_bytes], vllm_bytes(p.name, key, value)[..., dim : p.key_bytes + p.value_bytes])
    expected_keys = key.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(ours[..., :dim].view(torch.float8_e4m3fn).float(), expected_keys.float())


def test_encode_accepts_fp16_bf16_fp32_and_agrees_for_identical_values():
    p = get_preset("turboquant_4bit_nc", 128)
    key, value = make_case("gaussian", 128, dtype=torch.bfloat16)
    outs = [p.encode(key.to(dt), value.to(dt)) for dt in (torch.bfloat16, torch.float16, torch.float32)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("name", preset_names())
def test_decode_of_vllm_written_bytes_equals_vllms_dequantization(name, dim):
    p = get_preset(name, dim)
    key, value = make_case("zero_key_constant_value", dim, tokens=8)
    cache = torch.zeros(2, 4, key.shape[1], p.slot_bytes, dtype=torch.uint8)
    vllm_store(name, key, value, cache, torch.arange(8, dtype=torch.int32))
    block_table = torch.tensor([[0, 1]], dtype=torch.int32)
    vllm_keys_rotated, vllm_values = vllm_dequant(name, cache, block_table, 8)
    slots = cache.reshape(8, key.shape[1], -1)
    unit, norm = p.decode_keys_rotated(slots)
    ours_rotated = unit * norm[..., None]
    # vLLM's dequant kernel rounds its output to fp16: compare at fp16.
    assert torch.equal(ours_rotated.half(), vllm_keys_rotated)
    _, values = p.decode(slots)
    assert torch.equal(values.half(), vllm_values)


@pytest.mark.parametrize("name", preset_names())
def test_decode_reconstructs_keys_and_values_in_the_original_basis(name):
    p = get_preset(name, 128)
    key, value = make_case("gaussian", 128, dtype=torch.float32, tokens=64)
    key_hat, value_hat = p.decode(p.encode(key, value))
    cos = torch.nn.functional.cosine_similarity
    assert cos(key_hat.flatten(0, 1), key.flatten(0, 1)).mean() > (0.99 if p.key_fp8 else 0.97)
    assert cos(value_hat.flatten(0, 1), value.flatten(0, 1)).mean() > (0.97 if p.value_bits == 3 else 0.99)


def test_slot_bytes_match_vllms_presets():
    expected = {
        "turboquant_k8v4": (100, 196, 388),
        "turboquant_4bit_nc": (70, 134, 262),
        "turboquant_k3v4_nc": (62, 118, 230),
        "turboquant_3bit_nc": (54, 102, 198),
    }
    for name, sizes in expected.items():
        assert tuple(get_preset(name, d).slot_bytes for d in HEAD_DIMS) == sizes
    assert get_preset("turboquant_4bit_nc", 64).bits_per_element == pytest.approx(4.375)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: get_preset("turboquant_5bit", 128), "preset"),
        (lambda: get_preset("turboquant_4bit_nc", 96), "head_dim"),
        (lambda: get_preset("turboquant_4bit_nc", 64).encode(torch.zeros(2, 1, 128), torch.zeros(2, 1, 128)), "key"),
        (lambda: get_preset("turboquant_4bit_nc", 64).encode(torch.zeros(2, 1, 64), torch.zeros(3, 1, 64)), "shape"),
        (lambda: get_preset("turboquant_4bit_nc", 64).decode(torch.zeros(2, 1, 69, dtype=torch.uint8)), "slots"),
    ],
)
def test_bad_codec_input_raises_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_integer_key_raises_type_error():
    with pytest.raises(TypeError, match="key"):
        get_preset("turboquant_4bit_nc", 64).encode(torch.zeros(2, 1, 64, dtype=torch.int32), torch.zeros(2, 1, 64))


@pytest.mark.parametrize("head_dim", [4096 / 32, True, "128"])
def test_a_head_size_that_is_not_an_int_raises_type_error_and_leaves_the_cache_alone(head_dim):
    """hidden_size / num_heads is a float; 128.0 == 128 as a cache key, so a float that got in would be
    served as head 128's preset to every later caller (whose ops then failed on a float head size)."""
    with pytest.raises(TypeError, match="head_dim"):
        get_preset("turboquant_4bit_nc", head_dim)
    preset = get_preset("turboquant_4bit_nc", 128)
    assert type(preset.head_dim) is int and preset.head_dim == 128


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_unpacked_codes_are_the_packed_ones_and_byte_splits_match_the_word_path(bits):
    """unpack_codes inverts pack_codes at every width a preset uses (and a few more), over leading dimensions;
    the byte splits of 4- and 8-bit codes give what the general word path gives, code for code."""
    from tqkv_compile.codec import _unpack_words, pack_codes, unpack_codes

    codes = torch.randint(0, 1 << bits, (3, 5, 64), generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 64 * bits // 8)
    unpacked = unpack_codes(packed, bits, 64)
    assert unpacked.dtype == torch.int64
    assert torch.equal(unpacked, codes)
    assert torch.equal(_unpack_words(packed, bits, 64), codes)
    assert torch.equal(unpack_codes(packed[1:, 2:4], bits, 64), codes[1:, 2:4])  # a strided view
    with pytest.raises(ValueError, match="bytes do not hold"):
        unpack_codes(packed, bits, 128)
