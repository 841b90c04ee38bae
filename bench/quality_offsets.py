"""Experiment for issue 6 (not a product feature): per-layer, per-kv-head mean offsets taken out of keys and
values before they are coded, on `tqkv quality`'s model and corpus.

Keys: softmax ignores the constant q.mu_k that subtracting a mean key leaves in every score of a query, so a
cache could store k - mu_k and read it back unchanged (only the write would need mu_k). Values: attention
weights sum to one, so out = sum p (v - mu_v) + mu_v (the read would add mu_v back). The means are measured on
a calibration window (a third into the corpus) that no evaluated window overlaps, with the bf16 row.

    python bench/quality_offsets.py [--tokens 4096]      (needs the `quality` extras, as `tqkv quality`)
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from tqkv_compile import quality as Q
from tqkv_compile.codec import Preset, PresetSpec, get_preset

SPECS = {  # 68 B slots at head 64 (4.25 bits) but the last, 4bit_nc's 70 B
    "k5v3": PresetSpec(5, 3, True, None, value_format="lloyd_max"),
    "k4.5v3.5": PresetSpec(4, 3, True, None, value_format="lloyd_max", key_extra_bits=0.5, value_extra_bits=0.5),
    "k4v4": PresetSpec(4, 4, True, None, value_format="lloyd_max"),
    "4bit_nc": get_preset("turboquant_4bit_nc", 64).spec,
}


class OffsetRoundTrip(Q.KVRoundTrip):
    """KVRoundTrip with a preset object (not only registered names) and optional mean offsets; in
    ``calibrate`` mode it sums each layer's keys and values instead."""

    def __init__(self, num_layers: int):
        super().__init__(num_layers)
        self.preset: Preset | None = None
        self.key_mean = self.value_mean = True
        self.calibrate = False
        self.sums: dict[int, list[torch.Tensor]] = {}
        self.counts: dict[int, int] = {}
        self.means: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor | None = None):
        if self.calibrate:
            k, v = key.float().sum(dim=(0, 2)), value.float().sum(dim=(0, 2))  # [Hk, D]
            if layer in self.sums:
                self.sums[layer][0] += k
                self.sums[layer][1] += v
            else:
                self.sums[layer] = [k, v]
            self.counts[layer] = self.counts.get(layer, 0) + key.shape[0] * key.shape[2]
            return super().__call__(layer, key, value)
        if self.preset is None or not self.compressed(layer):
            return super().__call__(layer, key, value)
        batch, heads, tokens, dim = key.shape
        mu_k, mu_v = self.means[layer]
        k = key.float() - (mu_k[None, :, None, :] if self.key_mean else 0)
        v = value.float() - (mu_v[None, :, None, :] if self.value_mean else 0)
        flat = [t.transpose(1, 2).reshape(batch * tokens, heads, dim) for t in (k, v)]
        k_hat, v_hat = self.preset.round_trip(*flat)
        k_hat, v_hat = [t.reshape(batch, tokens, heads, dim).transpose(1, 2) for t in (k_hat, v_hat)]
        if self.value_mean:  # the read adds the mean value back; the mean key is never added back
            v_hat = v_hat + mu_v[None, :, None, :]
        return k_hat.to(key.dtype), v_hat.to(value.dtype)

    def finish_calibration(self) -> None:
        self.calibrate = False
        self.means = {layer: (s[0] / self.counts[layer], s[1] / self.counts[layer]) for layer, s in self.sums.items()}


def calibrate(model, round_trip, tokens: torch.Tensor, window: int) -> tuple[int, int]:
    """Runs the window a third into the corpus (no evaluated window overlaps it) through ``model`` with
    ``round_trip`` in calibration mode, then lets it compute its constants; returns the window's span."""
    third = tokens.numel() // 3
    round_trip.calibrate = True
    with torch.no_grad():
        model.model(tokens[third: third + window][None])
    round_trip.finish_calibration()
    return third, third + window


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = Q.load_model()
    tokens = Q.load_tokens(tokenizer, Path.home() / ".cache" / "tqkv")
    head = Q.fp32_head(model)
    rt = Q.install_round_trip(model, OffsetRoundTrip(model.config.num_hidden_layers))
    chunks = Q.windows(tokens, math.ceil(args.tokens / args.window), args.window)
    first, last = calibrate(model, rt, tokens, args.window)
    norms = [float(mu_k.norm(dim=-1).mean()) for mu_k, _ in rt.means.values()]
    print(f"calibrated on tokens {first}..{last}; the mean key's norm per layer (average over "
          "heads): " + " ".join(f"{n:.1f}" for n in norms), flush=True)
    rows = [("bf16", None, False, False)]
    for name, spec in SPECS.items():
        rows += [(name, spec, False, False), (name, spec, True, False), (name, spec, True, True)]
    rows.insert(4, ("k5v3", SPECS["k5v3"], False, True))
    base = None
    for label, spec, key_mean, value_mean in rows:
        rt.row = "bf16"
        rt.preset = Preset("experiment", 64, spec) if spec else None
        rt.key_mean, rt.value_mean = key_mean, value_mean
        start = time.time()
        ppl, count = Q.perplexity(model, head, chunks, label)
        base = base or ppl
        slot = rt.preset.slot_bytes if rt.preset else 128
        tag = label + (" -mu_k" if key_mean else "") + (" -mu_v" if value_mean else "")
        print(f"{tag:28s} slot {slot:3d} B  ppl {ppl:8.3f}  {100 * (ppl / base - 1):+6.2f}%  ({count} tokens, "
              f"{time.time() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
