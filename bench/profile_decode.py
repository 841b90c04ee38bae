"""One decode-attention case, launched a few times, for a profiler to catch (``bench/h200_session.sh profile``
runs it under Nsight Compute). Llama-3-8B's attention shape (32 query heads, 8 kv heads, head 128, blocks of
16), random cache bytes and a random block table, as ``tqkv bench kernels``.

    python bench/profile_decode.py --preset turboquant_4bit_nc --case 64x32768 --variant '{"kernel": "fragments"}'
    ncu --kernel-name regex:fragment_kernel --launch-skip 2 --launch-count 1 --set full \\
        python bench/profile_decode.py ...

It prints each call's time (CUDA events; under a profiler they mean nothing) and the kernel names launched.
"""

from __future__ import annotations

import argparse
import json

import torch

HQ, HK, D, BS = 32, 8, 128, 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="turboquant_4bit_nc")
    parser.add_argument("--case", default="64x32768", help="batch x context")
    parser.add_argument("--variant", default="{}", help="decode_attention keywords as JSON (kernel, prefetch, ...)")
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode needs a CUDA GPU")
    import tqkv_compile
    from tqkv_compile.lowerings.triton_attention import decode_attention

    batch, length = (int(x) for x in args.case.lower().split("x"))
    variant = json.loads(args.variant)
    preset = tqkv_compile.get_preset(args.preset, D)
    dev = torch.device("cuda")
    blocks = batch * length // BS
    cache = torch.randint(0, 100, (blocks, BS, HK, preset.slot_bytes), dtype=torch.uint8, device=dev)
    table = torch.randperm(blocks, device=dev).to(torch.int32).view(batch, length // BS)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=dev)
    rotation, centroids, _ = tqkv_compile.get_backend("triton").tables(preset, dev)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for call in range(args.calls):
        start.record()
        decode_attention(q, cache, table, seq_lens, qsl, D**-0.5, preset, rotation, centroids, **variant)
        stop.record()
        torch.cuda.synchronize()
        print(f"{args.preset} {args.case} {variant} call {call}: {start.elapsed_time(stop) * 1e3:.1f} us "
              f"({batch * length * HK * preset.slot_bytes / 1e9:.2f} GB of cache)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
