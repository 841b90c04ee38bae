"""TurboQuant slot codec: vLLM's cache bytes for one token of one kv head, and their reconstruction.

A slot is ``[key part | value part | pad to even]``:

- key, Lloyd-Max presets: b-bit centroid indices of the rotated unit key (code ``i`` at bit ``i * b``,
  little-endian), then ||k|| as fp16. Rotation: ``y = (k / (||k|| + 1e-8)) @ H`` with H the orthonormal
  Hadamard matrix; code = number of midpoints <= y (a tie takes the upper centroid, as vLLM's ``>=``).
  Norm correction ("nc") renormalises the gathered centroid vector to unit length when reading.
- key, fp8 preset: the key cast to fp8 e4m3 (saturating at +-448, like the GPU's ``satfinite`` cast), not rotated.
- value: per-vector asymmetric uniform codes ``q = trunc((v - min) / scale + 0.5)`` with
  ``scale = max((max - min) / (2^b - 1), 1e-8)``, packed like the key codes, then scale and min as fp16.

Presets of our own (``OWN_PRESETS``, names not starting with ``turboquant_``) reuse these pieces with three
options whose defaults are vLLM's behaviour:

- ``value_format="lloyd_max"``: values coded exactly like Lloyd-Max keys (rotated unit vector, centroid codes,
  fp16 norm, norm correction): 2 bytes of metadata instead of 4, and the rotation spreads outlier channels.
- ``key_outliers=n``: the n largest-magnitude channels of each key are stored apart after the norm (n uint8
  channel indices, then n fp8 e4m3 values) and zeroed before the rotation, so the Lloyd-Max codes and the norm
  describe the rest: real keys carry most of their energy in one or two channels (measured: 30-50%).
- ``key_extra_bits`` / ``value_extra_bits``: that many leading rotated coordinates take one more bit (their
  codes packed first, at b+1 bits, then the rest at b bits): fractional widths such as 3.5 bits. After the
  rotation all coordinates have the same distribution, so which ones get the bit does not matter.
- ``norm_at_write``: the norm correction done once, at the write: the stored key norm is ``||k|| / ||c||`` (c the
  gathered centroid vector), so no reader renormalises. The reconstruction is a "nc" preset's; decode skips a
  sum of squares over every key it reads (a faster decode kernel: docs/performance-history.md).

Each own preset names the vLLM preset it rides on (``rides_on``): its slot is no larger than that preset's at
every supported head size, so the cache vLLM allocates for that preset holds it (the slot's unused tail is
never read or written).

``decode`` returns fp32 K/V in the original basis, so ``query @ key_hat.T`` is the logit the kernels compute.
"""

from __future__ import annotations

import functools
import math
import operator
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
    """What a preset stores: key bits (8 = fp8 keys), value bits, and whether keys are norm-corrected.

    The fields after ``vllm_name`` default to vLLM's behaviour; presets of ours set them (module docstring).
    ``*_extra_bits`` is the fraction of a vector's coordinates that take one more bit (a multiple of 1/8).
    """

    key_bits: int
    value_bits: int
    norm_correction: bool
    vllm_name: str | None  # the vLLM cache dtype whose bytes this preset writes; None for presets of ours
    value_format: str = "uniform"  # "uniform" (vLLM's min/scale codes) or "lloyd_max" (coded like the keys)
    key_extra_bits: float = 0.0
    value_extra_bits: float = 0.0
    key_outliers: int = 0  # Lloyd-Max keys: this many largest-magnitude channels stored apart (index + fp8)
    rides_on: str | None = None  # presets of ours: the vLLM preset whose slot (and allocation) holds this one
    norm_at_write: bool = False  # Lloyd-Max keys: the stored norm is ||k|| / ||c|| (readers do not renormalise)

    def __post_init__(self) -> None:
        if self.norm_at_write and (self.norm_correction or self.key_bits == 8 or self.key_extra_bits):
            raise ValueError("norm_at_write: Lloyd-Max keys without wide coordinates, and no norm correction at "
                             "the read (it is done at the write)")


