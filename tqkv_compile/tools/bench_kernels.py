"""Per-layer kernel benchmark on one GPU: tqkv's Triton decode attention and kv_write against FA3 (bf16, fp8)
and vLLM's own TurboQuant decode and store, all timed in the same run (CUDA-graph replay, median).

Shape: Llama-3-8B attention (32 q heads, 8 kv heads, head 128, block 16). Baselines run only where vLLM is
importable (on the GPU host: the vLLM 0.20 bundle, see ``shared/gpu/README.md``); they call the kernels the
way ``shared/gpu/baselines/decode_kernels_vllm020.py`` does.

    python -m tqkv_compile.tools.bench_kernels --out bench/results/h200-kernels.json --plot bench/results/h200-kernels.png
    python -m tqkv_compile.tools.bench_kernels --check --out bench/results/h100-kernels-check.json
        # every kernel vs exact attention over the codec's decode (tqkv_compile.tools.kernel_check), then the Triton
        # backend vs the reference (kv_write bytes, cache views, prefill)

Writes a JSON list of records ``{"op", "B", "L", "impl", "preset", "us", "GBps"}`` (kv_write: ``B`` is the
token count, ``L`` is 0, as issue 4 asks; result files before 2026-12-04 20:40 have it the other way round;
``--prefill BxL``: op ``prefill``, B whole prompts of L tokens, no GBps; its ``vllm_tq`` record, FA2 on the
raw keys and values, has preset ``raw_kv``: it is the same for every preset) and one ``{"meta": {...}}``
record.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from tqkv_compile.argtypes import plot_path

HQ, HK, D, BS = 32, 8, 128, 16
PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
CASES = [(1, 4096), (1, 32768), (16, 8192), (64, 8192), (64, 32768), (128, 16384)]
WRITE_TOKENS = [64, 8192]


def _time_us(fn, graph: bool = True) -> tuple[float, str]:
    """Median microseconds of fn under CUDA-graph replay; plain do_bench where capture fails or ``graph`` is
    False (the prefill path plans on the host, and under capture would take the decode kernels instead)."""
    from triton.testing import do_bench, do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    if not graph:
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3, "do_bench"
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3, "cudagraph"
    except Exception:  # a baseline that cannot be captured still gets a number
        torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3, "do_bench"


def _time_per_table(fn, tables) -> tuple[float, str]:
    """Microseconds per call of ``fn(block_table)`` over one pass through ``tables`` (:func:`rotations`)."""
    us, how = _time_us(lambda: [fn(bt) for bt in tables])
    return us / len(tables), how


def _vllm():
    """vLLM's kernels and config helpers, or None where vLLM is not importable."""
    try:
        from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
        from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention
        from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 (any import failure means: no baselines)
        print(f"# vLLM baselines unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return dict(get_centroids=get_centroids, TurboQuantConfig=TurboQuantConfig,
                tq_decode=triton_turboquant_decode_attention, tq_store=triton_turboquant_store,
                fa=flash_attn_varlen_func)


def _record(records, **fields):
    records.append(fields)
    print(json.dumps(fields), flush=True)


def rotations(case_bytes: int, l2_bytes: int, cold: bool = True, cap: int = 64) -> int:
    """How many disjoint block tables a decode case cycles through so that what one timed pass reads is at
    least 4x the L2 cache (``case_bytes``: what one call reads of the most compressed cache timed): an engine
    reads every layer's cache in turn, so no layer finds its cache in L2, but a benchmark that replays one call
    would, for caches near or below the L2's size (1 x 32768 in 4 bits: 35 MB against the H200's 50 MB). 1
    where the case alone is that large, or without ``cold``."""
    if not cold or case_bytes <= 0:
        return 1
    return max(1, min(cap, math.ceil(4 * l2_bytes / case_bytes)))


