"""Inductor launching tqkv's Triton kernels from its generated code.

A small decode step written against the ``tqkv::triton_kv_write`` / ``tqkv::triton_attention`` ops (the
``triton_op`` forms of the kernels, :mod:`tqkv_compile.lowerings.inductor_ops`) is compiled with
``torch.compile``; the script prints the generated code's lines that launch our kernels and checks the
compiled step against eager and against the reference backend.

    python examples/inductor_lowering.py            # CUDA if present, else the CPU (the checked ops)
    python examples/inductor_lowering.py --show 40  # more of the generated code

On CUDA the generated code defines and launches ``_kv_write_kernel``, ``_decode_stream_kernel`` (which
rotates a bf16 / fp16 query itself; ``_prepare_query_kernel`` does it before for an fp32 one) and
``_merge_kernel`` itself; on the CPU it calls ``tqkv::kv_write`` /
``tqkv::attention`` (the CPU's PyTorch backend).
"""

from __future__ import annotations

import argparse
import re

import torch
from torch._inductor.utils import run_and_get_code

import tqkv_compile
from tqkv_compile.lowerings import inductor_ops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="turboquant_4bit_nc")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--show", type=int, default=12, help="generated-code lines to print")
    args = parser.parse_args()

    dev = torch.device(args.device)
    preset = tqkv_compile.get_preset(args.preset, args.head_dim)
    tables = inductor_ops.tables(preset.name, preset.head_dim, dev)
    kv_heads, group, block, seqs, context = 8, 4, 16, 4, 300
    blocks_per_seq = (context + 1 + block - 1) // block
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    table = torch.randperm(seqs * blocks_per_seq, generator=gen).view(seqs, blocks_per_seq).to(dev, torch.int32)
    cache = torch.zeros(seqs * blocks_per_seq, block, kv_heads, preset.slot_bytes, dtype=torch.uint8, device=dev)
    positions = torch.arange(context, device=dev)
    for s in range(seqs):  # the prompt, written through the checked op
        slots = table[s, positions // block].long() * block + positions % block
        torch.ops.tqkv.kv_write(randn(context, kv_heads, preset.head_dim), randn(context, kv_heads, preset.head_dim),
                                cache, slots, preset.name)
    seq_lens = torch.full((seqs,), context + 1, dtype=torch.int32, device=dev)
    new_slots = table[:, context // block].long() * block + context % block
    query_start_loc = torch.arange(seqs + 1, dtype=torch.int32, device=dev)
    q = randn(seqs, kv_heads * group, preset.head_dim)
    k, v = randn(seqs, kv_heads, preset.head_dim), randn(seqs, kv_heads, preset.head_dim)
    scale = preset.head_dim**-0.5

    def decode_step(q, k, v, cache, slots, table, seq_lens, query_start_loc):
        torch.ops.tqkv.triton_kv_write(k, v, cache, slots, tables["rotation"], tables["midpoints"], tables["centroids"],
                                         preset.name)
        out = torch.ops.tqkv.triton_attention(q, cache, table, seq_lens, query_start_loc, tables["rotation"],
                                              tables["centroids"], tables["key_lut"], tables["signs"], scale, preset.name)
        return out.float() * 2.0  # something for Inductor to fuse after the op

    eager_cache, compiled_cache = cache.clone(), cache.clone()
    eager = decode_step(q, k, v, eager_cache, new_slots, table, seq_lens, query_start_loc)
    compiled, code = run_and_get_code(torch.compile(decode_step, dynamic=False), q, k, v, compiled_cache, new_slots,
                                      table, seq_lens, query_start_loc)
    source = "\n".join(code)
    launches = [line.strip() for line in source.splitlines()
                if re.search(r"(_kv_write_kernel|_prepare_query_kernel|_decode_\w+_kernel|_merge_kernel)\w*\.run\(|tqkv\.(kv_write|attention)", line)]
    kernels = sorted(set(re.findall(r"def (_kv_write_kernel|_prepare_query_kernel|_decode_\w+_kernel|_merge_kernel)\(", source)))
    print(f"device {dev}, preset {preset.name}, head {preset.head_dim}: {len(code)} generated module(s)")
    print(f"Triton kernels defined in the generated code: {kernels or 'none (the checked ops off CUDA)'}")
    print("launches / calls in the generated code:")
    for line in launches[: args.show]:
        print("   ", line[:160])
    cache_same = torch.equal(eager_cache, compiled_cache)
    diff = float((eager - compiled).abs().max())
    reference = tqkv_compile.get_backend("reference").attention(q.float().cpu(), eager_cache.cpu(), table.cpu(),
                                                               seq_lens.cpu(), query_start_loc.cpu(), scale, preset)
    ref_diff = float((2.0 * reference - compiled.cpu()).norm() / (2.0 * reference).norm())
    print(f"compiled vs eager: cache bytes equal {cache_same}, max |diff| {diff:.3g}; "
          f"vs reference (relative) {ref_diff:.3g}")
    ok = cache_same and diff < 1e-2 and ref_diff < 2e-2 and (dev.type != "cuda" or bool(kernels))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
