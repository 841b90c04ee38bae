"""Experiment for issue 6 (not a product feature): 68-byte (4.25-bit) KV codings on `tqkv quality`'s model
and corpus, built on bench/quality_offsets.py's harness (same 4096-token windows, same calibration window a
third into the corpus, same bf16 row as the baseline).

A configuration is ``MIX[+FLAG...]``. MIX is ``k<bits>[o<n>]v<bits>`` (fractional widths through
``key_extra_bits`` / ``value_extra_bits``, ``o<n>``: n key outlier channels stored apart), coded with Lloyd-Max
keys and Lloyd-Max rotated values. FLAGS (all but ``mkN``/``sinkN`` need only per-layer, per-kv-head constants
measured on the calibration window; none adds bytes to a slot):

- ``mk``: subtract the calibrated mean key before coding (never added back: q.mu is constant per query row).
- ``mk<N>`` / ``mk<N>s``: the mean key of the sequence's own first N tokens (``s``: tokens 1..N, skipping
  token 0), i.e. an offset stored once per sequence, layer and kv head.
- ``ks``: per-channel key scale s_c = (E[q_c^2] / E[k_c^2])^(1/4) (centered k, q over the kv head's query
  heads), applied before coding and undone at the read (foldable into the query). It minimises the expected
  logit error q.(k - k_hat) of a norm-scaled isotropic coder: min (sum Q_c / a_c)(sum a_c K_c) -> a_c = sqrt(Q_c/K_c).
- ``kS``: the same with full 64x64 matrices: k' = k M, M = A^(1/2), A = Sk^-1/2 (Sk^1/2 Sq Sk^1/2)^1/2 Sk^-1/2.
- ``vs`` / ``vS``: the same for values, with the output projection's weight W = sum_h Wo_h^T Wo_h in place of
  the query covariance (M^-1 folds into o_proj: free at the read).
- ``mv``: subtract the calibrated mean value (added back at the read).
- ``sink<N>``: the sequence's first N tokens kept in bf16 (per-sequence storage, not slot-local).
- ``kt`` / ``vt``: transform coding instead of the Hadamard's equal bits. Keys are mapped to the query metric
  (k A, A = E[q q^T]^(1/2): there the squared error is the expected squared logit error), then to that
  space's principal axes (the KLT: eigenvectors U of A S_k A, variances l_i); the mix's code bits (k5: 320)
  go to the axes by greedy reverse water-filling on the Gaussian Lloyd-Max distortion (0 to 8 bits each);
  each axis is coded with a Gaussian Lloyd-Max codebook scaled by sqrt(l_i) times a per-token fp16 scale
  (the slot's norm field). The read multiplies by (A U)^-1 (foldable into the query, as the rotation is).
  ``vt`` does the same for values in the output projection's metric (W = sum_h Wo_h^T Wo_h; the inverse folds
  into o_proj). Same slot bytes as the mix. ``kt<N>`` / ``vt<N>``: at least N bits on every axis; ``tn``: the coded
  vector rescaled to the original's norm in the transformed space (TurboQuant's norm correction).

    python bench/quality_explore.py --configs k5v3,k5v3+mk,k5v3+mk+ks [--tokens 4096]
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tqkv_compile import quality as Q  # noqa: E402
from tqkv_compile import lloyd_max  # noqa: E402
from tqkv_compile.codec import Preset, PresetSpec  # noqa: E402
from tqkv_compile.rotation import hadamard  # noqa: E402
from quality_offsets import calibrate  # noqa: E402

HEAD_DIM = 64


def parse_mix(mix: str) -> PresetSpec:
    m = re.fullmatch(r"k([\d.]+)(?:o(\d+))?v([\d.]+)", mix)
    if not m:
        raise ValueError(f"bad mix {mix!r}")
    kb, vb = float(m.group(1)), float(m.group(3))
    return PresetSpec(int(kb), int(vb), True, None, value_format="lloyd_max", key_extra_bits=kb - int(kb),
                      value_extra_bits=vb - int(vb), key_outliers=int(m.group(2) or 0))


@dataclass
class Config:
    label: str
    preset: Preset | None
    flags: set[str]
    seq_mean: int = 0
    seq_skip0: bool = False
    sink: int = 0
    transform_floor: dict = None  # kt<N> / vt<N>: at least N bits on every axis
    key_power: float = 0.25  # ks<p>: s_c = (E[q_c^2] / E[k_c^2])^p
    value_power: float = 0.25


def parse_config(text: str) -> Config:
    parts = text.split("+")
    preset = None if parts[0] == "bf16" else Preset("experiment", HEAD_DIM, parse_mix(parts[0]))
    cfg = Config(text, preset, set())
    for flag in parts[1:]:
        if m := re.fullmatch(r"mk(\d+)(s?)", flag):
            cfg.seq_mean, cfg.seq_skip0 = int(m.group(1)), bool(m.group(2))
        elif m := re.fullmatch(r"sink(\d+)", flag):
            cfg.sink = int(m.group(1))
        elif m := re.fullmatch(r"([kv]t)(\d)", flag):
            cfg.flags.add(m.group(1))
            cfg.transform_floor = {**(cfg.transform_floor or {}), m.group(1)[0]: int(m.group(2))}
        elif m := re.fullmatch(r"([kv]s)([\d.]+)", flag):
            cfg.flags.add(m.group(1))
            if m.group(1) == "ks":
                cfg.key_power = float(m.group(2))
            else:
                cfg.value_power = float(m.group(2))
        elif flag in ("mk", "ks", "kS", "vs", "vS", "mv", "vraw", "vproj", "kraw", "kproj", "vub", "kub", "konly", "vonly",
                      "kt", "vt", "tn"):
            cfg.flags.add(flag)
        else:
            raise ValueError(f"bad flag {flag!r} in {text!r}")
    return cfg


def sqrtm(a: torch.Tensor) -> torch.Tensor:
    w, u = torch.linalg.eigh(a.double())
    return (u * w.clamp_min(0).sqrt()) @ u.T


def invsqrtm(a: torch.Tensor, eps: float) -> torch.Tensor:
    w, u = torch.linalg.eigh(a.double())
    return (u * (w.clamp_min(0) + eps * w.max()).rsqrt()) @ u.T


def geo_transform(sx: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """M (float64 [D, D], symmetric) with M^2 = A = Sx^-1/2 (Sx^1/2 Sw Sx^1/2)^1/2 Sx^-1/2, the minimiser of
    tr(A^-1 Sw) tr(A Sx); normalised to det 1 (the scale does not matter to a norm-scaled coder)."""
    sx, sw = sx.double(), sw.double()
    h = sqrtm(sx)
    hi = invsqrtm(sx, 1e-6)
    a = hi @ sqrtm(h @ sw @ h) @ hi
    a = (a + a.T) / 2
    m = sqrtm(a)
    return m / torch.linalg.det(m).abs() ** (1 / m.shape[0])


@functools.lru_cache(maxsize=None)
def gaussian_codebook(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids, midpoints) of the 2^bits-level Lloyd-Max quantizer of N(0, 1), by Lloyd's iteration on a
    fine grid (the codec's table is built for 1-4 bits; this one is good to 8)."""
    x = torch.linspace(-9, 9, 400_001, dtype=torch.float64)
    pdf = torch.exp(-x * x / 2)
    levels = 2 ** bits
    c = torch.linspace(-3.5, 3.5, levels, dtype=torch.float64) * (1 - 1 / levels)
    for _ in range(2000):
        mid = (c[:-1] + c[1:]) / 2
        cell = torch.bucketize(x, mid)
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, pdf)
        moment = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, pdf * x)
        new = moment / mass.clamp_min(1e-300)
        if float((new - c).abs().max()) < 1e-9:
            c = new
            break
        c = new
    return c.float(), ((c[:-1] + c[1:]) / 2).float()


