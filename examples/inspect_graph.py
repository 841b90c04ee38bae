"""Print vLLM's attention blocks before and after the tqkv pass (same as `tqkv inspect`).

    python examples/inspect_graph.py [--model DIR] [--kv-cache-dtype turboquant_3bit_nc] [--full]
"""

import sys

from tqkv_compile.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["inspect", *sys.argv[1:]]))