PRESETS: dict[str, PresetSpec] = {
    "turboquant_k8v4": PresetSpec(8, 4, False, "turboquant_k8v4"),
    "turboquant_4bit_nc": PresetSpec(4, 4, True, "turboquant_4bit_nc"),
    "turboquant_k3v4_nc": PresetSpec(3, 4, True, "turboquant_k3v4_nc"),
    "turboquant_3bit_nc": PresetSpec(3, 3, True, "turboquant_3bit_nc"),
}

# Presets of ours: better quality per bit (docs/lab-notes/quality-notes.md); sizes at head 64.
OWN_PRESETS: dict[str, PresetSpec] = {
    # 3.5 bits: keys 4-bit Lloyd-Max plus their largest channel apart, values 2.25-bit Lloyd-Max (rotated);
    # 56 B in k3v4_nc's 62 B (106 / 206 B in 118 / 230 B at head 128 / 256).
    "tqkv_k4o1v225": PresetSpec(4, 2, True, None, value_format="lloyd_max", value_extra_bits=0.25, key_outliers=1,
                                rides_on="turboquant_k3v4_nc"),
    # 4.25 bits: keys 5-bit Lloyd-Max, values 3-bit Lloyd-Max (rotated); 68 B in 4bit_nc's 70 B
    # (132 / 260 B in 134 / 262 B at head 128 / 256).
    "tqkv_k5v3": PresetSpec(5, 3, True, None, value_format="lloyd_max", rides_on="turboquant_4bit_nc"),
    # 4bit_nc's layout, size and reconstruction, its key norms corrected at the write: vLLM's tuned kernels read
    # it without the per-key sum of squares (4.375 bits at head 64, 4.19 at 128).
    "tqkv_4bit_pc": PresetSpec(4, 4, False, None, norm_at_write=True, rides_on="turboquant_4bit_nc"),
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
    """uint8 [..., dim * bits / 8] -> int64 [..., dim]; inverse of :func:`pack_codes`. Byte-aligned widths (4 and
    8 bits: vLLM's 4-bit codes, our 8-bit ones) split the bytes themselves (about 3x faster on the CPU than
    the word path), the others go through
    :func:`_unpack_words`."""
    if packed.shape[-1] * 8 != dim * bits:
        raise ValueError(f"packed: {packed.shape[-1]} bytes do not hold {dim} codes of {bits} bits")
    if bits == 8:
        return packed.to(torch.int64)
    if bits == 4:
        return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).to(torch.int64)
    return _unpack_words(packed, bits, dim)


