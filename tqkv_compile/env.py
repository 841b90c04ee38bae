"""Environment settings read on the serving path, at a dict lookup's cost.

The serving path reads its settings (``TQKV_PRESET``, ``TQKV_TRACE``, ``TQKV_CPU_KERNEL``, ``TQKV_VALIDATE``,
``TQKV_CHECK_VALUES``, ``TQKV_BACKEND``) at every call, so that a change (a test's ``monkeypatch.setenv``, a user's
``os.environ[...] = ...``) takes effect at the next call. ``os.environ.get`` costs ~2 us a read on a 2-core CPU
(``Mapping.get``, ``__getitem__``, encoding the key, decoding the value): eleven reads a layer and step were ~25 us
of a decode layer's ~100 us of Python. CPython's ``os.environ`` keeps its values in a dict of encoded keys
(``_data``) that ``__setitem__`` / ``__delitem__`` / ``putenv`` callers through it update; :func:`get` looks there
with a pre-encoded key. Where that dict is not there (another Python), it is ``os.environ.get``.
"""

from __future__ import annotations

import os

_data = getattr(os.environ, "_data", None)
_encode_key = getattr(os.environ, "encodekey", None)
_decode_value = getattr(os.environ, "decodevalue", None)
_keys: dict[str, object] = {}


def get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``."""
    if _data is None or _encode_key is None or _decode_value is None:
        return os.environ.get(name, default)
    key = _keys.get(name)
    if key is None:
        key = _keys[name] = _encode_key(name)
    value = _data.get(key)
    return default if value is None else _decode_value(value)
