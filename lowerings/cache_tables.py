"""Host-side facts and tables the decode kernels share (the stream kernel in :mod:`decode_stream`, the fragment
kernel in :mod:`gluon_decode`): which slot layouts they read, how far a cache view reaches, and the key centroids
as byte-permute lookup words."""

from __future__ import annotations

import torch

from tqkv_compile.codec import Preset


def require_vllm_layout(preset: Preset) -> None:
    """The decode kernels (and triton_kv_write's, triton_kv_dot's, triton_dequant's) read vLLM's four slot layouts
    only: a preset of ours given to them would be read as garbage (or past the cache's end), so it is refused;
    the general kernels (``lowerings/general_*.py``) serve those."""
    if not preset.vllm_layout:
        raise ValueError(f"{preset.name}: not one of vLLM's slot layouts; presets of ours run on the general "
                         "kernels (lowerings/general_*.py; the triton backend picks them)")


def halves_span(kv_cache: torch.Tensor) -> int:
    """How many 2-byte units the kernel can address from the view's start: the last byte any index reaches."""
    return (sum((size - 1) * stride for size, stride in zip(kv_cache.shape, kv_cache.stride())) + 2) // 2


_LUTS: dict[tuple[str, int, str], torch.Tensor] = {}


def _lut_words(table: torch.Tensor) -> torch.Tensor:
    """16 fp16 entries -> int32 [8]: low bytes of entries 0-3, 4-7, 8-11, 12-15, then high bytes (see
    :func:`device_helpers.lut4_fp16`)."""
    b = table.to(torch.float16).view(torch.uint8).view(16, 2).to(torch.int64)
    words = [sum(int(b[4 * w + i, half]) << (8 * i) for i in range(4)) for half in (0, 1) for w in range(4)]
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def key_lut(preset: Preset, device: torch.device) -> torch.Tensor:
    """The stream kernel's key table for ``device_helpers.lut4_fp16`` / ``lut3_fp16`` on ``device``, built once (from
    the CPU tables, so no device-to-host copy): the key centroids in fp16, 3-bit tables padded to 16 entries
    with zeros (a placeholder for fp8 keys). Built before CUDA-graph capture by ``TritonBackend.warm``.
    (Uniform value codes need no table: ``device_helpers.codes4_fp16_odd16``, ``values3_f16``.)"""
    key = (preset.name, preset.head_dim, str(device))
    if key not in _LUTS:
        cents = torch.zeros(16, dtype=torch.float32)
        if not preset.key_fp8 and preset.key_bits in (3, 4):  # (other widths: no stream kernel, a placeholder)
            table = preset.centroids("cpu").float()
            cents[:table.numel()] = table
        _LUTS[key] = _lut_words(cents).to(device)
    return _LUTS[key]
