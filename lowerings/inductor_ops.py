"""``tqkv::triton_kv_write`` and ``tqkv::triton_attention``: the Triton kernels as ``torch.library.triton_op``s,
so that Inductor launches them from its generated code.

Why ``triton_op`` and not an Inductor template: a template pays where Inductor can choose among configs
*and* fuse into the kernel's prologue / epilogue (matmul-like ops). Our decode kernel's configuration is a
function of preset and shape chosen by measurement (``default_kernel`` and the defaults in
``decode_attention``, from the H200 sweeps), its input is a packed byte cache no Inductor node produces, and
its output feeds the o_proj matmul, which does not fuse into it; the split-KV merge is a second kernel either
way. What Inductor can do with a ``triton_op`` is what matters here: it traces the launcher (``decode_attention``
with ``torch.library.wrap_triton``) into the graph, so the scratch allocations and the kernel launches (decode
and merge; a query preparation launch before them for fp32 queries) appear in the generated code as ordinary nodes and user-defined Triton kernels (no
call back into Python), and they are captured by CUDA graphs with the rest. The tables (rotation, its signs, centroids, lookup
tables) are op inputs so that the traced graph holds no Python-side caches.

Off CUDA the ops are ``tqkv::kv_write`` / ``tqkv::attention`` themselves (checked, the CPU's backend): Inductor
has no Triton code generation for the CPU, and the interpreter is for tests. The decomposition happens while
tracing, so a compiled CPU graph calls the checked op, a compiled CUDA graph launches the kernels.

The ``tqkv::kv_write`` / ``tqkv::attention`` ops stay the user-facing contract (they check their input and pick a
backend). These two are what a compiled graph can hold when the cache and the attention metadata are graph
values, as in a plain PyTorch model (``examples/inductor_lowering.py``). In vLLM's graph they are not: the
layer's cache and metadata are found at run time by layer name (see ``tqkv_compile.vllm.wrapper_ops``), so the
vLLM integration keeps calling the backend from its wrapper op.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

import tqkv_compile.ops  # noqa: F401  (defines tqkv::kv_write / tqkv::attention)
from tqkv_compile.backends import get_backend
from tqkv_compile.codec import get_preset


def tables(preset_name: str, head_dim: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The op inputs that carry a preset's tables on device: rotation, centroids, midpoints, the stream
    kernel's key lookup table and rotation signs (kept by the Triton backend, built once)."""
    from tqkv_compile.lowerings.cache_tables import key_lut
    from tqkv_compile.lowerings.decode_stream import rotation_signs

    preset = get_preset(preset_name, head_dim)
    rotation, centroids, midpoints = get_backend("triton").tables(preset, torch.device(device))
    return dict(rotation=rotation, centroids=centroids, midpoints=midpoints,
                key_lut=key_lut(preset, torch.device(device)), signs=rotation_signs(head_dim, torch.device(device)))


@triton_op("tqkv::triton_kv_write", mutates_args=("kv_cache",))
def triton_kv_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    rotation: torch.Tensor, midpoints: torch.Tensor, centroids: torch.Tensor, preset: str) -> None:
    """As ``tqkv::kv_write``, through the Triton kernel on CUDA (no input checks there); elsewhere it is
    ``tqkv::kv_write`` itself (checked, the CPU's backend)."""
    if kv_cache.device.type != "cuda":
        torch.ops.tqkv.kv_write(key, value, kv_cache, slot_mapping, preset)
        return
    from tqkv_compile.lowerings.triton_kv_write import kv_write

    kv_write(key, value, kv_cache, slot_mapping, get_preset(preset, key.shape[-1]), rotation, midpoints,
             launch=wrap_triton, centroids=centroids)


@triton_op("tqkv::triton_attention", mutates_args=())
def triton_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, rotation: torch.Tensor, centroids: torch.Tensor,
                     key_lut: torch.Tensor, signs: torch.Tensor, scale: float, preset: str) -> torch.Tensor:
    """As ``tqkv::attention``, through the Triton decode kernels on CUDA (no input checks there); elsewhere it
    is ``tqkv::attention`` itself."""
    if query.device.type != "cuda":
        return torch.ops.tqkv.attention(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset)
    from tqkv_compile.lowerings.triton_attention import decode_attention

    return decode_attention(query, kv_cache, block_table, seq_lens, query_start_loc, scale,
                            get_preset(preset, query.shape[-1]), rotation, centroids, lut=key_lut,
                            signs=signs, launch=wrap_triton)
