"""The ``tqkv`` command: ``demo``, ``inspect``, ``quality``, ``bench kernels``, ``bench e2e``, ``doctor``,
``warm-fa2``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tqkv", description="TurboQuant KV cache for vLLM, through torch.compile")
    commands = parser.add_subparsers(dest="command", required=True)

    from tqkv_compile.tools import demo

    demo.add_arguments(commands.add_parser("demo", help="vLLM on the CPU with a TurboQuant cache served by tqkv"))
    inspect = commands.add_parser("inspect", help="print the attention graph before and after the tqkv pass")
    demo.add_model_arguments(inspect)
    inspect.add_argument("--full", action="store_true", help="print the whole graphs, not the attention blocks")

    from tqkv_compile.tools import quality

    quality.add_arguments(commands.add_parser(
        "quality", help="perplexity of SmolLM2-135M on Jane Austen with K/V read through each preset"))
    bench = commands.add_parser("bench", help="benchmarks: the kernels (GPU), the engine end to end (GPU; CPU too)")
    bench_kinds = bench.add_subparsers(dest="kind", required=True, metavar="{kernels,e2e}")
    bench_kinds.add_parser("kernels", help="per-layer kernel timings against FA3 and vLLM's TurboQuant", add_help=False)
    bench_kinds.add_parser("e2e", help="the vLLM engine's decode tokens/s per cache configuration", add_help=False)

    commands.add_parser("doctor", add_help=False,
                        help="what this environment has, whether tqkv serves it, and what to do where it does not")
    commands.add_parser("warm-fa2", add_help=False,
                        help="compile vLLM's FlashAttention-2 for this GPU ahead of the first TurboQuant engine")

    args, rest = parser.parse_known_args(argv)
    if args.command == "doctor":
        from tqkv_compile.tools import doctor

        return doctor.main(rest)
    if args.command == "warm-fa2":
        from tqkv_compile.vllm import fa2_warm

        return fa2_warm.main(rest)
    if args.command == "demo":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return demo.run(args)
    if args.command == "quality":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return quality.run(args)
    if args.command == "inspect":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return demo.inspect(args)
    if args.kind == "e2e":
        from tqkv_compile.tools import bench_e2e

        return bench_e2e.main(rest)
    from tqkv_compile.tools import bench_kernels

    return bench_kernels.main(rest)


if __name__ == "__main__":
    sys.exit(main())