@functools.lru_cache(maxsize=None)
def gaussian_distortion(bits: int) -> float:
    """E[(x - Q(x))^2] of :func:`gaussian_codebook` for x ~ N(0, 1) (1 at 0 bits)."""
    if bits == 0:
        return 1.0
    c, mid = gaussian_codebook(bits)
    x = torch.linspace(-9, 9, 400_001, dtype=torch.float64)
    pdf = torch.exp(-x * x / 2)
    err = (x - c.double()[torch.bucketize(x.float(), mid)]) ** 2
    return float((err * pdf).sum() / pdf.sum())


def allocate_bits(variances: torch.Tensor, budget: int, cap: int = 8, floor: int = 0) -> torch.Tensor:
    """Integer bits per axis (sum = budget, each floor..cap) minimising sum l_i d(b_i) by greedy reverse
    water-filling (optimal: d is convex and decreasing)."""
    d = torch.tensor([gaussian_distortion(b) for b in range(cap + 2)], dtype=torch.float64)
    lam = variances.double().clamp_min(0)
    bits = torch.full((lam.numel(),), floor, dtype=torch.long)
    for _ in range(budget - floor * lam.numel()):
        gain = lam * (d[bits] - d[(bits + 1).clamp_max(cap + 1)])
        gain[bits >= cap] = -1
        bits[int(gain.argmax())] += 1
    return bits


