"""The ``tqkv`` command's answers to bad input: one line naming the argument, before any engine starts."""

from __future__ import annotations

import json

import pytest

from tqkv_compile.tools import cli


@pytest.mark.parametrize("argv, message", [
    (["demo", "--kv-cache-dtype", "turboquant_5bit"], "argument --kv-cache-dtype: invalid choice"),
    (["demo", "--prompts", "0"], "argument --prompts: expected at least 1"),
    (["demo", "--new-tokens", "-1"], "argument --new-tokens: expected at least 1"),
    (["demo", "--dtype", "float99"], "argument --dtype: invalid choice"),
    (["inspect", "--kv-cache-dtype", "nope"], "argument --kv-cache-dtype: invalid choice"),
    (["demo", "--preset", "turboquant_4bit_nc"], "argument --preset: invalid choice"),
])
def test_bad_arguments_stop_at_parsing_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "inspect"])
def test_a_model_folder_vllm_cannot_read_is_named(tmp_path, command):
    with pytest.raises(SystemExit, match=f"tqkv {command}: --model .*: no config.json there"):
        cli.main([command, "--model", str(tmp_path / "missing")])
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit, match="config.json is not readable JSON"):
        cli.main([command, "--model", str(tmp_path)])
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 6, "hidden_size": 512}')
    with pytest.raises(SystemExit, match="has no num_attention_heads, vocab_size$"):
        cli.main([command, "--model", str(tmp_path)])


def test_a_multimodal_config_is_read_through_its_text_config(tmp_path):
    """The language model's shape nested as text_config (e.g. Gemma 3) is what the demo sizes the cache by."""
    from tqkv_compile import model_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                      "text_config": {"num_attention_heads": 8, "num_key_value_heads": 4,
                                                                      "num_hidden_layers": 6, "vocab_size": 1000,
                                                                      "hidden_size": 1024}}))
    model_config.check_model("demo", str(tmp_path))
    assert model_config.model_shape(str(tmp_path)) == (6, 4, 128)


def test_quality_names_an_unknown_preset_and_the_valid_ones(capsys):
    assert cli.main(["quality", "--presets", "bf16,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown TurboQuant preset 'nope'" in err and "tqkv_k5v3" in err


def test_a_preset_of_ours_must_ride_on_the_cache_dtype_asked_for():
    with pytest.raises(SystemExit, match="--preset tqkv_k4o1v225 rides on turboquant_k3v4_nc; add --kv-cache-dtype"):
        cli.main(["demo", "--preset", "tqkv_k4o1v225"])


def test_a_chart_without_matplotlib_is_refused_before_the_run(monkeypatch):
    """--plot is checked when the arguments are read, not after a benchmark of many minutes."""
    import argparse
    import importlib.util

    from tqkv_compile.argtypes import plot_path

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(argparse.ArgumentTypeError, match="matplotlib"):
        plot_path("chart.png")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "matplotlib" else real(name, *a))
    assert plot_path("chart.png") == "chart.png"