def _decode_case(records, B, L, presets, vllm, tune, variants=None, cache_tokens=0, cold_l2=True):
    """``cache_tokens``: allocate every cache with room for this many tokens (at least what the case reads) and
    draw the case's blocks from all of it, as in an engine whose cache fills the GPU (vLLM: millions of tokens
    per layer); 0: exactly the blocks the case reads. ``cold_l2``: each timed pass cycles through
    :func:`rotations` disjoint block tables (as many times the case's blocks), so that the L2 holds none of
    what a call reads, as in an engine's step; the time is per call. Off (``--warm-l2``): one block table,
    replayed (the figures before 2026-12-04 evening)."""
    import tqkv_compile
    from tqkv_compile.lowerings.triton_attention import decode_attention

    dev = "cuda"
    nb = L // BS
    token_bytes = [HK * tqkv_compile.get_preset(name, D).slot_bytes for name in presets]
    if vllm is not None:
        token_bytes.append(2 * HK * D)  # FA3 fp8's cache
    smallest = B * L * min(token_bytes, default=0)  # bytes one call reads of the most compressed cache
    n_tables = rotations(smallest, torch.cuda.get_device_properties(0).L2_cache_size, cold_l2)
    num_blocks = max(n_tables * B * nb, cache_tokens // BS)
    tables = torch.randperm(num_blocks, device=dev)[: n_tables * B * nb].to(torch.int32).view(n_tables, B, nb)
    tables = tables.unbind(0)
    first = len(records)
    seq_lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device=dev)
    scale = D**-0.5
    if vllm is not None:
        kc = torch.randn(num_blocks, BS, HK, D, dtype=torch.bfloat16, device=dev)
        vc = torch.randn_like(kc)
        nbytes = 2 * B * L * HK * D * 2
        # FA3: a bf16 cache's layers. FA2: what vLLM 0.20 runs on a TurboQuant engine's bf16 boundary layers
        # (it forces FA2 when the cache is TurboQuant; its FA2 is sm_80 code on Hopper)
        for version in (3, 2):
            fa = lambda bt: vllm["fa"](q=q, k=kc, v=vc, max_seqlen_q=1, cu_seqlens_q=qsl,  # noqa: E731
                                       max_seqlen_k=L, seqused_k=seq_lens, softmax_scale=scale, causal=True,
                                       block_table=bt, fa_version=version)
            try:
                us, how = _time_per_table(fa, tables)
                _record(records, op="decode", B=B, L=L, impl=f"fa{version}_bf16", preset="bf16", us=round(us, 1),
                        GBps=round(nbytes / us / 1e3, 1), timing=how)
            except Exception as exc:  # noqa: BLE001
                _record(records, op="decode", B=B, L=L, impl=f"fa{version}_bf16", preset="bf16", error=str(exc)[:300])
        try:
            k8, v8, q8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), q.to(torch.float8_e4m3fn)
            ones = torch.ones(B, HK, dtype=torch.float32, device=dev)
            out8 = torch.empty(B, HQ, D, dtype=torch.bfloat16, device=dev)
            fa8 = lambda bt: vllm["fa"](q=q8, k=k8, v=v8, max_seqlen_q=1, cu_seqlens_q=qsl,  # noqa: E731
                                        max_seqlen_k=L, seqused_k=seq_lens, softmax_scale=scale, causal=True,
                                        block_table=bt, fa_version=3, q_descale=ones, k_descale=ones,
                                        v_descale=ones, out=out8)
            us, how = _time_per_table(fa8, tables)
            _record(records, op="decode", B=B, L=L, impl="fa3_fp8", preset="fp8", us=round(us, 1),
                    GBps=round(nbytes / 2 / us / 1e3, 1), timing=how)
            del k8, v8
        except Exception as exc:  # noqa: BLE001
            _record(records, op="decode", B=B, L=L, impl="fa3_fp8", preset="fp8", error=str(exc)[:300])
        del kc, vc
        torch.cuda.empty_cache()
    tune_variants = variants
    for name in presets:
        p = tqkv_compile.get_preset(name, D)
        cache = torch.randint(0, 100, (num_blocks, BS, HK, p.slot_bytes), dtype=torch.uint8, device=dev)
        nbytes = B * L * HK * p.slot_bytes
        backend = tqkv_compile.get_backend("triton")
        variants = [{}]
        if not p.vllm_layout:  # a preset of ours: general_decode's kernel (no tuning knobs)
            call = lambda kw, bt: backend.decode_kernels(q, cache, bt, seq_lens, qsl, scale, p)  # noqa: E731
        else:
            rotation, centroids, _ = backend.tables(p, torch.device(dev))
            call = lambda kw, bt: decode_attention(  # noqa: E731
                q, cache, bt, seq_lens, qsl, scale, p, rotation, centroids, **kw)
            if tune:
                variants = tune_variants or [dict(block_n=bn, num_warps=w) for bn in (32, 64, 128) for w in (4, 8)]
        for kw in variants:
            try:
                us, how = _time_per_table(lambda bt: call(kw, bt), tables)
                _record(records, op="decode", B=B, L=L, impl="tqkv", preset=name, us=round(us, 1),
                        GBps=round(nbytes / us / 1e3, 1), timing=how, **({"variant": kw} if tune else {}))
            except Exception as exc:  # noqa: BLE001
                _record(records, op="decode", B=B, L=L, impl="tqkv", preset=name, error=str(exc)[:300],
                        **({"variant": kw} if tune else {}))
        if vllm is not None and not tune and p.spec.vllm_name is not None:
            cfg = vllm["TurboQuantConfig"].from_cache_dtype(name, D)
            vcache = torch.randint(0, 100, (num_blocks, BS, HK, cfg.slot_size_aligned), dtype=torch.uint8,
                                   device=dev)
            Pi = torch.linalg.qr(torch.randn(D, D, device=dev))[0].contiguous()
            PiT = Pi.T.contiguous()
            cent = vllm["get_centroids"](D, cfg.centroid_bits).to(dev)
            tq = lambda bt: vllm["tq_decode"](q, vcache, bt, seq_lens, Pi, cent, scale, cfg.key_mse_bits,  # noqa: E731
                                              cfg.key_packed_size, cfg.effective_value_quant_bits,
                                              key_fp8=cfg.key_fp8, norm_correction=cfg.norm_correction,
                                              PiT=PiT, max_num_kv_splits=32)
            try:
                us, how = _time_per_table(tq, tables)
                _record(records, op="decode", B=B, L=L, impl="vllm_tq", preset=name, us=round(us, 1),
                        GBps=round(B * L * HK * cfg.slot_size_aligned / us / 1e3, 1), timing=how)
            except Exception as exc:  # noqa: BLE001
                _record(records, op="decode", B=B, L=L, impl="vllm_tq", preset=name, error=str(exc)[:300])
            del vcache
        del cache
        torch.cuda.empty_cache()
    for record in records[first:]:
        record["l2"] = (f"cold: {n_tables} block tables, {n_tables * smallest / 1e6:.0f} MB a pass of the smallest "
                        "cache" if cold_l2 else "warm: one block table replayed")
        if cache_tokens:
            record["cache_tokens"] = num_blocks * BS


