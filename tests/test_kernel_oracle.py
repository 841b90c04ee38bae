"""Kernels against the exact oracle: fp64 attention over the codec's decode of the very cache bytes.

The interpreted kernels round their dot operands to the GPU's fp16 before upcasting (``device_helpers.operand``),
so these tests see the GPU's operand numerics at contexts long enough for many splits and tiles, in ragged
batches with several query rows a sequence. What the interpreter cannot show is the GPU's own accumulation
inside the tensor cores; ``tqkv bench kernels --check`` runs the same oracle there.
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import interpreted_kernels
from paged_batches import paged_batch

import tqkv_compile
from tqkv_compile import oracle
from tqkv_compile.codec import get_preset, own_preset_names, preset_names

pytestmark = pytest.mark.interpret
triton = pytest.importorskip("triton")

L2_LIMIT, MAX_LIMIT = 0.01, 0.02
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """Define the kernels under the interpreter; restore the environment afterwards."""
    with interpreted_kernels():
        yield


def _paged(preset, lens, rows, kv_heads, group, q_scale=1.0, seed=0):
    """:func:`paged_batch` with bf16 keys, values and queries, blocks of 16 (junk block ids past the blocks)."""
    return paged_batch(preset, lens, rows, kv_heads, group, q_scale, dtype=torch.bfloat16, block=BLOCK, seed=seed,
                       kv_dtype=torch.bfloat16)


def _within_tolerance(out, exact):
    l2, worst = oracle.errors(out, exact)
    assert l2 <= L2_LIMIT and worst <= MAX_LIMIT, f"l2_rel {l2:.2e}, max_rel {worst:.2e}"


def test_oracle_is_causal_bottom_right_attention_over_the_decoded_bytes():
    """Written out row by row, position by position: row j of n new rows sees positions 0 .. L - n + j."""
    preset = get_preset("turboquant_4bit_nc", 64)
    cache, table, lens, qsl, query = _paged(preset, [3, 9], [1, 4], kv_heads=2, group=3, seed=1)
    exact = oracle.exact_attention(query, cache, table, lens, qsl, 0.125, preset)
    for b, length in enumerate(lens.tolist()):
        keys, values = preset.decode(oracle.context_slots(cache, table, b, length))
        n = int(qsl[b + 1] - qsl[b])
        for j in range(n):
            row = int(qsl[b]) + j
            for h in range(6):
                seen = length - n + j + 1
                logits = [0.125 * float(query[row, h].double() @ keys[t, h // 3].double()) for t in range(seen)]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                want = sum(w * values[t, h // 3].double() for t, w in enumerate(weights)) / sum(weights)
                torch.testing.assert_close(exact[row, h].double(), want, rtol=1e-5, atol=1e-6)
    assert oracle.errors(exact, exact) == (0.0, 0.0)


@pytest.mark.parametrize("preset_name", preset_names() + own_preset_names())
def test_reference_backend_is_within_tolerance_of_the_oracle(preset_name):
    """The reference (the fallback every kernel is also compared with) meets the kernels' tolerance on a ragged
    batch with several rows a sequence, flat and peaked."""
    preset = get_preset(preset_name, 64)
    reference = tqkv_compile.get_backend("reference")
    for q_scale in (1.0, 4.0):
        cache, table, lens, qsl, query = _paged(preset, [1, 300, 2100], [1, 5, 2], kv_heads=2, group=3,
                                                q_scale=q_scale, seed=2)
        out = reference.attention(query, cache, table, lens, qsl, 0.125, preset)
        _within_tolerance(out, oracle.exact_attention(query, cache, table, lens, qsl, 0.125, preset))


def _decode(preset, cache, table, lens, qsl, query, kernel, splits, **options):
    from tqkv_compile.lowerings.triton_attention import decode_attention

    rotation, centroids, _ = tqkv_compile.get_backend("triton").tables(preset, query.device)
    return decode_attention(query, cache, table, lens, qsl, 0.125, preset, rotation, centroids, kernel=kernel,
                            splits=splits, **options)


def test_stream_kernel_meets_the_oracle_on_a_long_ragged_batch_over_many_splits():
    """4bit_nc, flat attention (the hard case for accumulation), uneven lengths up to 9000 in one call, 24 splits
    of a row (the GPU's split counts at long contexts), one sequence with four rows."""
    preset = get_preset("turboquant_4bit_nc", 64)
    cache, table, lens, qsl, query = _paged(preset, [1, 700, 2500, 9000], [1, 1, 4, 1], kv_heads=1, group=3, seed=3)
    out = _decode(preset, cache, table, lens, qsl, query, "stream", splits=24)
    _within_tolerance(out, oracle.exact_attention(query, cache, table, lens, qsl, 0.125, preset))


def test_length_aware_splits_meet_the_oracle_on_a_ragged_batch():
    """Each row cut into its own split count from the batch's lengths (the launcher's default): lengths 2 .. 6000
    in one batch, so the rows get 1 to 6 of a grid of 24 splits (launch_choices.row_splits on the interpreter's 4
    SMs), one row and two rows a program; the answers meet the oracle and agree with every row cut into 24."""
    preset = get_preset("turboquant_4bit_nc", 64)
    cache, table, lens, qsl, query = _paged(preset, [2, 700, 2500, 6000], [2, 2, 2, 2], kv_heads=1, group=3, seed=7)
    exact = oracle.exact_attention(query, cache, table, lens, qsl, 0.125, preset)
    fixed = _decode(preset, cache, table, lens, qsl, query, "stream", 24, length_aware=False)
    for rows_per_program in (1, 2):
        out = _decode(preset, cache, table, lens, qsl, query, "stream", 24, length_aware=True,
                      rows_per_program=rows_per_program)
        _within_tolerance(out, exact)
        torch.testing.assert_close(out, fixed, rtol=0, atol=2e-3)


def test_the_kernels_split_plan_is_launch_choices_row_splits():
    """The plan every program computes (``device_helpers.row_splits``, from the batch's lengths and rows) is the
    host's rule, over random ragged batches (1 to 300 sequences: more than one chunk of 128), rows a program 1
    and 4, kv heads 1 and 8, grids of 8 to 256 splits."""
    import triton.language as tl

    from tqkv_compile.lowerings import device_helpers
    from tqkv_compile.lowerings import launch_choices as lc

    global dh  # (the interpreter resolves a kernel's names in its module's globals)
    dh = device_helpers

    @triton.jit
    def probe(tiles_ptr, qsl_ptr, lens_ptr, out_ptr, num_seqs, max_len, slots, wanted, BLOCK_N: tl.constexpr,
              NUM_SPLITS: tl.constexpr, ROWS: tl.constexpr):
        i = tl.program_id(0)
        tiles = tl.load(tiles_ptr + i)
        tl.store(out_ptr + i, dh.row_splits(tiles, qsl_ptr, lens_ptr, num_seqs, max_len, slots, wanted, BLOCK_N,
                                           NUM_SPLITS, ROWS))

    g = torch.Generator().manual_seed(8)
    checked = 0
    for num_seqs, rows_per_program, kv_heads, grid, block_n in [(1, 1, 8, 66, 64), (5, 1, 1, 256, 64),
                                                                 (64, 1, 4, 8, 64), (300, 4, 8, 8, 128),
                                                                 (37, 4, 2, 32, 16)]:
        lens = torch.randint(1, 70000, (num_seqs,), generator=g, dtype=torch.int32)
        rows = torch.randint(0, 6, (num_seqs,), generator=g, dtype=torch.int32)
        qsl = torch.cat([torch.zeros(1, dtype=torch.int32), rows.cumsum(0).to(torch.int32)])
        max_len = 65536
        probes = torch.randint(0, max_len // block_n + 1, (16,), generator=g, dtype=torch.int32)
        out = torch.zeros_like(probes)
        slots, wanted = 3 * 132, 4 * 132
        probe[(16, kv_heads)](probes, qsl, lens, out, num_seqs, max_len, slots, wanted, BLOCK_N=block_n,
                              NUM_SPLITS=grid, ROWS=rows_per_program)
        clamped = [min(n, max_len) for n in lens.tolist()]
        for tiles, got in zip(probes.tolist(), out.tolist()):
            assert got == lc.row_splits(clamped, rows.tolist(), tiles * block_n, kv_heads, slots, wanted, block_n,
                                        grid, rows_per_program), (num_seqs, tiles)
            checked += 1
    assert checked == 80


@pytest.mark.parametrize("preset_name,kernel,q_scale", [("turboquant_k8v4", "stream", 4.0),
                                                        ("turboquant_3bit_nc", "stream", 1.0),
                                                        ("turboquant_k3v4_nc", "bytes", 1.0)])
def test_kernels_meet_the_oracle_with_up_to_eight_rows_a_sequence(preset_name, kernel, q_scale):
    """fp8 keys, 3-bit values and 3-bit keys on the two interpretable kernels: ragged, 8 and 3 rows a sequence,
    group 5 (not a power of two), flat or peaked."""
    preset = get_preset(preset_name, 64)
    cache, table, lens, qsl, query = _paged(preset, [8, 3000], [8, 3], kv_heads=1, group=5, q_scale=q_scale,
                                            seed=4)
    out = _decode(preset, cache, table, lens, qsl, query, kernel, splits=12)
    _within_tolerance(out, oracle.exact_attention(query, cache, table, lens, qsl, 0.125, preset))


def test_general_kernel_and_kv_dot_meet_the_oracle_for_a_preset_of_ours():
    """tqkv_k5v3 (values in the rotated basis) through the general kernel; kv_dot's logits against exact ones."""
    preset = get_preset("tqkv_k5v3", 64)
    cache, table, lens, qsl, query = _paged(preset, [40, 1500], [2, 1], kv_heads=2, group=2, seed=5)
    triton_backend = tqkv_compile.get_backend("triton")
    out = triton_backend.decode_kernels(query, cache, table, lens, qsl, 0.125, preset)
    _within_tolerance(out, oracle.exact_attention(query, cache, table, lens, qsl, 0.125, preset))
    last = (qsl[1:] - 1).long()
    logits = triton_backend.kv_dot(query[last], cache, table, lens, 0.125, preset)
    exact = oracle.exact_logits(query[last], cache, table, lens, 0.125, preset)
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(logits))
    torch.testing.assert_close(logits[finite], exact[finite], rtol=0, atol=2e-3)


def test_stream_kernel_register_cap_grows_with_packed_columns_at_head_128():
    """The cap follows the packed columns at head 128 (128 at one row's up to 8 columns, 168 to 16, 192 above: the
    H100 sweep's caps without spills), and stays 128 at head 64 and 168 at head 256 whatever the columns."""
    from tqkv_compile.lowerings.launch_choices import programs_per_sm, stream_maxnreg

    assert [stream_maxnreg(128, c) for c in (1, 4, 8, 12, 16, 28, 32)] == [128, 128, 128, 168, 168, 192, 192]
    assert {stream_maxnreg(64, c) for c in (1, 16, 32)} == {128} and {stream_maxnreg(256, c) for c in (1, 32)} == {168}
    # fewer programs an SM as the cap grows: the split count's wave model sees it
    assert programs_per_sm(128, 4) > programs_per_sm(168, 4) > programs_per_sm(192, 4)


def test_stream_kernel_serves_several_rows_a_sequence_from_one_read():
    """Rows of a sequence packed into one program (``rows_per_program``) answer as one row a program does and
    meet the oracle: 4 and 3 rows a sequence, packed by 3 (a block straddles nothing: each sequence has its own),
    two splits of 33 positions, whose second holds one position (the first three rows' columns have none there),
    and two padding rows past the last sequence (answered 0)."""
    preset = get_preset("turboquant_4bit_nc", 64)
    cache, table, lens, qsl, query = _paged(preset, [33, 200], [4, 3], kv_heads=1, group=3, seed=6)
    query = torch.cat([query, query[:2]])  # a padded batch: rows after query_start_loc's last entry
    from tqkv_compile.lowerings.launch_choices import packed_rows
    from tqkv_compile.lowerings.triton_attention import decode_attention

    assert packed_rows(8, 2, 3) == 4 and packed_rows(6, 2, 3) == 3 and packed_rows(2, 2, 3) == 1
    assert packed_rows(8, 2, 8) == 1 and packed_rows(64, 2, 7) == 4  # (group 8: the fragment kernel; 32 columns)
    assert packed_rows(7, 2, 3) == 1 and packed_rows(575, 64, 4) == 1 and packed_rows(4, 0, 4) == 1  # mixed; none
    rotation, centroids, _ = tqkv_compile.get_backend("triton").tables(preset, query.device)
    outs = [decode_attention(query, cache, table, lens, qsl, 0.125, preset, rotation, centroids, kernel="stream",
                             splits=2, rows_per_program=r) for r in (1, 3)]
    exact = oracle.exact_attention(query[:7], cache, table, lens, qsl, 0.125, preset)
    for out in outs:
        _within_tolerance(out[:7], exact)
        assert torch.equal(out[7:], torch.zeros_like(out[7:]))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=2e-3)
    # rows before query_start_loc[0] (refused by the op's value checks; a direct call or a replay): answered 0
    shifted = decode_attention(torch.cat([query[4:6], query[:4]]), cache, table[:1], lens[:1],
                               torch.tensor([2, 6], dtype=torch.int32),
                               0.125, preset, rotation, centroids, kernel="stream", splits=2, rows_per_program=2)
    assert torch.equal(shifted[:2], torch.zeros_like(shifted[:2]))
    torch.testing.assert_close(shifted[2:6], outs[0][:4], rtol=0, atol=2e-3)
    with pytest.raises(ValueError, match="one row a program"):
        decode_attention(query, cache, table, lens, qsl, 0.125, preset, rotation, centroids, kernel="bytes",
                         rows_per_program=2)
