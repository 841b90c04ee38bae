"""Where the prefill path's time goes, one layer at the Llama-3-8B shape (32 q / 8 kv heads, head 128, block 16):
each part of ``prefill.dense_attention`` timed alone on the GPU (triton's do_bench, median us). Needs torch and
triton only (FlashAttention is not part of it; ``bench_kernels --prefill`` times the whole path beside FA3).

    python bench/prefill_parts.py [--cases 4x4096,1x16384] [--presets turboquant_4bit_nc,turboquant_k8v4]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import tqkv_compile
from tqkv_compile.backends import prefill

HQ, HK, D, BS = 32, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="4x4096,1x16384")
    parser.add_argument("--presets", default="turboquant_4bit_nc,turboquant_k8v4")
    args = parser.parse_args()
    dev = "cuda"
    backend = tqkv_compile.get_backend("triton")
    for case in args.cases.split(","):
        B, L = (int(x) for x in case.split("x"))
        T, nb = B * L, L // BS
        q = torch.randn(T, HQ, D, dtype=torch.bfloat16, device=dev)
        k, v = torch.randn(T, HK, D, dtype=torch.bfloat16, device=dev), torch.randn(T, HK, D, dtype=torch.bfloat16, device=dev)
        bt = torch.randperm(B * nb, device=dev).to(torch.int32).view(B, nb)
        qsl = torch.arange(0, T + 1, L, dtype=torch.int32, device=dev)
        seq_lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        seqs, lengths = list(range(B)), [L] * B
        slots = prefill.slot_ids(bt, seqs, lengths, BS)
        for name in args.presets.split(","):
            p = tqkv_compile.get_preset(name, D)
            cache = torch.zeros(B * nb, BS, HK, p.slot_bytes, dtype=torch.uint8, device=dev)
            backend.kv_write(k, v, cache, slots, p)
            parts = {
                "plan (one host read)": lambda: prefill.plan(qsl, seq_lens, T),
                "slot_ids": lambda: prefill.slot_ids(bt, seqs, lengths, BS),
                "dequant kernel": lambda: backend.dense_decode(cache, slots, p, torch.bfloat16),
                "codec decode (PyTorch)": lambda: prefill.codec_decode(cache, slots, p, torch.bfloat16),
                "query to stored basis": lambda: prefill.stored_basis(q, p, D**-0.5),
                "cu_seqlens (one host-to-device)": lambda: torch.tensor(
                    list(range(0, T + 1, L)) * 2, dtype=torch.int32, device=dev).view(2, -1),
            }
            for part, fn in parts.items():
                us = do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
                print(json.dumps({"case": case, "preset": name, "part": part, "us": round(us, 1)}), flush=True)


if __name__ == "__main__":
    main()
