"""A model folder as tqkv reads it: its config.json (the language model's part), its attention shape, its KV
bytes per token, and the built-in test models."""

from __future__ import annotations

import json
import os
from importlib import resources

from tqkv_compile.codec import get_preset


def builtin_model(name: str = "tiny-llama") -> str:
    """The folder of a model shipped with the package (``tqkv_compile/models/NAME``: config.json only)."""
    return str(resources.files("tqkv_compile") / "models" / name)


def text_config(config: dict) -> dict:
    """The language model's part of a model's config.json (multimodal configs nest it as ``text_config``)."""
    return config.get("text_config") or config


def check_model(command: str, model: str) -> None:
    """A one-line exit for a model folder vLLM could not read, or whose shape the demo cannot read (else: a
    stack trace, minutes later)."""
    config = os.path.join(model, "config.json")
    if not os.path.isfile(config):
        raise SystemExit(f"tqkv {command}: --model {model}: no config.json there")
    try:
        with open(config) as f:
            cfg = text_config(json.load(f))
    except (OSError, ValueError, AttributeError) as exc:
        raise SystemExit(f"tqkv {command}: --model {model}: config.json is not readable JSON ({exc})") from None
    missing = [key for key in ("num_attention_heads", "num_hidden_layers", "vocab_size") if key not in cfg]
    if "head_dim" not in cfg and "hidden_size" not in cfg:
        missing.append("head_dim or hidden_size")
    if missing:
        raise SystemExit(f"tqkv {command}: --model {model}: config.json (or its text_config) has no "
                         f"{', '.join(missing)}")


def model_shape(model: str) -> tuple[int, int, int]:
    """(layers, kv heads, head size) from a model folder's config.json (a multimodal config's text part)."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = text_config(json.load(f))
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"], kv_heads, head_dim


def kv_bytes_per_token(model: str, preset: str, compressed_layers: int) -> tuple[int, int]:
    """(bytes per token over all layers with the TurboQuant layers packed, the same all in bf16)."""
    layers, kv_heads, head_dim = model_shape(model)
    bf16_layer = kv_heads * head_dim * 2 * 2
    try:
        slot = get_preset(preset, head_dim).slot_bytes
    except ValueError:
        slot = head_dim * 4
    tq_layer = kv_heads * slot
    return compressed_layers * tq_layer + (layers - compressed_layers) * bf16_layer, layers * bf16_layer
