"""Decode attention over a matrix of model shapes and batches: tqkv beside FA3 (bf16, fp8) and vLLM's TurboQuant,
timed in one run (``tqkv bench kernels --shapes``).

A cell is a (shape, case): the shape is a model's attention heads on one GPU (query heads, kv heads, head size),
the case a batch (uniform lengths, a ragged batch, several query rows a sequence). Every implementation of a cell
reads the same positions; the time is per call under CUDA-graph replay with the L2 kept cold (disjoint block
tables in turn, as :func:`bench_kernels.rotations`). vLLM's TurboQuant decode takes one query row a sequence: for
several rows it is given one pseudo-sequence a row (its causal length, the same blocks), which is what it would
have to do.

Records (a JSON list after one ``{"meta": ...}``): ``{"shape", "case", "impl": "fa3_bf16" | "fa3_fp8" | "vllm_tq"
| "tqkv", "preset", "batch", "max_len", "rows", "us"}`` (``error`` in place of ``us`` where a call failed). The
plot is a heat map a preset of FA3 bf16's time over tqkv's (> 1: tqkv is faster).

    tqkv bench kernels --shapes --out bench/results/h100-kernels-shapes.json --plot bench/results/h100-kernels-shapes.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tqkv_compile.argtypes import plot_path

# name -> (query heads, kv heads, head size) on one GPU
SHAPES = {
    "llama3-8b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "llama3-70b-tp8": (8, 1, 128),
    "qwen2.5-0.5b": (14, 2, 64),
    "head256": (8, 4, 256),
    "llama3-8b-tp2": (16, 4, 128),
}
PRESETS = ["turboquant_4bit_nc", "turboquant_k8v4"]
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]  # each sequence's length, its new rows included
    rows: int = 1  # query rows a sequence (speculative verification: the last ``rows`` positions)

    @property
    def batch(self) -> int:
        return len(self.lens)


def ragged_lengths(batch: int, low: int, high: int) -> tuple[int, ...]:
    """``batch`` lengths spread geometrically over [low, high], shuffled by a fixed permutation (so a batch's
    long sequences are not all at one end)."""
    ratio = (high / low) ** (1 / max(batch - 1, 1))
    lens = [round(low * ratio**i) for i in range(batch)]
    order = torch.randperm(batch, generator=torch.Generator().manual_seed(0)).tolist()
    return tuple(lens[i] for i in order)


CASES = {
    "1x4096": Case((4096,)),
    "1x32768": Case((32768,)),
    "1x131072": Case((131072,)),
    "16x8192": Case((8192,) * 16),
    "64x32768": Case((32768,) * 64),
    "64-ragged-1k..64k": Case(ragged_lengths(64, 1024, 65536)),
    "32x16384x4rows": Case((16384,) * 32, rows=4),
}


def _paged(case: Case, tables_wanted: int, device: str):
    """(block tables, one per rotation [batch, width] int32; the number of blocks they use) for ``case``."""
    blocks = [math.ceil(length / BLOCK_SIZE) for length in case.lens]
    width = max(blocks)
    total = sum(blocks)
    order = torch.randperm(tables_wanted * total, device=device).to(torch.int32)
    tables = []
    for t in range(tables_wanted):
        table = torch.zeros(case.batch, width, dtype=torch.int32, device=device)
        at = t * total
        for b, n in enumerate(blocks):
            table[b, :n] = order[at : at + n]
            at += n
        tables.append(table)
    return tables, tables_wanted * total


def run_cell(records: list, shape: str, case_name: str, presets: list[str], vllm) -> None:
    """Time every implementation of one cell into ``records``."""
    import tqkv_compile
    from tqkv_compile.tools.bench_kernels import _record, _time_per_table, rotations

    hq, hk, dim = SHAPES[shape]
    case = CASES[case_name]
    dev = "cuda"
    rows_total = case.batch * case.rows
    smallest = sum(case.lens) * hk * min(tqkv_compile.get_preset(p, dim).slot_bytes for p in presets)
    n_tables = rotations(smallest, torch.cuda.get_device_properties(0).L2_cache_size)
    tables, num_blocks = _paged(case, n_tables, dev)
    seq_lens = torch.tensor(case.lens, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, rows_total + 1, case.rows, dtype=torch.int32, device=dev)
    q = torch.randn(rows_total, hq, dim, dtype=torch.bfloat16, device=dev)
    scale = dim**-0.5
    base = dict(shape=shape, case=case_name, batch=case.batch, max_len=max(case.lens), rows=case.rows)

    def timed(impl: str, preset: str, fn) -> None:
        try:
            us, how = _time_per_table(fn, tables)
            _record(records, **base, impl=impl, preset=preset, us=round(us, 1), timing=how)
        except Exception as exc:  # noqa: BLE001 (a failing implementation is recorded, the rest go on)
            _record(records, **base, impl=impl, preset=preset, error=f"{type(exc).__name__}: {str(exc)[:300]}")

    if vllm is not None:
        kc = torch.randn(num_blocks, BLOCK_SIZE, hk, dim, dtype=torch.bfloat16, device=dev)
        vc = torch.randn_like(kc)
        fa_args = dict(max_seqlen_q=case.rows, cu_seqlens_q=qsl, max_seqlen_k=max(case.lens), seqused_k=seq_lens,
                       softmax_scale=scale, causal=True, fa_version=3)
        timed("fa3_bf16", "bf16", lambda bt: vllm["fa"](q=q, k=kc, v=vc, block_table=bt, **fa_args))
        k8, v8, q8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), q.to(torch.float8_e4m3fn)
        ones = torch.ones(case.batch, hk, dtype=torch.float32, device=dev)
        out8 = torch.empty(rows_total, hq, dim, dtype=torch.bfloat16, device=dev)
        timed("fa3_fp8", "fp8", lambda bt: vllm["fa"](q=q8, k=k8, v=v8, block_table=bt, q_descale=ones,
                                                      k_descale=ones, v_descale=ones, out=out8, **fa_args))
        del kc, vc, k8, v8
        torch.cuda.empty_cache()
    backend = tqkv_compile.get_backend("triton")
    for name in presets:
        p = tqkv_compile.get_preset(name, dim)
        cache = torch.randint(0, 100, (num_blocks, BLOCK_SIZE, hk, p.slot_bytes), dtype=torch.uint8, device=dev)
        timed("tqkv", name, lambda bt: backend.decode_kernels(q, cache, bt, seq_lens, qsl, scale, p))
        del cache
        if vllm is not None and p.spec.vllm_name is not None:
            timed("vllm_tq", name, _vllm_tq(vllm, name, case, q, seq_lens, num_blocks, hk, dim, scale))
        torch.cuda.empty_cache()


def _vllm_tq(vllm, name: str, case: Case, q, seq_lens, num_blocks: int, hk: int, dim: int, scale: float):
    """vLLM's TurboQuant decode for the cell: one pseudo-sequence a query row where a sequence has several."""
    dev = q.device
    cfg = vllm["TurboQuantConfig"].from_cache_dtype(name, dim)
    cache = torch.randint(0, 100, (num_blocks, BLOCK_SIZE, hk, cfg.slot_size_aligned), dtype=torch.uint8,
                          device=dev)
    pi = torch.linalg.qr(torch.randn(dim, dim, device=dev))[0].contiguous()
    centroids = vllm["get_centroids"](dim, cfg.centroid_bits).to(dev)
    lens = seq_lens
    if case.rows > 1:  # row j of n sees seq_len - n + 1 + j positions
        step = torch.arange(case.rows, device=dev, dtype=torch.int32) - (case.rows - 1)
        lens = (seq_lens[:, None] + step[None, :]).reshape(-1)

    def call(bt):
        table = bt.repeat_interleave(case.rows, 0) if case.rows > 1 else bt
        return vllm["tq_decode"](q, cache, table, lens, pi, centroids, scale, cfg.key_mse_bits, cfg.key_packed_size,
                                 cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
                                 norm_correction=cfg.norm_correction, PiT=pi.T.contiguous(), max_num_kv_splits=32)
    return call