def transform_round_trip(y: torch.Tensor, scales: torch.Tensor, bits: torch.Tensor,
                         norm_correction: bool = False) -> torch.Tensor:
    """Codes y (fp32 [N, D], in principal axes with standard deviations ``scales``) at ``bits`` per axis with
    Gaussian Lloyd-Max codebooks, after a per-token fp16 scale that makes y's total energy the calibrated one;
    with ``norm_correction`` the answer is rescaled to y's norm (as TurboQuant's nc presets do: the fp16
    field then holds the norm)."""
    total = float((scales ** 2).sum())
    token = (y.norm(dim=1, keepdim=True) / math.sqrt(total)).half().float().clamp_min(1e-8)
    z = y / (token * scales)
    out = torch.zeros_like(y)
    for b in bits.unique().tolist():
        if b == 0:
            continue
        cols = (bits == b).nonzero().flatten()
        c, mid = gaussian_codebook(b)
        out[:, cols] = c[torch.bucketize(z[:, cols].contiguous(), mid)]
    out = out * token * scales
    if norm_correction:
        out = out * (y.norm(dim=1, keepdim=True).half().float() / out.norm(dim=1, keepdim=True).clamp_min(1e-12))
    return out


def lloyd_max_round_trip(x: torch.Tensor, bits: int, wide: int, mode: str) -> torch.Tensor:
    """The codec's Lloyd-Max round trip (fp32 [N, D]) with a choice of what the fp16 norm field holds:
    ``nc`` ||x|| with the centroid vector renormalised at the read (the codec: it inflates the vector by
    ~1 + MSE/2 on average), ``raw`` ||x|| times the centroid vector as is (the conditional mean given the
    codes, shrinks x by ~1 - MSE along itself), ``proj`` the least-squares scale <x, c> / ||c||^2 (least error
    per vector), ``ub`` the scale ||x||^2 / <x, c>: the error is orthogonal to x, so <x_hat, x> = ||x||^2 and an
    attention-weighted sum of values is not shrunk (its errors average out instead)."""
    dim = x.shape[1]
    h = hadamard(dim)
    norms = x.norm(dim=1, keepdim=True)
    rotated = (x / (norms + 1e-8)) @ h
    unit = lloyd_max.centroids(dim, bits)[torch.bucketize(rotated[:, wide:].contiguous(),
                                                          lloyd_max.midpoints(dim, bits), right=True)]
    if wide:
        unit = torch.cat([lloyd_max.centroids(dim, bits + 1)[torch.bucketize(
            rotated[:, :wide].contiguous(), lloyd_max.midpoints(dim, bits + 1), right=True)], unit], 1)
    if mode == "nc":
        unit = unit / torch.sqrt((unit * unit).sum(-1, keepdim=True) + 1e-16)
    elif mode == "ub":
        norms = norms / ((rotated * unit).sum(-1, keepdim=True) + 1e-16)
    elif mode == "proj":
        norms = norms * (rotated * unit).sum(-1, keepdim=True) / ((unit * unit).sum(-1, keepdim=True) + 1e-16)
    return (unit @ h) * norms.half().float()


