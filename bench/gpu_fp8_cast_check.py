"""On a CUDA GPU: does the hardware fp32 -> fp8 e4m3 cast that vLLM's k8v4 store kernel uses
(`x.to(tl.float8e4nv)`) give the same bytes as the codec's (torch's round-to-nearest-even, saturated)?

    python bench/gpu_fp8_cast_check.py      (prints one JSON line)
"""

import json

import torch
import triton
import triton.language as tl

from tqkv_compile import get_preset


@triton.jit
def _cast(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    # bf16 keys as vLLM stores them, plus every fp8 midpoint and values past the saturation point
    keys = (torch.randn(1 << 20, generator=g) * 3).to(torch.bfloat16).float()
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = grid[torch.isfinite(grid)].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    special = torch.tensor([447.0, 448.0, 449.0, 464.0, 500.0, 1e4, -1e4, 0.0, -0.0])
    x = torch.cat([keys, mids, special])
    x = torch.cat([x, torch.zeros(-x.numel() % 128)])  # whole 128-wide keys
    out = torch.empty(x.numel(), dtype=torch.uint8, device="cuda")
    xc = x.cuda()
    _cast[(triton.cdiv(x.numel(), 1024),)](xc, out, x.numel(), BLOCK=1024)
    hw = out.cpu()
    key = x.view(-1, 1, 128)
    ours = get_preset("turboquant_k8v4", 128).encode(key, torch.zeros_like(key))[:, 0, :128].reshape(-1)
    diff = (hw != ours)
    print(json.dumps({"values": x.numel(), "differ": int(diff.sum()),
                      "examples": [(float(v), int(a), int(b)) for v, a, b in zip(x[diff][:5], hw[diff][:5], ours[diff][:5])],
                      "gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