def _unpack_words(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """:func:`unpack_codes` for any width: groups of ``bits`` bytes as one word of eight codes."""
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
    def norm_at_write(self) -> bool:
        return self.spec.norm_at_write

    @property
    def vllm_layout(self) -> bool:
        """The slot's fields are laid out as one of vLLM's presets' (uniform values, no wide coordinates, no
        outlier channels), so the kernels tuned for vLLM's presets read and write it (``norm_at_write`` only
        changes what the norm field holds)."""
        s = self.spec
        return (s.value_format == "uniform" and not (s.key_extra_bits or s.value_extra_bits or s.key_outliers)
                and (self.key_fp8 or s.key_bits in (3, 4)) and s.value_bits in (3, 4))

    @property
    def value_lloyd_max(self) -> bool:
        return self.spec.value_format == "lloyd_max"

    @functools.cached_property
    def key_wide_coords(self) -> int:
        """Leading rotated key coordinates stored with key_bits + 1 bits."""
        return _wide_coords(self.head_dim, self.spec.key_extra_bits)

    @functools.cached_property
    def value_wide_coords(self) -> int:
        return _wide_coords(self.head_dim, self.spec.value_extra_bits)

    @functools.cached_property
    def key_code_bytes(self) -> int:
        """Bytes of packed key codes (fp8: one byte per coordinate)."""
        if self.key_fp8:
            return self.head_dim
        return math.ceil((self.head_dim * self.key_bits + self.key_wide_coords) / 8)

    @property
    def key_outliers(self) -> int:
        return self.spec.key_outliers

    @functools.cached_property
    def key_bytes(self) -> int:
        return self.key_code_bytes + (0 if self.key_fp8 else 2 + 2 * self.key_outliers)

    @functools.cached_property
    def value_code_bytes(self) -> int:
        return math.ceil((self.head_dim * self.value_bits + self.value_wide_coords) / 8)

    @functools.cached_property
    def value_bytes(self) -> int:
        return self.value_code_bytes + (2 if self.value_lloyd_max else 4)

    @functools.cached_property
    def slot_bytes(self) -> int:
        size = self.key_bytes + self.value_bytes
        return size + size % 2

    @property
    def bits_per_element(self) -> float:
        """Stored bits per K or V coordinate, metadata and padding included."""
        return self.slot_bytes * 8 / (2 * self.head_dim)

    # -- tables --------------------------------------------------------------------------------
    def centroids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """fp32 [2^key_bits] Lloyd-Max centroids (empty for fp8 keys); the wide coordinates use
        ``lloyd_max.centroids(head_dim, key_bits + 1)``."""
        if self.key_fp8:
            return torch.empty(0, dtype=torch.float32, device=device)
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
        if not self.key_outliers:
            return self._encode_lloyd_max(k, self.key_bits, self.key_wide_coords, self.norm_at_write)
        rest, index, outliers = self._split_outliers(k)
        codes = self._encode_lloyd_max(rest, self.key_bits, self.key_wide_coords, self.norm_at_write)
        return torch.cat([codes, index.to(torch.uint8), outliers.view(torch.uint8)], dim=1)

    def _split_outliers(self, k: torch.Tensor):
        """fp32 [N, D] -> (k with its key_outliers largest-magnitude channels zeroed, their int64 indices
        [N, n], their values as fp8 e4m3 [N, n])."""
        index = k.abs().topk(self.key_outliers, dim=1).indices
        outliers = k.gather(1, index).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return k.scatter(1, index, 0.0), index, outliers

    def _encode_lloyd_max(self, x: torch.Tensor, bits: int, wide: int, norm_at_write: bool = False) -> torch.Tensor:
        """fp32 [N, D] -> uint8 [N, codes + 2]: centroid codes of the rotated unit vector, then ||x|| as fp16
        (``norm_at_write``: ||x|| / ||c||, c the gathered centroid vector)."""
        norms = x.norm(dim=1, keepdim=True)
        rotated = (x / (norms + 1e-8)) @ self.rotation(x.device)
        narrow = torch.bucketize(rotated[:, wide:].contiguous(), lloyd_max.midpoints(self.head_dim, bits).to(x.device), right=True)
        if norm_at_write:  # (no wide coordinates: PresetSpec refuses them)
            norms = _corrected_norms(norms, lloyd_max.centroids(self.head_dim, bits).to(x.device)[narrow])
        parts = [pack_codes(narrow, bits), _fp16_bytes(norms)]
        if wide:
            midpoints = lloyd_max.midpoints(self.head_dim, bits + 1).to(x.device)
            parts.insert(0, pack_codes(torch.bucketize(rotated[:, :wide].contiguous(), midpoints, right=True), bits + 1))
        return torch.cat(parts, dim=1)

    def _encode_values(self, v: torch.Tensor) -> torch.Tensor:
        if self.value_lloyd_max:
            return self._encode_lloyd_max(v, self.value_bits, self.value_wide_coords)
        top = (1 << self.value_bits) - 1
        low = v.amin(dim=1, keepdim=True)
        scale = (v.amax(dim=1, keepdim=True) - low) / float(top)
        scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
        codes = ((v - low) / scale + 0.5).to(torch.int32).clamp(0, top)
        return torch.cat([pack_codes(codes, self.value_bits), _fp16_bytes(scale), _fp16_bytes(low)], dim=1)

    # -- both at once ---------------------------------------------------------------------------
    def round_trip(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode(encode(key, value))`` without packing the codes: the same fp32 [T, Hk, D] K/V (up to
        float rounding of the matmuls), several times faster; for quality runs over many tokens."""
        self.check_key_value(key, value)
        tokens, heads, dim = key.shape
        k = key.float().reshape(-1, dim)
        v = value.float().reshape(-1, dim)
        if self.key_fp8:
            key_hat = k.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        else:
            rest, index, outliers = self._split_outliers(k) if self.key_outliers else (k, None, None)
            key_hat = self._lloyd_max_round_trip(rest, self.key_bits, self.key_wide_coords, self.norm_correction,
                                                 self.norm_at_write)
            if self.key_outliers:
                key_hat = key_hat.scatter(1, index, outliers.float())
        if self.value_lloyd_max:
            value_hat = self._lloyd_max_round_trip(v, self.value_bits, self.value_wide_coords, True)
        else:
            top = (1 << self.value_bits) - 1
            low = v.amin(dim=1, keepdim=True)
            scale = (v.amax(dim=1, keepdim=True) - low) / float(top)
            scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
            codes = ((v - low) / scale + 0.5).to(torch.int32).clamp(0, top)
            value_hat = codes.float() * scale.half().float() + low.half().float()
        return key_hat.reshape(tokens, heads, dim), value_hat.reshape(tokens, heads, dim)

    def _lloyd_max_round_trip(self, x: torch.Tensor, bits: int, wide: int, norm_correction: bool,
                              norm_at_write: bool = False) -> torch.Tensor:
        dim = self.head_dim
        norms = x.norm(dim=1, keepdim=True)
        rotated = (x / (norms + 1e-8)) @ self.rotation(x.device)
        table = lloyd_max.centroids(dim, bits).to(x.device)
        unit = table[torch.bucketize(rotated[:, wide:].contiguous(), lloyd_max.midpoints(dim, bits).to(x.device), right=True)]
        if wide:
            wide_table = lloyd_max.centroids(dim, bits + 1).to(x.device)
            wide_mid = lloyd_max.midpoints(dim, bits + 1).to(x.device)
            unit = torch.cat([wide_table[torch.bucketize(rotated[:, :wide].contiguous(), wide_mid, right=True)], unit], 1)
        if norm_correction:
            unit = unit / torch.sqrt((unit * unit).sum(-1, keepdim=True) + 1e-16)
        elif norm_at_write:
            norms = _corrected_norms(norms, unit)
        return (unit @ self.rotation(x.device)) * norms.half().float()

    # -- decode --------------------------------------------------------------------------------
    def decode(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [..., slot_bytes] -> (key_hat, value_hat), fp32 [..., D] in the original basis."""
        if slots.dtype != torch.uint8 or slots.shape[-1] != self.slot_bytes:
            raise ValueError(
                f"slots: expected uint8 [..., {self.slot_bytes}] for {self.name} at head_dim {self.head_dim}, "
                f"got {slots.dtype} {tuple(slots.shape)}"
            )
        return self.decode_keys(slots), self.decode_values(slots)

    def decode_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """uint8 [..., slot_bytes] -> fp32 [..., D] keys in the original basis."""
        if self.key_fp8 or not self.key_outliers:
            key_rot, key_norm = self.decode_keys_rotated(slots)
            return key_rot if self.key_fp8 else (key_rot @ self.rotation(slots.device)) * key_norm[..., None]
        unit, norm = self._decode_lloyd_max(slots, 0, self.key_bits, self.key_wide_coords, self.norm_correction)
        index, outliers = self.decode_key_outliers(slots)
        return ((unit @ self.rotation(slots.device)) * norm[..., None]).scatter(-1, index, outliers)

    def decode_key_outliers(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 channel indices, fp32 values), both [..., key_outliers]: they replace those channels of
        the rest's reconstruction ``norm * (unit @ H)``."""
        at = self.key_code_bytes + 2
        n = self.key_outliers
        index = slots[..., at : at + n].to(torch.int64)
        outliers = slots[..., at + n : at + 2 * n].contiguous().view(torch.float8_e4m3fn).float()
        return index, outliers

    def decode_keys_rotated(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys as the kernels see them: (unit vectors in the rotated basis, norms) for Lloyd-Max presets;
        (fp32 keys, ones) for fp8 keys. A logit is ``norm * <q @ H, unit>`` (fp8: ``<q, key>``). Presets with
        key outliers: (whole key @ H, ones), the outliers put back in the original basis first."""
        dim = self.head_dim
        if self.key_fp8:
            keys = slots[..., :dim].contiguous().view(torch.float8_e4m3fn).float()
            return keys, torch.ones(keys.shape[:-1], dtype=torch.float32, device=slots.device)
        if self.key_outliers:
            keys = self.decode_keys(slots) @ self.rotation(slots.device)
            return keys, torch.ones(keys.shape[:-1], dtype=torch.float32, device=slots.device)
        return self._decode_lloyd_max(slots, 0, self.key_bits, self.key_wide_coords, self.norm_correction)

    def _decode_lloyd_max(self, slots: torch.Tensor, start: int, bits: int, wide: int, norm_correction: bool):
        """The part at byte ``start``: (unit vector in the rotated basis, fp32 [...]), see _encode_lloyd_max."""
        dim = self.head_dim
        wide_bytes = wide * (bits + 1) // 8
        narrow_bytes = (dim - wide) * bits // 8
        at = start + wide_bytes
        unit = lloyd_max.centroids(dim, bits).to(slots.device)[unpack_codes(slots[..., at : at + narrow_bytes], bits, dim - wide)]
        if wide:
            table = lloyd_max.centroids(dim, bits + 1).to(slots.device)
            unit = torch.cat([table[unpack_codes(slots[..., start:at], bits + 1, wide)], unit], dim=-1)
        if norm_correction:
            unit = unit / torch.sqrt((unit * unit).sum(-1, keepdim=True) + 1e-16)
        return unit, _read_fp16(slots, at + narrow_bytes)

    def decode_values(self, slots: torch.Tensor) -> torch.Tensor:
        """uint8 [..., slot_bytes] -> fp32 [..., D] values in the original basis."""
        start = self.key_bytes
        if self.value_lloyd_max:
            unit, norm = self._decode_lloyd_max(slots, start, self.value_bits, self.value_wide_coords, True)
            return (unit @ self.rotation(slots.device)) * norm[..., None]
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


def _corrected_norms(norms: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """fp32 [N, 1] norms over ||c||, c [N, D] the gathered centroid vectors (``norm_at_write``); as the Triton
    write computes it (fp32 sum of squares, square root and division)."""
    return norms / torch.sqrt((unit * unit).sum(-1, keepdim=True) + 1e-16)


def _wide_coords(head_dim: int, fraction: float) -> int:
    wide = round(head_dim * fraction)
    if wide % 8 or not 0 <= wide <= head_dim:
        raise ValueError(f"extra bits: {fraction} of {head_dim} coordinates is not a multiple of 8 coordinates")
    return wide


def preset_names() -> list[str]:
    """vLLM's presets (the cache dtypes vLLM knows); presets of ours: :func:`own_preset_names`."""
    return list(PRESETS)


def own_preset_names() -> list[str]:
    return list(OWN_PRESETS)


def get_preset(name: str, head_dim: int) -> Preset:
    """The preset ``name`` (vLLM's or ours) at ``head_dim``; ValueError names the valid choices, TypeError a
    head size that is not an integer (``hidden_size / num_heads`` is a float: 128.0 would be cached as 128's
    preset with a float head size, and every later op on head 128 would fail)."""
    if isinstance(head_dim, bool) or not hasattr(head_dim, "__index__"):
        raise TypeError(f"head_dim: expected an int, got {head_dim!r} ({type(head_dim).__name__})")
    return _get_preset(name, operator.index(head_dim))


@lru_cache(maxsize=None)
def _get_preset(name: str, head_dim: int) -> Preset:
    spec = PRESETS.get(name) or OWN_PRESETS.get(name)
    if spec is None:
        valid = ", ".join([*PRESETS, *OWN_PRESETS])
        raise ValueError(f"preset: unknown TurboQuant preset {name!r}; valid presets: {valid}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim: {head_dim} is not supported; supported head sizes: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )
    return Preset(name, head_dim, spec)
