"""Launch choices swept over cells of the shape matrix: the data the launcher's heuristics are fitted to.

For each (shape, case) of :mod:`tqkv_compile.tools.bench_shapes` (``--cells all``: every one) and each preset: the
default launch, the same launch with every row cut into the shapes' split count (kernel ``fixed``:
``length_aware=False``) and with each row's count from the batch's lengths in a widened grid (``aware``), then the stream and fragment kernels at each
split count of ``--splits`` (counts that give more than ``--max-programs`` programs an SM, or fewer tiles than
splits, are skipped; ``--kernels ""``: none). Timed as ``tqkv bench kernels --shapes`` times (CUDA-graph replay,
cold L2). One JSON line a launch, and the list in ``--out`` (rewritten after every cell): ``{"shape", "case",
"preset", "kernel", "splits", "rows_per_program", "us"}`` (kernels ``default``, ``fixed``, ``aware`` with splits null:
the launcher's own choice). ``--variants '{"NAME": {decode_attention keywords}}'``: more named launches
(kernel NAME), e.g. a register cap; a variant's ``"ragged_splits": N`` sets
``launch_choices.RAGGED_SPLITS`` (the length-aware grid's least splits) for its launch.

    python bench/launch_sweep.py --cells llama3-70b-tp8:1x131072,llama3-8b:32x16384x4rows --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> int:
    import tqkv_compile
    from tqkv_compile.tools.bench_kernels import _time_per_table, rotations
    from tqkv_compile.tools.bench_shapes import BLOCK_SIZE, CASES, SHAPES, _paged
    from tqkv_compile.lowerings import gluon_decode, launch_choices
    from tqkv_compile.lowerings.triton_attention import decode_attention
    from tqkv_compile.run_meta import run_meta

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", required=True, help="comma-separated shape:case pairs, or all")
    parser.add_argument("--presets", default="turboquant_4bit_nc")
    parser.add_argument("--splits", default="1,2,4,8,16,32,48,64,96,128")
    parser.add_argument("--kernels", default="stream,fragments")
    parser.add_argument("--rows", default="1", help="the stream kernel's rows_per_program values (%(default)s)")
    parser.add_argument("--max-programs", type=int, default=16, help="programs an SM at most (%(default)s)")
    parser.add_argument("--out")
    parser.add_argument("--variants", default="{}", help="JSON: launch name -> decode_attention keywords")
    args = parser.parse_args(argv)
    variants = json.loads(args.variants)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    records: list[dict] = [run_meta("python bench/launch_sweep.py " + " ".join(argv))]
    backend = tqkv_compile.get_backend("triton")
    cells = ([[shape, case] for shape in SHAPES for case in CASES] if args.cells == "all" else
             [c.split(":") for c in args.cells.split(",") if c])
    for n, (shape, case_name) in enumerate(cells, 1):
        hq, hk, dim = SHAPES[shape]
        case = CASES[case_name]
        print(f"[sweep {n}/{len(cells)}] {shape} {case_name}", file=sys.stderr, flush=True)
        rows = case.batch * case.rows
        for name in args.presets.split(","):
            p = tqkv_compile.get_preset(name, dim)
            tables, num_blocks = _paged(case, rotations(sum(case.lens) * hk * p.slot_bytes, l2), "cuda")
            cache = torch.randint(0, 100, (num_blocks, BLOCK_SIZE, hk, p.slot_bytes), dtype=torch.uint8,
                                  device="cuda")
            seq_lens = torch.tensor(case.lens, dtype=torch.int32, device="cuda")
            qsl = torch.arange(0, rows + 1, case.rows, dtype=torch.int32, device="cuda")
            q = torch.randn(rows, hq, dim, dtype=torch.bfloat16, device="cuda")
            rotation, centroids, _ = backend.tables(p, q.device)
            tiles = math.ceil(max(case.lens) / 64)
            launches = [("default", None, None), ("fixed", None, None), ("aware", None, None)] + \
                [(v, None, None) for v in variants]
            for kernel in filter(None, args.kernels.split(",")):
                if kernel == "fragments" and gluon_decode.supports(p, cache, hq // hk, q.device) is not None:
                    continue
                for packed in map(int, args.rows.split(",")) if kernel == "stream" else [1]:
                    if packed > 1 and case.rows == 1:
                        continue
                    launches += [(kernel, s, packed) for s in map(int, args.splits.split(","))
                                 if s <= tiles and math.ceil(rows / packed) * hk * s <= args.max_programs * sms]
            for kernel, splits, packed in launches:
                kw = {"default": {}, "fixed": dict(length_aware=False), "aware": dict(length_aware=True),
                      **variants}.get(
                    kernel, dict(kernel=kernel, splits=splits, rows_per_program=packed))
                rec = dict(shape=shape, case=case_name, preset=name, kernel=kernel, splits=splits,
                           rows_per_program=packed)
                kw = dict(kw)
                grid_floor = kw.pop("ragged_splits", launch_choices.RAGGED_SPLITS)
                saved, launch_choices.RAGGED_SPLITS = launch_choices.RAGGED_SPLITS, grid_floor
                try:
                    us, _ = _time_per_table(lambda bt: decode_attention(q, cache, bt, seq_lens, qsl, dim**-0.5, p,
                                                                        rotation, centroids, **kw), tables)
                    rec["us"] = round(us, 1)
                except Exception as exc:  # noqa: BLE001
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                finally:
                    launch_choices.RAGGED_SPLITS = saved
                records.append(rec)
                print(json.dumps(rec), flush=True)
            del cache
            torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