def _write_case(records, T, presets, vllm):
    import tqkv_compile
    from tqkv_compile.lowerings.triton_kv_write import kv_write

    dev = "cuda"
    key = torch.randn(T, HK, D, dtype=torch.bfloat16, device=dev)
    value = torch.randn_like(key)
    num_blocks = max(2 * T // BS, 64)
    slots = torch.randperm(num_blocks * BS, device=dev)[:T].to(torch.int64)
    for name in presets:
        p = tqkv_compile.get_preset(name, D)
        backend = tqkv_compile.get_backend("triton")
        cache = torch.zeros(num_blocks, BS, HK, p.slot_bytes, dtype=torch.uint8, device=dev)
        nbytes = T * HK * (2 * D * 2 + p.slot_bytes)
        if not p.vllm_layout:  # a preset of ours: general_kv_write's kernel, no vLLM counterpart
            write = lambda: backend.kv_write(key, value, cache, slots, p)  # noqa: E731
        else:
            rotation, centroids, midpoints = backend.tables(p, torch.device(dev))
            write = lambda: kv_write(key, value, cache, slots, p, rotation, midpoints, centroids=centroids)  # noqa: E731
        try:
            us, how = _time_us(write)
            _record(records, op="kv_write", B=T, L=0, impl="tqkv", preset=name, us=round(us, 1),
                    GBps=round(nbytes / us / 1e3, 1), timing=how)
        except Exception as exc:  # noqa: BLE001
            _record(records, op="kv_write", B=T, L=0, impl="tqkv", preset=name, error=str(exc)[:300])
        if vllm is None or p.spec.vllm_name is None:
            continue
        cfg = vllm["TurboQuantConfig"].from_cache_dtype(name, D)
        vcache = torch.zeros(num_blocks, BS, HK, cfg.slot_size_aligned, dtype=torch.uint8, device=dev)
        PiT = rotation.contiguous()
        cent = vllm["get_centroids"](D, cfg.centroid_bits).to(dev)
        mids = ((cent[:-1] + cent[1:]) / 2).contiguous()
        store = lambda: vllm["tq_store"](key, value, vcache, slots.to(torch.int32), PiT, mids,  # noqa: E731
                                         cfg.key_mse_bits, cfg.key_packed_size, cfg.effective_value_quant_bits,
                                         key_fp8=cfg.key_fp8)
        try:
            us, how = _time_us(store)
            _record(records, op="kv_write", B=T, L=0, impl="vllm_tq", preset=name, us=round(us, 1),
                    GBps=round(nbytes / us / 1e3, 1), timing=how)
            mine = torch.zeros_like(cache)
            kv_write(key, value, mine, slots, p, rotation, midpoints, centroids=centroids)
            vcache.zero_()
            store()
            print(f"# kv_write {name} T={T}: bytes differing from vLLM's store: "
                  f"{int((mine != vcache[..., : p.slot_bytes]).sum())} of {mine.numel()}", flush=True)
        except Exception as exc:  # noqa: BLE001
            _record(records, op="kv_write", B=T, L=0, impl="vllm_tq", preset=name, error=str(exc)[:300])


def _prefill_case(records, B, L, presets, vllm):
    """Attention of B whole prompts of L tokens (a prefill step), all rows new: tqkv's dense path (the slots
    decoded once by a Triton kernel, then FlashAttention varlen: what a continuation chunk of this size costs),
    tqkv given the step's keys and values (``tqkv_whole``: what the engine runs for a first chunk, FlashAttention
    on them), the dense path with torch's SDPA per sequence (``tqkv_sdpa``: where vLLM brings no FlashAttention), FA3 on the raw bf16 keys and values
    (the floor: a bf16 cache's first chunk) and FA2 on them (``vllm_tq``: vLLM's TurboQuant backend's first
    chunk, which attends the raw keys and values, not the cache's)."""
    import tqkv_compile
    from tqkv_compile.backends import prefill

    dev = "cuda"
    T, nb = B * L, L // BS
    q = torch.randn(T, HQ, D, dtype=torch.bfloat16, device=dev)
    k, v = torch.randn(T, HK, D, dtype=torch.bfloat16, device=dev), torch.randn(T, HK, D, dtype=torch.bfloat16, device=dev)
    seq_lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, T + 1, L, dtype=torch.int32, device=dev)
    bt = torch.randperm(B * nb, device=dev).to(torch.int32).view(B, nb)
    scale = D**-0.5
    if vllm is not None:
        # FA3: a bf16 cache's first chunk. FA2 on the same raw keys and values: what vLLM 0.20's TurboQuant
        # backend runs for a first chunk (its _prefill_attention; the engine forces FA2 with a TurboQuant cache)
        for impl, preset, version in (("fa3_bf16", "bf16", 3), ("vllm_tq", "raw_kv", 2)):
            fa = lambda: vllm["fa"](q=q, k=k, v=v, max_seqlen_q=L, cu_seqlens_q=qsl,  # noqa: E731
                                    max_seqlen_k=L, cu_seqlens_k=qsl, softmax_scale=scale, causal=True,
                                    fa_version=version)
            try:
                us, how = _time_us(fa, graph=False)
                _record(records, op="prefill", B=B, L=L, impl=impl, preset=preset, us=round(us, 1), timing=how)
            except Exception as exc:  # noqa: BLE001
                _record(records, op="prefill", B=B, L=L, impl=impl, preset=preset, error=str(exc)[:300])
    backend = tqkv_compile.get_backend("triton")
    slots = prefill.slot_ids(bt, list(range(B)), [L] * B, BS)
    starts = qsl.tolist()
    for name in presets:
        p = tqkv_compile.get_preset(name, D)
        cache = torch.zeros(B * nb, BS, HK, p.slot_bytes, dtype=torch.uint8, device=dev)
        backend.kv_write(k, v, cache, slots, p)
        out = torch.empty_like(q)
        runs = {"tqkv": lambda: backend.attention(q, cache, bt, seq_lens, qsl, scale, p),  # noqa: E731
                "tqkv_whole": lambda: backend.attention(q, cache, bt, seq_lens, qsl, scale, p,  # noqa: E731
                                                        key=k, value=v),
                "tqkv_sdpa": lambda: prefill.dense_attention(  # noqa: E731
                    q, cache, bt, [L] * B, starts, scale, p, list(range(B)), out, decode=backend.dense_decode)}
        for impl, fn in runs.items():
            try:
                us, how = _time_us(fn, graph=False)
                _record(records, op="prefill", B=B, L=L, impl=impl, preset=name, us=round(us, 1), timing=how)
            except Exception as exc:  # noqa: BLE001
                _record(records, op="prefill", B=B, L=L, impl=impl, preset=name, error=str(exc)[:300])


