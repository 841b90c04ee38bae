"""tqkv's switches for vLLM (compilation_config, enable, the plugin) given what users pass them, without an
engine: what they accept, what they refuse, what they forget."""

import os

import pytest

pytest.importorskip("vllm")

import tqkv_compile.vllm as tv  # noqa: E402
from tqkv_compile.vllm import plugin  # noqa: E402


@pytest.fixture
def no_register(monkeypatch):
    """enable() without the plugin's process-wide registration, and a clean tqkv environment."""
    monkeypatch.setattr(plugin, "register", lambda: None)
    monkeypatch.delenv("TQKV_ENABLE", raising=False)
    monkeypatch.delenv("TQKV_PRESET", raising=False)
    monkeypatch.setattr(tv, "_preset_set_here", False)


def test_a_compilation_config_object_passes_the_fields_its_caller_set():
    from vllm.config import CompilationConfig

    fields = tv._config_dict(CompilationConfig(cudagraph_capture_sizes=[1, 2]))
    assert fields["cudagraph_capture_sizes"] == [1, 2]
    assert "level" not in fields and "mode" not in fields  # left at vLLM's defaults
    assert tv._config_dict({"a": 1}) == {"a": 1} and tv._config_dict(None) == {}
    with pytest.raises(TypeError, match="base: expected a dict"):
        tv._config_dict(["level", 3])


def test_a_post_grad_pass_of_the_users_is_refused_not_replaced(no_register):
    def mine(graph):
        return None

    with pytest.raises(ValueError, match="post_grad_custom_post_pass.*already set"):
        tv.compilation_config({"inductor_compile_config": {"post_grad_custom_post_pass": mine}})
    assert "TQKV_ENABLE" not in os.environ  # refused before anything was switched on


def test_a_preset_asked_for_once_is_forgotten_by_the_next_call_without_one(no_register, monkeypatch):
    tv.enable("tqkv_k5v3")
    assert os.environ["TQKV_PRESET"] == "tqkv_k5v3"
    tv.enable()
    assert "TQKV_PRESET" not in os.environ
    monkeypatch.setenv("TQKV_PRESET", "tqkv_4bit_pc")  # the user's own environment is theirs
    tv.enable()
    assert os.environ["TQKV_PRESET"] == "tqkv_4bit_pc"


def test_the_plugin_refuses_a_preset_name_it_does_not_know(monkeypatch):
    monkeypatch.setattr(plugin, "_done", False)
    monkeypatch.setenv("TQKV_ENABLE", "1")
    monkeypatch.setenv("TQKV_PRESET", "tqkv_k5v33")
    with pytest.raises(ValueError, match="TQKV_PRESET='tqkv_k5v33' is not a preset of tqkv's.*tqkv_k5v3"):
        plugin.register()
    assert plugin._done is False


def test_a_preset_asked_for_but_not_served_is_a_warning_other_fallbacks_are_info(monkeypatch, caplog):
    """A layer whose cache dtype the asked-for preset does not ride on: a warning naming both; a layer vLLM
    keeps uncompressed: info."""
    import logging
    from types import SimpleNamespace

    from tqkv_compile.vllm import serving

    monkeypatch.setenv("TQKV_PRESET", "tqkv_k5v3")  # rides on turboquant_4bit_nc
    monkeypatch.setattr(serving, "fallbacks", {})
    monkeypatch.setattr(serving, "write_report", lambda: None)
    layer = SimpleNamespace(layer_name="l3", kv_cache_dtype="turboquant_k3v4_nc", head_size=64, impl=None)
    reason = serving.layer_fit(layer)
    assert reason.startswith(serving.UNSERVED_PRESET) and "turboquant_4bit_nc" in reason
    with caplog.at_level(logging.INFO, logger="vllm.tqkv_compile"):
        serving.record_fallback("l3", reason)
        serving.record_fallback("l0", "kv cache dtype 'auto' is not TurboQuant")
    levels = {r.getMessage().split(":")[1].split()[1]: r.levelno for r in caplog.records}
    assert levels == {"l3": logging.WARNING, "l0": logging.INFO}
