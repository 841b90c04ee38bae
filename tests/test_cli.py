"""The ``tqkv`` command's answers to bad input: one line naming the argument, before any engine starts."""

from __future__ import annotations

import pytest

from tqkv_compile import cli


@pytest.mark.parametrize("argv, message", [
    (["demo", "--kv-cache-dtype", "turboquant_5bit"], "argument --kv-cache-dtype: invalid choice"),
    (["demo", "--prompts", "0"], "argument --prompts: expected at least 1"),
    (["demo", "--new-tokens", "-1"], "argument --new-tokens: expected at least 1"),
    (["demo", "--dtype", "float99"], "argument --dtype: invalid choice"),
    (["inspect", "--kv-cache-dtype", "nope"], "argument --kv-cache-dtype: invalid choice"),
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


def test_quality_names_an_unknown_preset_and_the_valid_ones(capsys):
    assert cli.main(["quality", "--presets", "bf16,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown TurboQuant preset 'nope'" in err and "tqkv_k5v3" in err
