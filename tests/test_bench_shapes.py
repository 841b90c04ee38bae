"""``tqkv bench kernels --shapes``: the matrix's shapes and cases, its ratios and heat map (the timing needs a GPU)."""

from __future__ import annotations

import pytest

from tqkv_compile.tools import bench_shapes


def test_the_matrix_holds_the_shapes_and_cases_users_serve():
    assert bench_shapes.SHAPES["llama3-70b-tp8"] == (8, 1, 128) and bench_shapes.SHAPES["qwen2.5-7b"] == (28, 4, 128)
    for q_heads, kv_heads, dim in bench_shapes.SHAPES.values():
        assert q_heads % kv_heads == 0 and dim in (64, 128, 256)
    ragged = bench_shapes.CASES["64-ragged-1k..64k"]
    assert ragged.batch == 64 and min(ragged.lens) == 1024 and max(ragged.lens) == 65536
    assert sorted(ragged.lens) != list(ragged.lens)  # long and short sequences mixed, not sorted
    assert bench_shapes.CASES["32x16384x4rows"].rows == 4


def test_ratios_pair_each_tqkv_time_with_fa3_bf16_in_its_cell():
    records = [{"meta": {}},
               dict(shape="llama3-8b", case="1x4096", impl="fa3_bf16", preset="bf16", us=20.0),
               dict(shape="llama3-8b", case="1x4096", impl="tqkv", preset="turboquant_4bit_nc", us=10.0),
               dict(shape="qwen2.5-7b", case="1x4096", impl="tqkv", preset="turboquant_4bit_nc", us=10.0),
               dict(shape="qwen2.5-7b", case="1x4096", impl="fa3_bf16", preset="bf16", error="no FA3")]
    assert bench_shapes.ratios(records) == {"turboquant_4bit_nc": {("llama3-8b", "1x4096"): 2.0}}


def test_the_heat_map_is_drawn_from_the_records(tmp_path):
    pytest.importorskip("matplotlib")  # the [plot] extra
    records = [dict(shape="llama3-8b", case=case, impl=impl, preset=preset, us=us)
               for case in ("1x4096", "16x8192")
               for impl, preset, us in (("fa3_bf16", "bf16", 20.0), ("tqkv", "turboquant_4bit_nc", 12.0))]
    bench_shapes.plot(records, str(tmp_path / "heat.png"))
    assert (tmp_path / "heat.png").stat().st_size > 1000


def test_unknown_shape_names_are_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        bench_shapes.main(["--shapes", "--shape-names", "llama3-8b,gpt5"])
    assert "gpt5" in capsys.readouterr().err