def check(presets: list[str], dims: list[int]) -> int:
    """Triton backend vs the reference on this GPU: kv_write bytes, attention and kv_dot, every preset and
    head size, GQA groups 1/3/4, bf16 and fp16, decode and mixed batches, a strided cache view; and for every
    preset and head size a prefill batch (a whole prompt and a continuation chunk beside a decode: the dense
    path, FlashAttention where vLLM brings it), bf16 and fp16 in turn; and for every preset one sequence of 8200
    positions alone (the most splits the launcher picks, past one merge chunk of 64 for k8v4)."""
    import tqkv_compile

    torch.manual_seed(0)
    configs = [(4, torch.bfloat16, [1] * 6, [1, 17, 300, 1000, 2049, 64]),
               (3, torch.float16, [5, 1, 33, 2], [5, 700, 100, 1500], 32),  # (blocks of 32 positions)
               (1, torch.bfloat16, [1, 1], [4000, 9])]
    failures, worst = 0, 0.0
    for i, name in enumerate(presets):
        for j, dim in enumerate(dims):  # (i + j): every head size meets every config and dtype across presets
            p = tqkv_compile.get_preset(name, dim)
            prefill = (4, (torch.bfloat16, torch.float16)[(i + j) % 2], [1, 300, 200], [50, 300, 700])
            alone = [(4, torch.bfloat16, [1], [8200])] if j == 0 else []
            for config in (configs[(i + j) % len(configs)], prefill, *alone):
                ok, rel = _check_case(p, *config)
                failures += not ok
                worst = max(worst, rel)
    print(f"check: {failures} failures, worst attention relative error {worst:.2e}", flush=True)
    return 1 if failures else 0


