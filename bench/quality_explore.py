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
- ``heads``: (special, see --per-head) a per-(layer, kv head) choice of mix.

    python bench/quality_explore.py --configs k5v3,k5v3+mk,k5v3+mk+ks [--tokens 4096]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tqkv_compile import quality as Q  # noqa: E402
from tqkv_compile.codec import Preset, PresetSpec  # noqa: E402

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
    per_head: dict | None = None  # (layer, head) -> Preset


def parse_config(text: str) -> Config:
    parts = text.split("+")
    preset = None if parts[0] == "bf16" else Preset("experiment", HEAD_DIM, parse_mix(parts[0]))
    cfg = Config(text, preset, set())
    for flag in parts[1:]:
        if m := re.fullmatch(r"mk(\d+)(s?)", flag):
            cfg.seq_mean, cfg.seq_skip0 = int(m.group(1)), bool(m.group(2))
        elif m := re.fullmatch(r"sink(\d+)", flag):
            cfg.sink = int(m.group(1))
        elif flag in ("mk", "ks", "kS", "vs", "vS", "mv"):
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

    def transforms(self, layer: int, flags: set[str]):
        """(key M, key M^-1, value M, value M^-1) float32 [Hk, D, D] or None, cached per flag set."""
        c = self.const[layer]
        key = ("tf", layer, "mk" in flags, "ks" in flags, "kS" in flags, "vs" in flags, "vS" in flags, "mv" in flags)
        if key in c:
            return c[key]
        hk = c["k_mean"].shape[0]
        out = [None, None, None, None]
        sk = c["k_cov"] if "mk" in flags else c["k_second"]
        sv = c["v_cov"] if "mv" in flags else c["v_second"]
        for i, (diag, full, sx, sw) in enumerate((("ks", "kS", sk, c["q_second"]), ("vs", "vS", sv, c["w"]))):
            if diag in flags:
                dx = torch.diagonal(sx, dim1=-2, dim2=-1)
                dw = torch.diagonal(sw, dim1=-2, dim2=-1)
                s = (dw / dx.clamp_min(1e-12 * dx.max())) ** 0.25
                s = s / s.log().mean(-1, keepdim=True).exp()
                m = torch.diag_embed(s)
            elif full in flags:
                m = torch.stack([geo_transform(sx[h], sw[h]) for h in range(hk)])
            else:
                continue
            out[2 * i], out[2 * i + 1] = m.float(), torch.linalg.inv(m).float()
        c[key] = out
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
        km, kmi, vm, vmi = self.transforms(layer, cfg.flags)
        if km is not None:
            k = torch.einsum("bhtd,hde->bhte", k, km)
        if vm is not None:
            v = torch.einsum("bhtd,hde->bhte", v, vm)
        flat = [t.transpose(1, 2).reshape(batch * tokens, heads, dim) for t in (k, v)]
        if cfg.per_head:
            outs = [cfg.per_head[(layer, h)].round_trip(flat[0][:, h: h + 1].contiguous(), flat[1][:, h: h + 1].contiguous())
                    for h in range(heads)]
            k_hat, v_hat = torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)
        else:
            k_hat, v_hat = cfg.preset.round_trip(*flat)
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


def install(model) -> Explore:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rt = Explore(model)

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = rt(module.layer_idx, key, value, query)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("tqkv_explore", attention)
    model.set_attn_implementation("tqkv_explore")
    return rt


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
    rt = install(model)
    chunks = Q.windows(tokens, math.ceil(args.tokens / args.window), args.window)
    third = tokens.numel() // 3
    rt.calibrate = True
    with torch.no_grad():
        model.model(tokens[third: third + args.window][None])
    rt.finish_calibration()
    print(f"calibrated on tokens {third}..{third + args.window}", flush=True)
    base = args.base
    if base is None:
        rt.cfg = None
        base, _ = Q.perplexity(model, head, chunks, "bf16")
        print(f"{'bf16':36s} slot 128 B  16.000 b  ppl {base:8.3f}  +0.00%", flush=True)
    for cfg in configs:
        rt.cfg = cfg
        start = time.time()
        ppl, count = Q.perplexity(model, head, chunks, cfg.label)
        slot = cfg.preset.slot_bytes if cfg.preset else 128
        print(f"{cfg.label:36s} slot {slot:3d} B  {slot * 8 / (2 * HEAD_DIM):6.3f} b  ppl {ppl:8.3f}  "
              f"{100 * (ppl / base - 1):+6.2f}%  ({count} tokens, {time.time() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
