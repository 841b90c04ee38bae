"""``tqkv bench kernels``' measurement rules that do not need a GPU (the timings themselves run on the H200)."""

from __future__ import annotations

from tqkv_compile.tools.bench_kernels import rotations

H200_L2 = 50 * 2**20


def test_small_cases_cycle_through_enough_block_tables_to_leave_the_l2_cold():
    """A case smaller than 4x the L2 cycles through enough disjoint block tables that one timed pass reads at
    least 4x the L2 (1 x 32768 in 4 bits at head 128: 1072 bytes a token, 35 MB); large cases and --warm-l2
    replay one; the count is capped (1 x 4096 would need 48 at this size)."""
    pc_1x32768 = 32768 * 1072
    k = rotations(pc_1x32768, H200_L2)
    assert k * pc_1x32768 >= 4 * H200_L2 and (k - 1) * pc_1x32768 < 4 * H200_L2
    assert k == 6
    assert rotations(64 * 32768 * 1072, H200_L2) == 1
    assert rotations(pc_1x32768, H200_L2, cold=False) == 1
    assert rotations(1 * 4096 * 1072, H200_L2) == 48
    assert rotations(100, H200_L2) == 64
    assert rotations(0, H200_L2) == 1


def test_summary_names_kv_write_cases_by_tokens_and_rates_against_the_same_case(capsys):
    """kv_write records carry issue 4's fields (B = tokens, L = 0); the summary names them by their tokens
    and divides vLLM's time by ours for the same token count only."""
    from tqkv_compile.tools.bench_kernels import _summary

    records = [{"meta": {}},
               {"op": "kv_write", "B": 64, "L": 0, "impl": "tqkv", "preset": "p", "us": 4.0},
               {"op": "kv_write", "B": 64, "L": 0, "impl": "vllm_tq", "preset": "p", "us": 20.0},
               {"op": "kv_write", "B": 8192, "L": 0, "impl": "tqkv", "preset": "p", "us": 200.0},
               {"op": "kv_write", "B": 8192, "L": 0, "impl": "vllm_tq", "preset": "p", "us": 250.0}]
    _summary(records)
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("kv_write")]
    assert [(row[1], row[3], row[-1]) for row in lines if row[3] == "tqkv"] == [("64", "tqkv", "5.00"),
                                                                              ("8192", "tqkv", "1.25")]
