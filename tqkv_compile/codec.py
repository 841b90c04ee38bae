"""TurboQuant slot codec: vLLM's cache bytes for one token of one kv head, and their reconstruction.

A slot is ``[key part | value part | pad to even]``:

- key, Lloyd-Max presets: b-bit centroid indices of the rotated unit key (code ``i`` at bit ``i * b``,
  little-endian), then ||k|| as fp16. Rotation: ``y = (k / (||k|| + 1e-8)) @ H`` with H the orthonormal
  Hadamard matrix; code = number of midpoints <= y (a tie takes the upper centroid, as vLLM's ``>=``).
  Norm correction ("nc") renormalises the gathered centroid vector to unit length when reading.
- key, fp8 preset: the key cast to fp8 e4m3 (saturating at +-448, like the GPU's ``satfinite`` cast), not rotated.
- value: per-vector asymmetric uniform codes ``q = trunc((v - min) / scale + 0.5)`` with
  ``scale = max((max - min) / (2^b - 1), 1e-8)``, packed like the key codes, then scale and min as fp16.

``decode`` returns fp32 K/V in the original basis, so ``query @ key_hat.T`` is the logit the kernels compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from tqkv_compile import lloyd_max
from tqkv_compile.rotation import hadamard

FP8_MAX = 448.0
SUPPORTED_HEAD_DIMS = (64, 128, 256)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PresetSpec:
    """What a preset stores: key bits (8 = fp8 keys), value bits, and whether keys are norm-corrected."""

    key_bits: int
    value_bits: int
    norm_correction: bool
    vllm_name: str | None  # the vLLM cache dtype whose bytes this preset writes; None for presets of ours


PRESETS: dict[str, PresetSpec] = {
    "turboquant_k8v4": PresetSpec(8, 4, False, "turboquant_k8v4"),
    "turboquant_4bit_nc": PresetSpec(4, 4, True, "turboquant_4bit_nc"),
    "turboquant_k3v4_nc": PresetSpec(3, 4, True, "turboquant_k3v4_nc"),
    "turboquant_3bit_nc": PresetSpec(3, 3, True, "turboquant_3bit_nc"),
}


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int [..., D] codes in [0, 2^bits) -> uint8 [..., D * bits / 8]; code i at bit i * bits (little-endian)."""
    *lead, dim = codes.shape
    groups = codes.to(torch.int64).reshape(*lead, dim // 8, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (groups << shifts).sum(-1, keepdim=True)  # 8 codes -> `bits` bytes
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8).reshape(*lead, dim * bits // 8)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint8 [..., dim * bits / 8] -> int64 [..., dim]; inverse of :func:`pack_codes`."""
    *lead, _ = packed.shape
    groups = packed.to(torch.int64).reshape(*lead, dim // 8, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (groups << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((word >> shifts) & ((1 << bits) - 1)).reshape(*lead, dim)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., 1] -> uint8 [..., 2], fp16 little-endian."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _read_fp16(slots: torch.Tensor, offset: int) -> torch.Tensor:
    """uint8 [..., S] -> fp32 [...] from the fp16 at byte ``offset``."""
    return slots[..., offset : offset + 2].contiguous().view(torch.float16)[..., 0].float()


@dataclass(frozen=True)
class Preset:
    """A TurboQuant preset at one head size: slot layout, encode and decode."""

    name: str
    head_dim: int
    spec: PresetSpec

    # -- layout --------------------------------------------------------------------------------
    @property
    def key_fp8(self) -> bool:
        return self.spec.key_bits == 8

    @property
    def key_bits(self) -> int:
        return self.spec.key_bits

    @property
    def value_bits(self) -> int:
        return self.spec.value_bits

    @property
    def norm_correction(self) -> bool:
        return self.spec.norm_correction

    @property
    def key_code_bytes(self) -> int:
        """Bytes of packed key codes (fp8: one byte per coordinate)."""
        return self.head_dim if self.key_fp8 else math.ceil(self.head_dim * self.key_bits / 8)

    @property
    def key_bytes(self) -> int:
        return self.key_code_bytes + (0 if self.key_fp8 else 2)

    @property
    def value_code_bytes(self) -> int:
        return math.ceil(self.head_dim * self.value_bits / 8)

    @property
    def value_bytes(self) -> int:
        return self.value_code_bytes + 4

    @property
    def slot_bytes(self) -> int:
        size = self.key_bytes + self.value_bytes
        return size + size % 2

    @property
    def bits_per_element(self) -> float:
        """Stored bits per K or V coordinate, metadata and padding included."""
        return self.slot_bytes * 8 / (2 * self.head_dim)

    # -- tables --------------------------------------------------------------------------------
    def centroids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """fp32 [2^key_bits] Lloyd-Max centroids (empty for fp8 keys)."""
        if self.key_fp8:
            return torch.empty(0, device=device)
        return lloyd_max.centroids(self.head_dim, self.key_bits).to(device)

    def midpoints(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return lloyd_max.midpoints(self.head_dim, self.key_bits).to(device)

    def rotation(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return hadamard(self.head_dim, device)

    # -- encode --------------------------------------------------------------------------------
    def encode(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """key, value [T, Hk, D] (fp16 / bf16 / fp32) -> uint8 [T, Hk, slot_bytes], vLLM's bytes."""
        self.check_key_value(key, value)
        tokens, heads, dim = key.shape
        k = key.float().reshape(-1, dim)
        v = value.float().reshape(-1, dim)
        parts = [self._encode_keys(k), self._encode_values(v)]
        pad = self.slot_bytes - self.key_bytes - self.value_bytes
        if pad:
            parts.append(torch.zeros(k.shape[0], pad, dtype=torch.uint8, device=k.device))
        return torch.cat(parts, dim=1).reshape(tokens, heads, self.slot_bytes)

    def _encode_keys(self, k: torch.Tensor) -> torch.Tensor:
        if self.key_fp8:
            return k.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        norms = k.norm(dim=1, keepdim=True)
        rotated = (k / (norms + 1e-8)) @ self.rotation(k.device)
        codes = torch.bucketize(rotated, self.midpoints(k.device), right=True)
        return torch.cat([pack_codes(codes, self.key_bits), _fp16_bytes(norms)], dim=1)

    def _encode_values(self, v: torch.Tensor) -> torch.Tensor:
        top = (1 << self.value_bits) - 1
        low = v.amin(dim=1, keepdim=True)
        scale = (v.amax(dim=1, keepdim=True) - low) / float(top)
        scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
        codes = ((v - low) / scale + 0.5).to(torch.int32).clamp(0, top)
        return torch.cat([pack_codes(codes, self.value_bits), _fp16_bytes(scale), _fp16_bytes(low)], dim=1)

    # -- decode --------------------------------------------------------------------------------
    def decode(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [..., slot_bytes] -> (key_hat, value_hat), fp32 [..., D] in the original basis."""
        if slots.dtype != torch.uint8 or slots.shape[-1] != self.slot_bytes:
            raise ValueError(
                f"slots: expected uint8 [..., {self.slot_bytes}] for {self.name} at head_dim {self.head_dim}, "
                f"got {slots.dtype} {tuple(slots.shape)}"
            )
        key_rot, key_norm = self.decode_keys_rotated(slots)
        key_hat = key_rot if self.key_fp8 else (key_rot @ self.rotation(slots.device)) * key_norm[..., None]
        return key_hat, self.decode_values(slots)

    def decode_keys_rotated(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys as the kernels see them: (unit vectors in the rotated basis, norms) for Lloyd-Max presets;
        (fp32 keys, ones) for fp8 keys. A logit is ``norm * <q @ H, unit>`` (fp8: ``<q, key>``)."""
        dim = self.head_dim
        if self.key_fp8:
            keys = slots[..., :dim].contiguous().view(torch.float8_e4m3fn).float()
            return keys, torch.ones(keys.shape[:-1], device=slots.device)
        codes = unpack_codes(slots[..., : self.key_code_bytes], self.key_bits, dim)
        unit = self.centroids(slots.device)[codes]
        if self.norm_correction:
            unit = unit / torch.sqrt((unit * unit).sum(-1, keepdim=True) + 1e-16)
        return unit, _read_fp16(slots, self.key_code_bytes)

    def decode_values(self, slots: torch.Tensor) -> torch.Tensor:
        start = self.key_bytes
        codes = unpack_codes(slots[..., start : start + self.value_code_bytes], self.value_bits, self.head_dim)
        scale = _read_fp16(slots, start + self.value_code_bytes)
        low = _read_fp16(slots, start + self.value_code_bytes + 2)
        return codes.float() * scale[..., None] + low[..., None]

    # -- checks --------------------------------------------------------------------------------
    def check_key_value(self, key: torch.Tensor, value: torch.Tensor) -> None:
        for arg, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in INPUT_DTYPES:
                raise TypeError(f"{arg}: expected float16, bfloat16 or float32, got {t.dtype}")
            if t.dim() != 3 or t.shape[-1] != self.head_dim:
                raise ValueError(
                    f"{arg}: expected shape [T, Hk, {self.head_dim}] for {self.name}, got {tuple(t.shape)}"
                )
        if key.shape != value.shape:
            raise ValueError(f"key and value: shapes differ, {tuple(key.shape)} vs {tuple(value.shape)}")


def preset_names() -> list[str]:
    return list(PRESETS)


@lru_cache(maxsize=None)
def get_preset(name: str, head_dim: int) -> Preset:
    """The preset ``name`` at ``head_dim``; ValueError names the valid choices."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown TurboQuant preset {name!r}; valid presets: {', '.join(PRESETS)}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim: {head_dim} is not supported; supported head sizes: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )
    return Preset(name, head_dim, PRESETS[name])