def _check_case(p, group: int, dtype: torch.dtype, news: list[int], lens: list[int],
                bs: int = 16) -> tuple[bool, float]:
    """One batch of ``check`` (``bs`` positions a block): (passed, attention relative error). Attention reads
    the codec's bytes from a contiguous cache and from the strided view kv_write wrote into."""
    import tqkv_compile

    ref, tri = tqkv_compile.get_backend("reference"), tqkv_compile.get_backend("triton")
    dev, name, dim = "cuda", p.name, p.head_dim
    hk = 2
    B = len(lens)
    M = max(math.ceil(length / bs) for length in lens) + 2
    nb = B * M + 5
    base = torch.zeros(nb, hk, bs, 2 * dim + 6, dtype=torch.uint8, device=dev)
    cache = base.permute(0, 2, 1, 3)[..., : p.slot_bytes]  # a strided view, like vLLM's CPU cache
    cache_ref = torch.zeros(cache.shape, dtype=torch.uint8)  # the codec's bytes, computed on the CPU
    bt = torch.randperm(nb, device=dev)[: B * M].view(B, M).to(torch.int32)
    step_keys, step_values = [], []  # each sequence's last `new` keys and values: the step's
    for b, L in enumerate(lens):
        pos = torch.arange(L, device=dev)
        slots = bt[b, pos // bs].long() * bs + pos % bs
        k = (torch.randn(L, hk, dim, device=dev) * 3).to(dtype)
        v = torch.randn(L, hk, dim, device=dev).to(dtype)
        tri.kv_write(k, v, cache, slots, p)
        ref.kv_write(k.cpu(), v.cpu(), cache_ref, slots.cpu(), p)
        step_keys.append(k[L - news[b] :])
        step_values.append(v[L - news[b] :])
    mism = int((cache.cpu() != cache_ref).sum())
    total = sum(lens) * hk * p.slot_bytes
    cache_ref = cache_ref.to(dev)
    cache.copy_(cache_ref)  # the same bytes in the strided view
    qsl = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(int(qsl[-1]), hk * group, dim, device=dev).to(dtype)
    rels, errs = [], []
    owns = [{}]  # a batch with prompts also given the step's keys and values (whole prompts attend those)
    if q.shape[0] > B:
        owns.append(dict(key=torch.cat(step_keys), value=torch.cat(step_values)))
    for own in owns:
        r = ref.attention(q, cache_ref, bt, sl, qsl, dim**-0.5, p, **own).float()
        for view in (cache_ref, cache):
            o = tri.attention(q, view, bt, sl, qsl, dim**-0.5, p, **own).float()
            rels.append(float((o - r).norm() / r.norm()))
            errs.append(float((o - r).abs().max()))
    rel = math.nan if any(map(math.isnan, rels)) else max(rels)
    err = max(errs)
    # written into a view of a larger buffer (vLLM's output, ops.attention_into): the same answer, nothing past
    buffer = torch.full((q.shape[0] + 2, *q.shape[1:]), 7.0, dtype=q.dtype, device=dev)
    into = tri.attention(q, cache_ref, bt, sl, qsl, dim**-0.5, p, **owns[-1], out=buffer[: q.shape[0]])
    same_into = torch.equal(into, tri.attention(q, cache_ref, bt, sl, qsl, dim**-0.5, p, **owns[-1])) and \
        bool((buffer[q.shape[0]:] == 7.0).all())
    qd = torch.randn(B, hk * group, dim, device=dev)
    kd = tri.kv_dot(qd, cache_ref, bt, sl, dim**-0.5, p)
    kr = ref.kv_dot(qd, cache_ref, bt, sl, dim**-0.5, p)
    fin = torch.isfinite(kr)
    dot_err = float((kd[fin] - kr[fin]).abs().max()) if torch.equal(fin, torch.isfinite(kd)) else math.inf
    ok = mism <= max(2, total // 10000) and rel < 2e-2 and dot_err < 1e-3 and not math.isnan(rel) and same_into
    print(f"{'ok  ' if ok else 'FAIL'} {name:20s} D={dim:3d} G={group} {str(dtype)[6:]:8s} bs={bs} news={news} "
          f"bytes_diff={mism}/{total} attn_max={err:.2e} attn_rel={rel:.2e} kv_dot={dot_err:.2e} "
          f"out={'same' if same_into else 'DIFFERS'}", flush=True)
    return ok, (rel if not math.isnan(rel) else math.inf)


def _meta(argv) -> dict:
    """The run's metadata (:func:`tqkv_compile.run_meta.run_meta`), with this benchmark's shape."""
    from tqkv_compile.run_meta import run_meta

    meta = run_meta("python -m tqkv_compile.tools.bench_kernels " + " ".join(argv),
                    shape=dict(q_heads=HQ, kv_heads=HK, head_dim=D, block_size=BS))
    meta["meta"]["gpu"] = meta["meta"]["device"]  # the key results before 2026-12-06 carried
    return meta


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    series: dict[str, list[tuple[int, float, str]]] = {}
    for r in records:
        if r.get("op") != "decode" or "us" not in r or "variant" in r:
            continue
        label = r["impl"] if r["impl"].startswith("fa3") else f"{r['impl']} {r['preset']}"
        series.setdefault(label, []).append((r["B"] * r["L"], r["GBps"] / 1e3, f"{r['B']}x{r['L']}"))
    for label, pts in sorted(series.items()):
        pts.sort()
        style = "-" if label.startswith("tqkv") else ("--" if label.startswith("fa3") else ":")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("batch x context (tokens in the cache read per step)")
    ax.set_ylabel("achieved bandwidth, TB/s (cache bytes / time)")
    ax.set_title(f"Decode attention, one layer, {HQ}q/{HK}kv heads, head {D}")
    ax.axhline(4.3, color="gray", lw=0.8)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--shapes" in argv:  # the model-shape matrix: its own options (tqkv_compile.tools.bench_shapes)
        from tqkv_compile.tools import bench_shapes

        return bench_shapes.main(argv)
    parser = argparse.ArgumentParser(prog="tqkv bench kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON path for the records")
    parser.add_argument("--plot", type=plot_path, help="PNG path: achieved bandwidth vs context")
    parser.add_argument("--presets", default=",".join(PRESETS),
                        help="comma-separated TurboQuant presets (default %(default)s)")
    parser.add_argument("--cases", default=",".join(f"{b}x{l}" for b, l in CASES),
                        help="comma-separated BATCHxCONTEXT decode cases (default %(default)s)")
    parser.add_argument("--write-tokens", default=",".join(map(str, WRITE_TOKENS)),
                        help="kv_write token counts (default %(default)s)")
    parser.add_argument("--prefill", default="",
                        help="comma-separated BATCHxPROMPT prefill cases (whole prompts; default: none)")
    parser.add_argument("--no-baselines", action="store_true", help="time tqkv only")
    parser.add_argument("--tune", action="store_true", help="time a grid of tqkv decode kernel configurations")
    parser.add_argument("--variants", help="with --tune: a JSON list of decode_attention keyword dicts")
    parser.add_argument("--cache-tokens", type=int, default=0,
                        help="decode cases: caches sized for this many tokens, the case's blocks drawn from all of "
                             "it (an engine's cache; default: exactly the blocks read)")
    parser.add_argument("--warm-l2", action="store_true",
                        help="replay one block table per decode case (the L2 may hold a small case's cache); default: "
                             "cycle through disjoint ones so that no call finds its blocks in L2, as in an engine")
    parser.add_argument("--check", action="store_true",
                        help="every kernel against exact attention over the codec's decode (tqkv_compile.tools.kernel_check; "
                             "every preset, ours too, unless --presets names some) and the Triton backend against the "
                             "reference (kv_write bytes, views, prefill); --out writes the oracle's records; then exit")
    parser.add_argument("--dims", default="64,128,256", help="head sizes for --check (default %(default)s)")
    parser.add_argument("--workers", type=int, default=8, help="--check: processes at a time (default %(default)s)")
    parser.add_argument("--oracle-only", action="store_true", help="--check: the oracle's matrix alone")
    parser.add_argument("--shapes", action="store_true",
                        help="decode over a matrix of model shapes and batches instead (tqkv_compile.tools.bench_shapes; "
                             "its options: --shapes --help)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    presets = [p for p in args.presets.split(",") if p]
    if args.check:
        return _check_all(argv, args, presets)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    vllm = None if args.no_baselines or args.tune else _vllm()
    records: list[dict] = [_meta(argv)]
    for B, L in cases:
        _decode_case(records, B, L, presets, vllm, args.tune,
                     json.loads(args.variants) if args.variants else None, cache_tokens=args.cache_tokens,
                     cold_l2=not args.warm_l2)
    for c in (c for c in args.prefill.split(",") if c):
        B, L = (int(x) for x in c.split("x"))
        _prefill_case(records, B, L, presets, vllm)
    if not args.tune:
        for T in (int(t) for t in args.write_tokens.split(",") if t):
            _write_case(records, T, presets, vllm)
    _summary(records)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    if args.plot:
        plot(records, args.plot)
    return 0


def _check_all(argv, args, presets: list[str]) -> int:
    """``--check``: the oracle's matrix (written to ``--out`` with the run's meta), then the comparisons with the
    reference backend; 1 where anything failed."""
    from tqkv_compile import codec
    from tqkv_compile.tools import kernel_check

    dims = [int(d) for d in args.dims.split(",")]
    named = any(a.startswith("--presets") for a in argv)
    everyone = presets if named else codec.preset_names() + codec.own_preset_names()
    meta = _meta(argv)

    def save(records: list[dict]) -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps([meta, *records], indent=1) + "\n")

    records = kernel_check.check_matrix(everyone, dims, workers=args.workers, on_pair=save)
    failing = [r for r in records if not r.get("ok")]
    worst = max((r["l2_rel"] for r in records if "l2_rel" in r), default=math.nan)
    print(f"oracle check: {len(records)} records, {len(failing)} failing, worst l2_rel {worst:.2e}", flush=True)
    if args.oracle_only:
        return 1 if failing else 0
    reference = check([p for p in everyone if codec.get_preset(p, dims[0]).vllm_layout], dims)
    return 1 if failing or reference else 0


def _summary(records: list[dict]) -> None:
    """Print a table: us per case, and tqkv's speed-up over FA3 bf16 and vLLM TurboQuant."""
    by = {(r["op"], r["B"], r["L"], r["impl"], r["preset"]): r["us"] for r in records
          if "us" in r and "variant" not in r}
    print("\nop       case        impl      preset               us      xFA3bf16  xvLLM-TQ")
    for (op, B, L, impl, preset), us in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] * max(kv[0][2], 1),
                                                                             kv[0][3:])):
        fa = by.get((op, B, L, "fa3_bf16", "bf16"))
        vt = by.get((op, B, L, "vllm_tq", preset)) or by.get((op, B, L, "vllm_tq", "raw_kv"))  # prefill: any preset
        x_fa = f"{fa / us:8.2f}" if fa and impl == "tqkv" else " " * 8
        x_vt = f"{vt / us:8.2f}" if vt and impl == "tqkv" else " " * 8
        case = f"{B} tokens" if op == "kv_write" else f"{B}x{L}"
        print(f"{op:8s} {case:>11s} {impl:9s} {preset:18s} {us:9.1f}  {x_fa}  {x_vt}")


if __name__ == "__main__":
    raise SystemExit(main())