class Explore(Q.KVRoundTrip):
    def __init__(self, model):
        super().__init__(model.config.num_hidden_layers)
        self.model = model
        self.rep = model.config.num_attention_heads // model.config.num_key_value_heads
        self.cfg: Config | None = None
        self.calibrate = False
        self.stats: dict[int, dict[str, torch.Tensor]] = {}
        self.const: dict[int, dict[str, torch.Tensor]] = {}

    # -- calibration -------------------------------------------------------------------------
    def collect(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        b, hk, t, d = key.shape
        k = key.float()[0]  # [Hk, T, D]
        v = value.float()[0]
        q = query.float()[0].reshape(hk, self.rep, t, d).reshape(hk, self.rep * t, d)
        s = self.stats.setdefault(layer, {})
        for name, x in (("k", k), ("v", v), ("q", q)):
            s[name + "_sum"] = s.get(name + "_sum", 0) + x.sum(1).double()
            s[name + "_outer"] = s.get(name + "_outer", 0) + torch.einsum("htd,hte->hde", x, x).double()
            s[name + "_n"] = s.get(name + "_n", 0) + x.shape[1]

    def finish_calibration(self) -> None:
        self.calibrate = False
        for layer, s in self.stats.items():
            c = {}
            for name in ("k", "v", "q"):
                n = s[name + "_n"]
                mean = s[name + "_sum"] / n
                second = s[name + "_outer"] / n
                c[name + "_mean"] = mean.float()
                c[name + "_second"] = second  # uncentered
                c[name + "_cov"] = second - torch.einsum("hd,he->hde", mean, mean)
            attn = self.model.model.layers[layer].self_attn
            wo = attn.o_proj.weight.detach().double()  # [hidden, Hq * D]
            hk = c["k_mean"].shape[0]
            wo = wo.reshape(wo.shape[0], hk, self.rep, HEAD_DIM).permute(1, 2, 0, 3)  # [Hk, rep, hidden, D]
            c["w"] = torch.einsum("hrjd,hrje->hde", wo, wo)
            self.const[layer] = c

    def transforms(self, layer: int, cfg: Config):
        """(key M, key M^-1, value M, value M^-1) float32 [Hk, D, D] or None, cached per flag set."""
        c = self.const[layer]
        flags = cfg.flags
        key = ("tf", layer, cfg.key_power, cfg.value_power, "mk" in flags, "ks" in flags, "kS" in flags, "vs" in flags, "vS" in flags, "mv" in flags)
        if key in c:
            return c[key]
        hk = c["k_mean"].shape[0]
        out = [None, None, None, None]
        sk = c["k_cov"] if "mk" in flags else c["k_second"]
        sv = c["v_cov"] if "mv" in flags else c["v_second"]
        for i, (diag, full, sx, sw, power) in enumerate((("ks", "kS", sk, c["q_second"], cfg.key_power),
                                                         ("vs", "vS", sv, c["w"], cfg.value_power))):
            if diag in flags:
                dx = torch.diagonal(sx, dim1=-2, dim2=-1)
                dw = torch.diagonal(sw, dim1=-2, dim2=-1)
                s = (dw / dx.clamp_min(1e-12 * dx.max())) ** power
                s = s / s.log().mean(-1, keepdim=True).exp()
                m = torch.diag_embed(s)
            elif full in flags:
                m = torch.stack([geo_transform(sx[h], sw[h]) for h in range(hk)])
            else:
                continue
            out[2 * i], out[2 * i + 1] = m.float(), torch.linalg.inv(m).float()
        c[key] = out
        return out

    def transform_coder(self, layer: int, side: str, cfg: Config):
        """(forward [Hk, D, D], inverse [Hk, D, D], axis scales [Hk, D], bits [Hk, D]) of ``kt`` (side "k") or
        ``vt`` ("v"), cached: the metric's square root times the KLT of the side's calibrated second moment
        in it (centred where the mean is taken out), and the bit allocation over its axes."""
        c = self.const[layer]
        spec = cfg.preset.spec
        floor = (cfg.transform_floor or {}).get(side, 0)
        key = ("kt" if side == "k" else "vt", layer, "mk" in cfg.flags, "mv" in cfg.flags, spec, floor)
        if key in c:
            return c[key]
        if side == "k":
            second = c["k_cov"] if "mk" in cfg.flags else c["k_second"]
            metric = c["q_second"]
            budget = round((spec.key_bits + spec.key_extra_bits) * HEAD_DIM)
        else:
            second = c["v_cov"] if "mv" in cfg.flags else c["v_second"]
            metric = c["w"]
            budget = round((spec.value_bits + spec.value_extra_bits) * HEAD_DIM)
        forward, inverse, scales, bits = [], [], [], []
        eye = torch.eye(HEAD_DIM, dtype=torch.float64)
        for h in range(second.shape[0]):
            m = metric[h].double()
            a = sqrtm(m + 1e-5 * torch.trace(m) / HEAD_DIM * eye)
            lam, u = torch.linalg.eigh(a @ second[h].double() @ a)
            lam, u = lam.flip(0).clamp_min(0), u.flip(1)
            t = a @ u
            forward.append(t.float())
            inverse.append(torch.linalg.inv(t).float())
            scales.append(lam.sqrt().float().clamp_min(1e-12))
            bits.append(allocate_bits(lam, budget, floor=floor))
        out = (torch.stack(forward), torch.stack(inverse), torch.stack(scales), torch.stack(bits))
        c[key] = out
        return out

    def transform_code(self, x: torch.Tensor, layer: int, side: str, cfg: Config) -> torch.Tensor:
        """x fp32 [N, Hk, D] through ``kt`` / ``vt``'s coder and back."""
        forward, inverse, scales, bits = self.transform_coder(layer, side, cfg)
        out = torch.empty_like(x)
        for h in range(x.shape[1]):
            y = x[:, h] @ forward[h]
            out[:, h] = transform_round_trip(y, scales[h], bits[h], "tn" in cfg.flags) @ inverse[h]
        return out

    # -- the cache round trip ----------------------------------------------------------------
    def __call__(self, layer, key, value, query=None):
        if self.calibrate:
            self.collect(layer, query, key, value)
            return super().__call__(layer, key, value)
        cfg = self.cfg
        if cfg is None or cfg.preset is None or not self.compressed(layer):
            return super().__call__(layer, key, value)
        batch, heads, tokens, dim = key.shape
        c = self.const[layer]
        k, v = key.float(), value.float()
        if "mk" in cfg.flags:
            k = k - c["k_mean"][None, :, None, :]
        elif cfg.seq_mean:
            lo = 1 if cfg.seq_skip0 else 0
            k = k - k[:, :, lo: lo + cfg.seq_mean].mean(2, keepdim=True)
        k0 = k
        if "mv" in cfg.flags:
            v = v - c["v_mean"][None, :, None, :]
        km, kmi, vm, vmi = self.transforms(layer, cfg)
        if km is not None:
            k = torch.einsum("bhtd,hde->bhte", k, km)
        if vm is not None:
            v = torch.einsum("bhtd,hde->bhte", v, vm)
        flat = [t.transpose(1, 2).reshape(batch * tokens, heads, dim) for t in (k, v)]
        k_hat, v_hat = cfg.preset.round_trip(*flat)
        p = cfg.preset
        for mode in ("raw", "proj", "ub"):
            if "v" + mode in cfg.flags:
                v_hat = lloyd_max_round_trip(flat[1].reshape(-1, dim), p.value_bits, p.value_wide_coords,
                                             mode).reshape(v_hat.shape)
            if "k" + mode in cfg.flags and not p.key_outliers:
                k_hat = lloyd_max_round_trip(flat[0].reshape(-1, dim), p.key_bits, p.key_wide_coords,
                                             mode).reshape(k_hat.shape)
        if "kt" in cfg.flags:
            k_hat = self.transform_code(flat[0], layer, "k", cfg)
        if "vt" in cfg.flags:
            v_hat = self.transform_code(flat[1], layer, "v", cfg)
        if "konly" in cfg.flags:  # diagnostics: the other side exact (bf16)
            v_hat = flat[1].to(torch.bfloat16).float()
        if "vonly" in cfg.flags:
            k_hat = flat[0].to(torch.bfloat16).float()
        k_hat, v_hat = [t.reshape(batch, tokens, heads, dim).transpose(1, 2) for t in (k_hat, v_hat)]
        if kmi is not None:
            k_hat = torch.einsum("bhtd,hde->bhte", k_hat, kmi)
        if vmi is not None:
            v_hat = torch.einsum("bhtd,hde->bhte", v_hat, vmi)
        if "mv" in cfg.flags:
            v_hat = v_hat + c["v_mean"][None, :, None, :]
        if cfg.sink:  # the first tokens in bf16, keys minus the same offset as the others
            n = cfg.sink
            k_hat = torch.cat([k0[:, :, :n].to(torch.bfloat16).float(), k_hat[:, :, n:]], 2)
            v_hat = torch.cat([value[:, :, :n].to(torch.bfloat16).float(), v_hat[:, :, n:]], 2)
        return k_hat.to(key.dtype), v_hat.to(value.dtype)


@torch.no_grad()
def evaluate(model, head, chunks, label, reference=None):
    """(ppl, tokens, mean KL(reference || this) in nats per token or None, per-window ppl); ``reference``: a
    list to fill with each window's bf16 log-probabilities (empty) or to compare against."""
    kl, per_window = [0.0], []

    def window(i: int, logits: torch.Tensor, nll: float) -> None:
        per_window.append(math.exp(nll / logits.shape[0]))
        if reference is not None:
            logp = torch.log_softmax(logits, dim=-1)
            if len(reference) <= i:
                reference.append(logp.to(torch.bfloat16))
            else:
                ref = reference[i].float()
                kl[0] += float((ref.exp() * (ref - logp)).sum())

    ppl, count = Q.perplexity(model, head, chunks, label, on_window=window)
    return ppl, count, (kl[0] / count if reference is not None else None), per_window


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", required=True, help="comma-separated configurations (bf16 first is implied)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--base", type=float, default=None, help="bf16 ppl to compare with (skips the bf16 row)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    configs = [parse_config(t) for t in args.configs.split(",") if t]
    model, tokenizer = Q.load_model()
    tokens = Q.load_tokens(tokenizer, Path.home() / ".cache" / "tqkv")
    head = Q.fp32_head(model)
    rt = Q.install_round_trip(model, Explore(model))
    chunks = Q.windows(tokens, math.ceil(args.tokens / args.window), args.window)
    first, last = calibrate(model, rt, tokens, args.window)
    print(f"calibrated on tokens {first}..{last}", flush=True)
    base = args.base
    reference = None
    if base is None:
        rt.cfg = None
        reference = []
        base, _, _, base_windows = evaluate(model, head, chunks, "bf16", reference)
        print(f"{'bf16':36s} slot 128 B  16.000 b  ppl {base:8.3f}  +0.00%  windows "
              + " ".join(f"{p:.3f}" for p in base_windows), flush=True)
    for cfg in configs:
        rt.cfg = cfg
        start = time.time()
        ppl, count, kl, per_window = evaluate(model, head, chunks, cfg.label, reference)
        slot = cfg.preset.slot_bytes if cfg.preset else 128
        extra = ""
        if reference is not None:
            extra = f"  KL {1000 * kl:6.2f} mnat  windows " + " ".join(
                f"{100 * (p / b - 1):+.2f}%" for p, b in zip(per_window, base_windows))
        print(f"{cfg.label:36s} slot {slot:3d} B  {slot * 8 / (2 * HEAD_DIM):6.3f} b  ppl {ppl:8.3f}  "
              f"{100 * (ppl / base - 1):+6.2f}%{extra}  ({count} tokens, {time.time() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
