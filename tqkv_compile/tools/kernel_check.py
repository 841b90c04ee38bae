"""Every attention kernel against the exact oracle (:mod:`tqkv_compile.oracle`) over the shapes users serve.

``tqkv bench kernels --check`` runs this on a GPU: every preset (vLLM's and ours), heads 64 / 128 / 256, query-head
groups 1..8, one and two kv heads, one sequence of 131072 positions, a ragged batch spanning 1..65536 positions,
1..8 query rows a sequence, a continuation chunk (the dense prefill path), flat and peaked attention; for each,
every kernel that can serve it (the stream, byte and fragment kernels for vLLM's layouts, the stream and
fragment kernels with length-aware splits too, the general kernel for ours), the backend's own routing
(``launcher``) and ``kv_dot``. A case passes at ``l2_rel <= 1%`` and
``max_rel <= 2%``. The groups rotate over the (preset, head size) pairs so that every kernel meets every group
without the full product (each group is a separate compile).

Records: ``{"preset", "head_dim", "q_heads", "kv_heads", "case", "rows", "attention", "kernel", "l2_rel",
"max_rel", "ok"}``; ``rows`` lists the query rows of each sequence.
"""

from __future__ import annotations

import math
import multiprocessing
import sys

import torch

L2_LIMIT, MAX_LIMIT = 0.01, 0.02
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
BLOCK_SIZE = 16

# name -> (sequence lengths, query rows per sequence, kv heads)
CASES = {
    "chunk-200-on-20000": ([5000, 20000], [1, 200], 2),
    "1x131072": ([131072], [1], 1),
    "ragged-1..65536": ([1, 17, 300, 2049, 9000, 16385, 40000, 65536], [1] * 8, 2),
    "spec-rows-1..8": ([100, 4096, 16384, 33000], [3, 8, 1, 6], 2),
}
ATTENTION = {"flat": 1.0, "peaked": 4.0}  # the query's scale: N(0, 1) keys, so 4 makes a few positions dominate


def _cases_for(index: int, cases: dict) -> list[tuple[str, list[int], list[int], int, int]]:
    """The cases of the ``index``-th (preset, head size) pair, each with its query-head group (rotating)."""
    return [(name, lens, rows, kv_heads, GROUPS[(3 * index + j) % len(GROUPS)])
            for j, (name, (lens, rows, kv_heads)) in enumerate(cases.items())]


def _kernels(backend, preset, kv_cache, group: int) -> dict:
    """kernel name -> attention(query, block_table, seq_lens, query_start_loc, scale) for every kernel that can
    serve the call."""
    from tqkv_compile.lowerings import gluon_decode

    runs = {"launcher": lambda q, bt, sl, qsl, s: backend.attention(q, kv_cache, bt, sl, qsl, s, preset)}
    if not preset.vllm_layout:
        runs["general"] = lambda q, bt, sl, qsl, s: backend.decode_kernels(q, kv_cache, bt, sl, qsl, s, preset)
        return runs
    from tqkv_compile.lowerings.triton_attention import decode_attention, default_kernel

    rotation, centroids, _ = backend.tables(preset, kv_cache.device)
    names = ["bytes"]
    if default_kernel(preset, kv_cache, kv_cache.device) == "stream":
        names.append("stream")
    if gluon_decode.supports(preset, kv_cache, group, kv_cache.device) is None:
        names.append("fragments")
    for name in names:
        runs[name] = (lambda kernel: lambda q, bt, sl, qsl, s: decode_attention(
            q, kv_cache, bt, sl, qsl, s, preset, rotation, centroids, kernel=kernel, length_aware=False))(name)
        if name != "bytes":  # each row's split count from the batch's lengths
            runs[f"{name}-length-aware"] = (lambda kernel: lambda q, bt, sl, qsl, s: decode_attention(
                q, kv_cache, bt, sl, qsl, s, preset, rotation, centroids, kernel=kernel, length_aware=True))(name)
    return runs


