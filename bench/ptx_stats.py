"""Compile tqkv's decode kernels for sm_90a on a machine without a GPU and print what ptxas and the PTX say:
registers, spill bytes, shared memory, and counts of the instructions that matter (shared-memory traffic,
shuffles, selects, mma, global loads). Cheap checks before spending device time.

    python bench/ptx_stats.py                       # the stream kernel's defaults for 4bit_nc and k8v4
    python bench/ptx_stats.py --preset turboquant_4bit_nc --block-n 32 --warps 4 --maxnreg 128 --prefetch
    python bench/ptx_stats.py --kernel fragments --preset tqkv_4bit_pc     # gluon_decode's kernel

Needs Triton's bundled ptxas (any Triton wheel with the NVIDIA backend); the PTX version line is lowered to
what that ptxas accepts (8.7: triton 3.6's ptxas is CUDA 12.8's).

Compile with the Triton the H200 runs (3.6.0; this machine's venv has 3.9, whose code differs: 3.9 puts the
stream kernel's dots on wgmma, 3.6 on mma.sync, and 3.6 stored the 3-bit presets' tiles to shared memory 16
bits at a time where 3.9 did not): a venv holding only that Triton borrows torch from the project's venv,
and ``--tree`` compiles another checkout's kernels (a worktree of another commit) for an A/B:

    python3.11 -m venv /tmp/triton36 && /tmp/triton36/bin/pip install triton==3.6.0
    /tmp/triton36/bin/python bench/ptx_stats.py --site .venv/lib/python3.11/site-packages \
        [--tree /tmp/other-worktree] --preset turboquant_3bit_nc --histogram
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import math
import os
import re
import site
import subprocess
import sys
import tempfile


def _paths_before_imports(argv: list[str]) -> None:
    """--site DIR: a site-packages read after the interpreter's own (its .pth files too: the project's
    editable install), e.g. torch for a venv that holds only the H200's Triton. --tree DIR: tqkv_compile, its
    lowerings and passes imported from that checkout."""
    def value(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv[:-1] else None

    if (extra := value("--site")) is not None:
        site.addsitedir(os.path.abspath(extra))
    if (tree := value("--tree")) is not None:
        tree = os.path.abspath(tree)
        roots = {"tqkv_compile": f"{tree}/tqkv_compile", "tqkv_compile.lowerings": f"{tree}/lowerings",
                 "tqkv_compile.passes": f"{tree}/passes"}

        class TreeFinder:
            @staticmethod
            def find_spec(name, path=None, target=None):
                root = roots.get(name)
                return root and importlib.util.spec_from_file_location(name, f"{root}/__init__.py",
                                                                        submodule_search_locations=[root])

        sys.meta_path.insert(0, TreeFinder)


_paths_before_imports(sys.argv)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import tqkv_compile  # noqa: E402
import tqkv_compile.lowerings  # noqa: E402

# the stream kernel's module (older trees: triton_attention), judged by the file: under --tree the editable
# install still finds this checkout's decode_stream.py for a tree that has none
if os.path.exists(os.path.join(os.path.dirname(tqkv_compile.lowerings.__file__), "decode_stream.py")):
    from tqkv_compile.lowerings import decode_stream as ds  # noqa: E402
else:
    from tqkv_compile.lowerings import triton_attention as ds  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
CUOBJDUMP = os.path.join(os.path.dirname(PTXAS), "cuobjdump")
OPS = ("st.shared", "ld.shared", "shfl", "mma", "cp.async", "ld.global", "selp", "ldmatrix", "bar.sync", "cvt", "prmt",
       "griddepcontrol")


PTX_OUT = None  # --ptx FILE: every compiled kernel's PTX appended there


def stats(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, maxnreg: int | None,
          source=ASTSource) -> dict:
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    kernel = triton.compile(source(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    if PTX_OUT:
        with open(PTX_OUT, "a") as f:
            f.write(ptx)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 8.7", ptx, count=1))
        out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True).stderr
        sass = subprocess.run([CUOBJDUMP, "-sass", os.path.join(tmp, "k.cubin")], capture_output=True,
                              text=True).stdout
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    counts = collections.Counter()
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@%p\d+\s+)?([a-z][\w.]*)", line)
        if m:
            counts.update(op for op in OPS if m.group(1).startswith(op))
    return dict(registers=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None,
                shared=kernel.metadata.shared, **loop_sass(sass), **counts)


def loop_sass(sass: str) -> dict:
    """The SASS of the longest loop (a backward branch's span: the tile loop): its instruction count without
    NOPs (``loop_sass``), its five commonest opcodes (``loop_top``) and the number of backward branches (1
    for the decode kernels today; with more, the longest span need not be the tile loop). What one tile costs
    in issue slots per thread, a static proxy for an issue-bound kernel (divide by the tile's positions for a
    per-token cost)."""
    rows = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*);", line)
        if m:
            rows.append((int(m.group(1), 16), m.group(2), m.group(3)))
    backward = []
    for address, op, rest in rows:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            backward.append((int(target.group(1), 16), address))
    if not backward:
        return dict(loop_sass=None, loop_top=None, backward_branches=0, loop_opcodes=collections.Counter(),
                    loop_text="")
    best = max(backward, key=lambda span: span[1] - span[0])
    body = [op for address, op, _ in rows if best[0] <= address <= best[1] and not op.startswith("NOP")]
    text = "\n".join(f"{address:05x} {op}{rest}" for address, op, rest in rows
                     if best[0] <= address <= best[1] and not op.startswith("NOP"))
    top = collections.Counter(op.split(".")[0] for op in body).most_common(5)
    return dict(loop_sass=len(body), loop_top=",".join(f"{op}:{n}" for op, n in top),
                backward_branches=len(backward), loop_opcodes=collections.Counter(body), loop_text=text)


def stream_kernel(preset_name: str, dim: int, block_n: int, warps: int, maxnreg: int | None, prefetch: bool,
                  index32: bool = True, query_in_kernel: bool | None = None, merge: bool = False,
                  splits: int = 2, pdl: bool = False, block_h: int = 8, length_aware: bool = False) -> dict:
    p = tqkv_compile.get_preset(preset_name, dim)
    key_word, value_word = (4 if p.key_fp8 else 2), 2  # the GPU's asm path (stream_words)
    constexprs = dict(GROUP=4, BLOCK_H=16, D=dim, BLOCK_SIZE=16, BLOCK_N=block_n, NUM_SPLITS=splits, SEARCH_STEPS=7,
                      KEY_FP8=p.key_fp8, KEY_CODE_BYTES=p.key_code_bytes, NORM_CORRECTION=p.norm_correction,
                      VALUE_OFFSET=p.key_bytes, VALUE_CODE_BYTES=p.value_code_bytes, DOT_FP32=False,
                      KEY_WORD=key_word, VALUE_WORD=value_word, PREFETCH=prefetch, ASM=True,
                      **({'INDEX32': index32} if 'INDEX32' in ds._decode_stream_kernel.arg_names else {}))
    if query_in_kernel is None:  # the launcher's default for a bf16 query on the GPU (older trees: none)
        rule = getattr(ds, "query_in_stream_kernel", None)
        query_in_kernel = bool(rule and rule(p, torch.bfloat16, interpret=False))
    query_in_kernel = query_in_kernel and "QUERY_IN_KERNEL" in ds._decode_stream_kernel.arg_names  # (older trees)
    if "QUERY_IN_KERNEL" in ds._decode_stream_kernel.arg_names:  # a bf16 query prepared in the kernel
        scale = 0.125 * ds.LOG2E / (1.0 if p.key_fp8 else dim ** 0.5)
        pre = 2.0 ** math.floor(math.log2(scale))
        constexprs.update(QUERY_IN_KERNEL=query_in_kernel, ROTATE_QUERY=not p.key_fp8, Q_PRE=pre,
                          Q_POST=scale / pre)
    if "MERGE" in ds._decode_stream_kernel.arg_names:
        constexprs.update(MERGE=merge)
    elif merge:
        print("--merge: this tree's kernel has no in-launch merge (removed after bd688d7); ignored", file=sys.stderr)
    if "KEY_BITS" in ds._decode_stream_kernel.arg_names:  # (trees before the 3-bit fields)
        constexprs.update(KEY_BITS=p.key_bits, VALUE_BITS=p.value_bits)
    if "GDC" in ds._decode_stream_kernel.arg_names:
        constexprs.update(GDC=pdl)
    if "ROWS" in ds._decode_stream_kernel.arg_names:  # one row a program, splits fixed by the launch (the defaults)
        constexprs.update(ROWS=1, LENGTH_AWARE=length_aware)
    if "NC_DOT" in ds._decode_stream_kernel.arg_names:  # trees up to 07a1e9e: the query group as the dots' M side
        constexprs.update(NC_DOT=True)
    else:  # the dots turned around: the query group is their N side, padded to 8
        constexprs.update(BLOCK_H=block_h)
    pointers = dict(q_ptr="*bf16" if query_in_kernel else "*fp32", signs_ptr="*fp16", out_ptr="*bf16", count_ptr="*i32", cache_ptr="*u8", block_table_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32",
                    cent_ptr="*fp32", key_lut_ptr="*i32", value_lut_ptr="*i32", part_out_ptr="*fp32",
                    part_lse_ptr="*fp32")  # (value_lut_ptr: older commits' kernels)
    fn = ds._decode_stream_kernel
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    return stats(fn, signature, constexprs, warps, 1, maxnreg)


def fragment_kernel(preset_name: str, dim: int, maxnreg: int | None, prefetch: int = 0, stage: int = 0,
                    key_table: int = 0, splits: int = 2, length_aware: bool = False) -> dict:
    """gluon_decode's fragment kernel (4-bit keys and values; heads 128 and 256) at the launcher's settings."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from tqkv_compile.lowerings import gluon_decode as g

    p = tqkv_compile.get_preset(preset_name, dim)
    constexprs = dict(GROUP=4, D=dim, BLOCK_SIZE=16, NUM_SPLITS=splits, SEARCH_STEPS=7, KEY_FP8=p.key_fp8,
                      NORM_CORRECTION=p.norm_correction, KEY_CODE_BYTES=p.key_code_bytes, VALUE_OFFSET=p.key_bytes,
                      VALUE_CODE_BYTES=p.value_code_bytes,
                      **{k: v for k, v in g.layouts(dim).items() if k in g.fragment_kernel.arg_names})
    if "PREFETCH" in g.fragment_kernel.arg_names:  # (trees from 2026-12-05 on)
        constexprs.update(PREFETCH=prefetch)
    elif prefetch:
        raise SystemExit("this tree's fragment kernel has no PREFETCH")
    if "STAGE" in g.fragment_kernel.arg_names:
        constexprs.update(STAGE=stage)
    if stage == 3 and "RING_WORDS" not in g.fragment_kernel.arg_names:
        raise SystemExit("this tree's fragment kernel has no STAGE 3 (deleted after 54f6150: --tree a worktree of it)")
    if "H_POS" in g.fragment_kernel.arg_names:  # (the launcher's: a position's stride in 2-byte units, 8 kv heads)
        constexprs.update(H_POS=8 * p.slot_bytes // 2 if stage else 0)
    if "KEY_BITS" in g.fragment_kernel.arg_names:
        constexprs.update(KEY_BITS=0 if p.key_fp8 else p.key_bits, VALUE_BITS=p.value_bits)
    elif stage:
        raise SystemExit("this tree's fragment kernel has no STAGE")
    if "KEY_TABLE" in g.fragment_kernel.arg_names:  # (trees from 2026-12-05 evening on)
        constexprs.update(KEY_TABLE=key_table if g.has_key_table(p) else 0)
    elif key_table:
        raise SystemExit("this tree's fragment kernel has no KEY_TABLE")
    if "LENGTH_AWARE" in g.fragment_kernel.arg_names:
        constexprs.update(LENGTH_AWARE=length_aware)
    elif length_aware:
        raise SystemExit("this tree's fragment kernel has no LENGTH_AWARE")
    pointers = dict(q_ptr="*fp32", cache_ptr="*u8", block_table_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32",
                    lut_ptr="*i32", key_order_ptr="*i32", value_order_ptr="*i32", part_out_ptr="*fp32",
                    part_lse_ptr="*fp32")
    fn = g.fragment_kernel
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    regs = maxnreg or (g.maxnreg(dim, prefetch) if prefetch else g.maxnreg(dim))
    return stats(fn, signature, constexprs, g.NUM_WARPS, 1, regs, source=GluonASTSource)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append", help="repeatable; default: 4bit_nc and k8v4 at their defaults")
    parser.add_argument("--kernel", choices=("stream", "fragments"), default="stream",
                        help="fragments: gluon_decode's kernel (4-bit presets, heads 128 / 256; the launcher's settings: "
                             "--block-n, --warps, --prefetch and the query options do not apply)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--maxnreg", type=int, default=None, help="default: the launcher's (128; 168 above head 128)")
    parser.add_argument("--prefetch", action="store_true")
    parser.add_argument("--fragment-prefetch", type=int, choices=(0, 1, 2), default=0,
                        help="the fragment kernel's PREFETCH (1: block ids a tile ahead; 2: and the words)")
    parser.add_argument("--merge", action="store_true",
                        help="the splits merged in the launch (trees up to bd688d7, whose kernel had it)")
    parser.add_argument("--pdl", action="store_true", help="the dependent-launch waits in (TQKV_PDL=1)")
    parser.add_argument("--splits", type=int, default=2, help="NUM_SPLITS")
    parser.add_argument("--length-aware", action="store_true", help="LENGTH_AWARE: each row's split count from "
                        "the batch's lengths")
    parser.add_argument("--block-h", type=int, default=8,
                        help="the query group's padded width, the dots' N side (the launcher's: 8 for groups up to 8; "
                             "triton 3.6 compiles N = 8 to mma.sync, 16 and up to wgmma)")
    parser.add_argument("--histogram", action="store_true", help="every opcode of the tile loop's SASS, counted")
    parser.add_argument("--sass", help="append the tile loop's SASS to this file")
    parser.add_argument("--ptx", help="append the whole kernel's PTX to this file")
    parser.add_argument("--fragment-key-table", type=int, choices=(0, 8, 32), default=0,
                        help="the fragment kernel's KEY_TABLE (4-bit keys from a table of pairs in shared memory, "
                             "that many copies; 0: byte permutes)")
    parser.add_argument("--fragment-stage", type=int, choices=(0, 1, 2, 3), default=0,
                        help="the fragment kernel's STAGE (1 / 2: words loaded a position a warp, moved through "
                             "shared memory as 16- / 32-bit words; 3: a ring of cp.async copies, 4-bit presets, in "
                             "trees up to 54f6150: --tree)")
    parser.add_argument("--site", help="a site-packages read after this interpreter's own (see the module doc)")
    parser.add_argument("--tree", help="compile this checkout's kernels (see the module doc)")
    parser.add_argument("--query-in-kernel", choices=("auto", "yes", "no"), default="auto",
                        help="the query prepared in the kernel (bf16) or by prepare_query's launch (fp32); "
                             "auto: as the launcher (in the kernel for fp8 keys)")
    args = parser.parse_args()
    global PTX_OUT
    PTX_OUT = args.ptx
    for name in args.preset or ["turboquant_4bit_nc", "turboquant_k8v4"]:
        maxnreg = args.maxnreg or (128 if args.head_dim <= 128 else 168)
        if args.kernel == "fragments":
            result = fragment_kernel(name, args.head_dim, args.maxnreg, args.fragment_prefetch, args.fragment_stage,
                                     args.fragment_key_table, args.splits, args.length_aware)
            label = (f"{name} D{args.head_dim} fragment kernel prefetch {args.fragment_prefetch} "
                     f"stage {args.fragment_stage} key table {args.fragment_key_table} "
                     f"triton {triton.__version__}")
        else:
            result = stream_kernel(name, args.head_dim, args.block_n, args.warps, maxnreg, args.prefetch,
                                   query_in_kernel={"auto": None, "yes": True, "no": False}[args.query_in_kernel],
                                   merge=args.merge, splits=args.splits, pdl=args.pdl, block_h=args.block_h,
                                   length_aware=args.length_aware)
            label = (f"{name} D{args.head_dim} BLOCK_N {args.block_n} warps {args.warps} maxnreg {maxnreg} "
                     f"prefetch {args.prefetch} triton {triton.__version__}")
        opcodes, text = result.pop("loop_opcodes"), result.pop("loop_text")
        if args.sass:
            with open(args.sass, "a") as f:
                f.write(f"# {name} D{args.head_dim} {args.kernel}\n{text}\n")
        print(f"{label}: " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
        if args.histogram:
            print("  loop: " + " ".join(f"{op}:{n}" for op, n in opcodes.most_common()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
