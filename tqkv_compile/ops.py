"""The ``tqkv`` custom ops (torch.library): ``kv_write``, ``attention``, ``kv_dot``.

Names, argument order and meaning are a fixed contract (docs in README.md); every op checks its input,
raising ValueError / TypeError that names the argument before anything is written, then dispatches to the
selected memory backend (see :mod:`tqkv_compile.backends`), beside the reference when validate mode is on.

Checks that read tensor values (slot and block ranges, sequence lengths) need a host sync: they run on
CPU tensors always, on CUDA tensors outside CUDA-graph capture, and never when ``TQKV_CHECK_VALUES=0``.
"""

from __future__ import annotations


import torch

from tqkv_compile import backends, env
from tqkv_compile.codec import INPUT_DTYPES, Preset, get_preset

_INDEX_DTYPES = (torch.int32, torch.int64)


def _value_checks_enabled(t: torch.Tensor) -> bool:
    if env.get("TQKV_CHECK_VALUES", "1") == "0":
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _check_index(name: str, t: torch.Tensor, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name}: expected int32 (or int64), got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dimension(s), got shape {tuple(t.shape)}")


def _check_cache(kv_cache: torch.Tensor, preset_name: str, head_dim: int) -> Preset:
    preset = get_preset(preset_name, head_dim)
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[3] != preset.slot_bytes:
        raise ValueError(
            f"kv_cache: expected uint8 [num_blocks, block_size, num_kv_heads, {preset.slot_bytes}] for "
            f"{preset_name} at head_dim {head_dim}, got {kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    if any(stride == 0 and size > 1 for stride, size in zip(kv_cache.stride(), kv_cache.shape)):
        raise ValueError(f"kv_cache: an expanded view (stride 0, strides {kv_cache.stride()}): slots would alias")
    return preset


def _check_devices(kv_cache: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Every tensor on the cache's device (a meta or other-device input would be read as nothing, or fail deep
    inside a kernel)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != kv_cache.device:
            raise ValueError(f"{name}: on {t.device}, but kv_cache is on {kv_cache.device}")


def _check_query(query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query: expected a torch.Tensor, got {type(query).__name__}")
    if query.dtype not in INPUT_DTYPES:
        raise TypeError(f"query: expected float16, bfloat16 or float32, got {query.dtype}")
    if query.dim() != 3:
        raise ValueError(f"query: expected shape [T, Hq, D], got {tuple(query.shape)}")
    kv_heads = kv_cache.shape[2]
    if query.shape[1] % kv_heads:
        raise ValueError(f"query: {query.shape[1]} query heads is not a multiple of the cache's {kv_heads} kv heads")


def check_kv_write(key, value, kv_cache, slot_mapping, preset: str) -> Preset:
    if not isinstance(key, torch.Tensor) or key.dim() != 3:
        raise ValueError(f"key: expected a tensor [T, Hk, D], got {getattr(key, 'shape', type(key).__name__)}")
    p = _check_cache(kv_cache, preset, key.shape[-1])
    p.check_key_value(key, value)
    if key.shape[1] != kv_cache.shape[2]:
        raise ValueError(f"key: {key.shape[1]} kv heads, but kv_cache holds {kv_cache.shape[2]}")
    _check_index("slot_mapping", slot_mapping, 1)
    _check_devices(kv_cache, key=key, value=value, slot_mapping=slot_mapping)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping: expected {key.shape[0]} entries (one per token), got {slot_mapping.shape[0]}")
    if slot_mapping.numel() and _value_checks_enabled(slot_mapping):
        capacity = kv_cache.shape[0] * kv_cache.shape[1]
        top = int(slot_mapping.max())
        if top >= capacity:
            raise ValueError(f"slot_mapping: slot {top} is out of range; the cache holds {capacity} slots")
    return p


def _check_blocks(kv_cache, block_table, seq_lens, query_start_loc=None, rows: int = 0) -> None:
    """block_table / seq_lens (and query_start_loc, given the query's ``rows``): dtypes and shapes, then their
    values against the cache (:func:`_failed_index_checks`)."""
    _check_index("block_table", block_table, 2)
    _check_index("seq_lens", seq_lens, 1)
    if seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(f"seq_lens: expected {block_table.shape[0]} entries (block_table rows), got {seq_lens.shape[0]}")
    if query_start_loc is not None:
        _check_index("query_start_loc", query_start_loc, 1)
        if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
            raise ValueError(f"query_start_loc: expected {seq_lens.shape[0] + 1} entries (batch + 1), got "
                             f"{query_start_loc.shape[0]}")
    if not _value_checks_enabled(seq_lens):
        return
    # numpy's ops on a few values cost ~1-2 us each on a CPU, torch's ~5-10; on a GPU one host read
    failed = (_failed_index_checks_on_host if seq_lens.device.type == "cpu" else _failed_index_checks)(
        kv_cache, block_table, seq_lens, query_start_loc, rows)
    if failed:
        raise ValueError(failed)


def _failed_index_checks(kv_cache, block_table, seq_lens, query_start_loc, rows: int) -> str | None:
    """:func:`_check_blocks`' value checks in torch on the tensors' device, read back in one host transfer: the
    first failure's message, or None."""
    block_size = kv_cache.shape[1]
    width = block_table.shape[1] * block_size
    lengths = seq_lens.to(torch.int64)
    bad = {}  # message -> a bool tensor
    if lengths.numel():
        bad[f"seq_lens: lengths must lie in [0, {width}] (block_table columns x block size)"] = (
            (lengths < 0) | (lengths > width)).any()
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * block_size < lengths[:, None]
        bad[f"block_table: block index out of range [0, {kv_cache.shape[0]}) for a used position"] = (
            used & ((block_table < 0) | (block_table >= kv_cache.shape[0]))).any()
    if query_start_loc is not None:
        starts = query_start_loc.to(torch.int64)
        new = starts[1:] - starts[:-1]
        bad[f"query_start_loc: must start at 0, not decrease and end at most at T={rows}"] = (
            (starts[0] != 0) | (new < 0).any() | (starts[-1] > rows))
        bad["seq_lens: a sequence has more new tokens (query_start_loc) than tokens in all"] = (new > lengths).any()
    if bad:
        for message, failed in zip(bad, torch.stack(list(bad.values())).tolist()):
            if failed:
                return message
    return None


def _failed_index_checks_on_host(kv_cache, block_table, seq_lens, query_start_loc, rows: int) -> str | None:
    """:func:`_failed_index_checks` on CPU tensors, in numpy."""
    import numpy as np

    block_size, num_blocks = kv_cache.shape[1], kv_cache.shape[0]
    width = block_table.shape[1] * block_size
    lengths = seq_lens.numpy().astype(np.int64)
    if lengths.size:
        if lengths.min() < 0 or lengths.max() > width:
            return f"seq_lens: lengths must lie in [0, {width}] (block_table columns x block size)"
        used = np.arange(block_table.shape[1])[None, :] * block_size < lengths[:, None]
        blocks = block_table.numpy()[used]
        if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
            return f"block_table: block index out of range [0, {num_blocks}) for a used position"
    if query_start_loc is not None:
        starts = query_start_loc.numpy().astype(np.int64)
        new = np.diff(starts)
        if starts[0] != 0 or (new < 0).any() or starts[-1] > rows:
            return f"query_start_loc: must start at 0, not decrease and end at most at T={rows}"
        if (new > lengths).any():
            return "seq_lens: a sequence has more new tokens (query_start_loc) than tokens in all"
    return None


def check_attention(query, kv_cache, block_table, seq_lens, query_start_loc, preset: str, key=None,
                    value=None, indices_checked: bool = False) -> Preset:
    """The op's input checks. ``indices_checked``: block_table, seq_lens and query_start_loc passed these checks
    already, against a cache of the same blocks and a query of the same rows (the layers of one engine step
    after the first: vllm/serving.attend); their checks, host reads included, are skipped."""
    _check_query(query, kv_cache)
    p = _check_cache(kv_cache, preset, query.shape[-1])
    _check_devices(kv_cache, query=query, **({} if indices_checked else dict(
        block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc)))
    if (key is None) != (value is None):
        missing = "value" if value is None else "key"
        raise ValueError(f"{missing}: missing; the step's key and value come together (or neither)")
    for name, t in (("key", key), ("value", value)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        want = (query.shape[0], kv_cache.shape[2], query.shape[2])
        if tuple(t.shape) != want or t.dtype != query.dtype or t.device != query.device:
            raise ValueError(f"{name}: expected {query.dtype} {want} on {query.device} (one row per query row), "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if not indices_checked:
        _check_blocks(kv_cache, block_table, seq_lens, query_start_loc, query.shape[0])
    return p


def check_kv_dot(query, kv_cache, block_table, seq_lens, preset: str) -> Preset:
    _check_query(query, kv_cache)
    p = _check_cache(kv_cache, preset, query.shape[-1])
    _check_devices(kv_cache, query=query, block_table=block_table, seq_lens=seq_lens)
    _check_blocks(kv_cache, block_table, seq_lens)
    if query.shape[0] != block_table.shape[0]:
        raise ValueError(f"query: expected one row per sequence ({block_table.shape[0]}), got {query.shape[0]}")
    return p


# -- the ops -----------------------------------------------------------------------------------------


@torch.library.custom_op("tqkv::kv_write", mutates_args=("kv_cache",))
def kv_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, preset: str
) -> None:
    """Quantize, pack and scatter key/value [T, Hk, D] into kv_cache u8 [NB, BS, Hk, S]; slot < 0 skips."""
    kv_write_direct(key, value, kv_cache, slot_mapping, preset)


def kv_write_direct(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    preset: str) -> None:
    """``tqkv::kv_write`` as a plain function (the same checks and backend call), for callers that run inside
    vLLM's own opaque ops (``vllm/serving.write_kv``): the custom op's Python dispatch (its mutation and autograd
    bookkeeping) cost 0.05-0.2 ms a call on a 2-core CPU, more than the write of a decode step's few tokens.
    Traced graphs use ``tqkv::kv_write``."""
    p = check_kv_write(key, value, kv_cache, slot_mapping, preset)
    backend = backends.select_backend(kv_cache.device, p)
    if backends.validate_enabled() and backend.name != "reference":
        expected = kv_cache.clone()
        backends.get_backend("reference").kv_write(key, value, expected, slot_mapping, p)
        backend.kv_write(key, value, kv_cache, slot_mapping, p)
        backends.record_validation("kv_write", backend.name, float((expected != kv_cache).sum()))
        return
    backend.kv_write(key, value, kv_cache, slot_mapping, p)


@kv_write.register_fake
def _(key, value, kv_cache, slot_mapping, preset):
    # a meta input next to a real cache dispatches here: the device mismatch is still an error
    _check_devices(kv_cache, key=key, value=value, slot_mapping=slot_mapping)
    return None


@torch.library.custom_op("tqkv::attention", mutates_args=())
def attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    preset: str,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over the packed cache; out [T, Hq, D] in the query's dtype.

    ``key`` / ``value`` [T, Hk, D] (optional): the step's keys and values, one row per query row (what
    ``kv_write`` stored this step). Given them, a sequence whose new tokens are all its tokens (a whole prompt)
    attends them as they are instead of reading its slots back through the codec, as vLLM's TurboQuant does
    for a first chunk. Not looked at (the cache is read) in a batch with no more query rows
    (``query_start_loc[-1]``) than sequences (pure decode) nor inside CUDA-graph capture."""
    return _attention(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, key, value)


def attention_into(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, preset: str,
                   key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                   indices_checked: bool = False) -> torch.Tensor:
    """``tqkv::attention`` written into ``out`` (the query's shape and dtype, its last dimension contiguous;
    not overlapping the inputs), for callers that own the output buffer already (vLLM's attention layers: see
    ``vllm/serving.attend``): the Triton backend's decode kernels store there directly, which saves a copy
    kernel a layer and step. A plain function, not an op: its callers run inside vLLM's own opaque ops; traced
    graphs use ``tqkv::attention``. ``indices_checked``: as :func:`check_attention`'s. Returns ``out``."""
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out: expected {tuple(query.shape)} {query.dtype} on {query.device} (the query's), "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if out.numel() and out.stride(-1) != 1:
        raise ValueError(f"out: its last dimension must be contiguous (strides {out.stride()})")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t is not None and t.numel() and out.numel() and \
                t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            raise ValueError(f"out: shares memory with {name}; attention reads it after out is written")
    return _attention(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, key, value, out=out,
                      indices_checked=indices_checked)


def _attention(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, key, value, out=None,
               indices_checked=False):
    p = check_attention(query, kv_cache, block_table, seq_lens, query_start_loc, preset, key, value, indices_checked)
    own = {} if key is None else dict(key=key, value=value)
    backend = backends.select_backend(query.device, p)
    into = dict(out=out) if out is not None and backends.takes_out(backend) else {}
    result = backend.attention(query, kv_cache, block_table, seq_lens, query_start_loc, scale, p, **own, **into)
    if out is None:
        out = result
    elif result is not out:  # a backend registered without ``out``, or one that answered in its own tensor
        out.copy_(result)
    if backends.validate_enabled() and backend.name != "reference":
        expected = backends.get_backend("reference").attention(
            query, kv_cache, block_table, seq_lens, query_start_loc, scale, p, **own
        )
        backends.record_validation("attention", backend.name, float((expected.float() - out.float()).abs().max()))
    return out


@attention.register_fake
def _(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, key=None, value=None):
    _check_devices(kv_cache, query=query, block_table=block_table, seq_lens=seq_lens,
                   query_start_loc=query_start_loc, key=key, value=value)
    return torch.empty_like(query)


@torch.library.custom_op("tqkv::kv_dot", mutates_args=())
def kv_dot(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    preset: str,
) -> torch.Tensor:
    """Logits scale * <q, k> f32 [B, Hq, M * BS] for one query per sequence; -inf at or past seq_lens[b]."""
    p = check_kv_dot(query, kv_cache, block_table, seq_lens, preset)
    backend = backends.select_backend(query.device, p)
    out = backend.kv_dot(query, kv_cache, block_table, seq_lens, scale, p)
    if backends.validate_enabled() and backend.name != "reference":
        expected = backends.get_backend("reference").kv_dot(query, kv_cache, block_table, seq_lens, scale, p)
        finite = torch.isfinite(expected)
        diff = (expected[finite] - out[finite]).abs().max() if bool(finite.any()) else torch.zeros((), dtype=torch.float32)
        if not torch.equal(finite, torch.isfinite(out)):
            diff = torch.tensor(float("inf"), dtype=torch.float32)
        backends.record_validation("kv_dot", backend.name, float(diff))
    return out


@kv_dot.register_fake
def _(query, kv_cache, block_table, seq_lens, scale, preset):
    _check_devices(kv_cache, query=query, block_table=block_table, seq_lens=seq_lens)
    return query.new_empty(
        (query.shape[0], query.shape[1], block_table.shape[1] * kv_cache.shape[1]), dtype=torch.float32
    )