def run_pair(preset_name: str, dim: int, index: int, device: str = "cuda", cases: dict | None = None) -> list[dict]:
    """All ``cases`` (default :data:`CASES`) of one (preset, head size) pair on ``device``: the records (see the
    module docstring)."""
    import tqkv_compile
    from tqkv_compile import oracle

    torch.manual_seed(1000 + index)
    preset = tqkv_compile.get_preset(preset_name, dim)
    backend = tqkv_compile.get_backend("triton")
    records = []
    for case, lens, rows, kv_heads, group in _cases_for(index, CASES if cases is None else cases):
        blocks = [math.ceil(length / BLOCK_SIZE) for length in lens]
        width = max(blocks) + 1
        cache = torch.zeros(sum(blocks) + 3, BLOCK_SIZE, kv_heads, preset.slot_bytes, dtype=torch.uint8,
                            device=device)
        order = torch.randperm(cache.shape[0], device=device)  # blocks scattered over the cache
        table = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
        used = 0
        for b, length in enumerate(lens):
            table[b, : blocks[b]] = order[used : used + blocks[b]].to(torch.int32)
            used += blocks[b]
            pos = torch.arange(length, device=device)
            slots = table[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
            for chunk in range(0, length, 16384):
                part = slots[chunk : chunk + 16384]
                k = torch.randn(part.shape[0], kv_heads, dim, device=device, dtype=torch.bfloat16)
                v = torch.randn(part.shape[0], kv_heads, dim, device=device, dtype=torch.bfloat16)
                backend.kv_write(k, v, cache, part, preset)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        qsl = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32, device=device)
        scale = dim**-0.5
        runs = _kernels(backend, preset, cache, group)
        for attention, q_scale in ATTENTION.items():
            query = (torch.randn(int(qsl[-1]), kv_heads * group, dim, device=device) * q_scale).to(torch.bfloat16)
            exact = oracle.exact_attention(query, cache, table, seq_lens, qsl, scale, preset)
            base = dict(preset=preset_name, head_dim=dim, q_heads=kv_heads * group, kv_heads=kv_heads, case=case,
                        rows=rows, attention=attention)
            for kernel, fn in runs.items():
                try:
                    l2, worst = oracle.errors(fn(query, table, seq_lens, qsl, scale), exact)
                    records.append(_judged(dict(base, kernel=kernel, l2_rel=l2, max_rel=worst)))
                except Exception as exc:  # noqa: BLE001 (a kernel that raises fails its case, the rest go on)
                    records.append(dict(base, kernel=kernel, error=f"{type(exc).__name__}: {str(exc)[:300]}",
                                        ok=False))
            last = qsl[1:] - 1  # kv_dot: each sequence's last row
            q1 = query[last.long()]
            exact_dot = oracle.exact_logits(q1, cache, table, seq_lens, scale, preset)
            got = backend.kv_dot(q1, cache, table, seq_lens, scale, preset)
            records.append(_judged(dict(base, kernel="kv_dot", **_logit_errors(got, exact_dot))))
    return records


def _logit_errors(got: torch.Tensor, exact: torch.Tensor) -> dict:
    """kv_dot's errors over the finite logits (the -inf ones must match exactly, else inf)."""
    finite = torch.isfinite(exact)
    if not torch.equal(finite, torch.isfinite(got)):
        return dict(l2_rel=math.inf, max_rel=math.inf)
    diff = torch.where(finite, got - exact, 0.0)
    ref = torch.where(finite, exact, 0.0)
    l2 = float(diff.norm() / ref.norm().clamp_min(1e-30))
    worst = float((diff.abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)).max())
    return dict(l2_rel=l2, max_rel=worst)


def _judged(record: dict) -> dict:
    record["l2_rel"] = round(record["l2_rel"], 6) if math.isfinite(record["l2_rel"]) else math.inf
    record["max_rel"] = round(record["max_rel"], 6) if math.isfinite(record["max_rel"]) else math.inf
    record["ok"] = record["l2_rel"] <= L2_LIMIT and record["max_rel"] <= MAX_LIMIT
    return record


def _pair_job(job: tuple[str, int, int]) -> list[dict]:
    try:
        return run_pair(*job)
    except Exception as exc:  # noqa: BLE001 (one pair's failure is recorded, the check goes on)
        return [dict(preset=job[0], head_dim=job[1], kernel="all", error=f"{type(exc).__name__}: {exc}"[:400],
                     ok=False)]


def check_matrix(presets: list[str], dims: list[int], workers: int = 8, on_pair=None) -> list[dict]:
    """Every (preset, head size) pair's cases on the GPU, ``workers`` processes at a time (the compiles of many
    kernel variants dominate, and they run on the CPU); a progress line per pair, and ``on_pair(records so far)``
    after each (so that a run cut short keeps what it measured)."""
    jobs = [(name, dim, i * len(dims) + j) for i, name in enumerate(presets) for j, dim in enumerate(dims)]
    records: list[dict] = []
    context = multiprocessing.get_context("spawn")
    with context.Pool(max(1, min(workers, len(jobs)))) as pool:
        for done, pair in enumerate(pool.imap_unordered(_pair_job, jobs), 1):
            records.extend(pair)
            if on_pair is not None:
                on_pair(records)
            bad = [r for r in pair if not r.get("ok")]
            worst = max((r.get("l2_rel", math.inf) for r in pair), default=math.nan)
            print(f"[check {done}/{len(jobs)}] {pair[0]['preset']} D={pair[0]['head_dim']}: {len(pair)} records, "
                  f"{len(bad)} failing, worst l2_rel {worst:.2e}", file=sys.stderr, flush=True)
            for r in bad:
                print("  FAIL " + " ".join(f"{k}={r[k]}" for k in ("case", "attention", "kernel", "q_heads",
                                                                   "kv_heads", "l2_rel", "max_rel", "error")
                                           if k in r), file=sys.stderr, flush=True)
    return records