def ratios(records: list[dict], baseline: str = "fa3_bf16") -> dict:
    """{preset: {(shape, case): baseline's time / tqkv's}} over the cells where both have a time."""
    times = {(r["shape"], r["case"], r["impl"], r["preset"]): r["us"] for r in records if "us" in r}
    base = {(s, c): us for (s, c, impl, _), us in times.items() if impl == baseline}
    out: dict = {}
    for (s, c, impl, preset), us in times.items():
        if impl == "tqkv" and (s, c) in base:
            out.setdefault(preset, {})[(s, c)] = base[(s, c)] / us
    return out


def plot(records: list[dict], path: str) -> None:
    """Heat maps, one a preset: FA3 bf16's time / tqkv's per (shape, case); cells without both are blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = ratios(records)
    if not table:
        print("# no cell has both FA3 bf16 and tqkv: no chart", file=sys.stderr)
        return
    shapes = [s for s in SHAPES if any(s == k[0] for t in table.values() for k in t)]
    cases = [c for c in CASES if any(c == k[1] for t in table.values() for k in t)]
    fig, axes = plt.subplots(1, len(table), figsize=(1.3 * len(cases) * len(table) + 2, 0.6 * len(shapes) + 2),
                             squeeze=False)
    for ax, (preset, cells) in zip(axes[0], sorted(table.items())):
        grid = [[cells.get((s, c), math.nan) for c in cases] for s in shapes]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=2.0)
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(cases)), cases, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(shapes)), shapes, fontsize=8)
        ax.set_title(f"{preset}: FA3 bf16 time / tqkv time", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv: list[str]) -> int:
    from tqkv_compile.tools.bench_kernels import _meta, _vllm

    parser = argparse.ArgumentParser(prog="tqkv bench kernels --shapes", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape-names", default=",".join(SHAPES), help="comma-separated shapes (%(default)s)")
    parser.add_argument("--case-names", default=",".join(CASES), help="comma-separated cases (%(default)s)")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets (%(default)s)")
    parser.add_argument("--no-baselines", action="store_true", help="time tqkv only")
    parser.add_argument("--out", help="JSON path for the records (rewritten after every cell)")
    parser.add_argument("--plot", type=plot_path, help="PNG path: the heat map")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shape_names.split(",") if s]
    cases = [c for c in args.case_names.split(",") if c]
    unknown = [s for s in shapes if s not in SHAPES] + [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown shape or case: {', '.join(unknown)} (shapes: {', '.join(SHAPES)}; "
                     f"cases: {', '.join(CASES)})")
    if not torch.cuda.is_available():
        print("tqkv bench kernels --shapes: needs a CUDA GPU", file=sys.stderr)
        return 2
    presets = [p for p in args.presets.split(",") if p]
    vllm = None if args.no_baselines else _vllm()
    meta = _meta(argv)
    meta["meta"]["command"] = "tqkv bench kernels " + " ".join(argv)
    meta["meta"]["shape"] = {name: dict(q_heads=q, kv_heads=k, head_dim=d) for name, (q, k, d) in SHAPES.items()
                             if name in shapes}
    records: list[dict] = [meta]
    cells = [(s, c) for s in shapes for c in cases]
    for done, (shape, case) in enumerate(cells, 1):
        print(f"[shapes {done}/{len(cells)}] {shape} {case}", file=sys.stderr, flush=True)
        run_cell(records, shape, case, presets, vllm)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    for preset, cells_ratio in sorted(ratios(records).items()):
        worst = min(cells_ratio.items(), key=lambda kv: kv[1])
        print(f"{preset}: FA3 bf16 / tqkv from {worst[1]:.2f}x ({worst[0][0]} {worst[0][1]}) to "
              f"{max(cells_ratio.values()):.2f}x over {len(cells_ratio)} cells")
    if args.plot:
        plot(records, args.plot)
    return 0
