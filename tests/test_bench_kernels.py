"""``tqkv bench kernels``' measurement rules that do not need a GPU (the timings themselves run on the H200)."""

from __future__ import annotations

from tqkv_compile.bench_kernels import rotations

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
