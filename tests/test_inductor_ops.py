"""The triton_op forms of the kernels (lowerings/inductor_ops.py) under torch.compile on the CPU: Inductor
decomposes them while tracing; off CUDA that is the checked ``tqkv`` op on the CPU's backend, so the compiled
step must equal eager and the generated code must call ``tqkv::kv_write`` / ``tqkv::attention``. (On CUDA the
same trace launches the Triton kernels from the generated code: examples/inductor_lowering.py, run on the H200.)"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import tqkv_compile
from tqkv_compile.lowerings import inductor_ops


def test_compiled_step_equals_eager_and_calls_the_reference_op_on_cpu():
    preset = tqkv_compile.get_preset("turboquant_k3v4_nc", 64)
    tables = inductor_ops.tables(preset.name, 64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(12, 16, 2, preset.slot_bytes, dtype=torch.uint8)
    table = torch.randperm(12, generator=gen)[:6].view(2, 3).to(torch.int32)
    lengths = [37, 20]
    for s, length in enumerate(lengths):
        pos = torch.arange(length)
        torch.ops.tqkv.kv_write(torch.randn(length, 2, 64, generator=gen), torch.randn(length, 2, 64, generator=gen),
                                cache, table[s, pos // 16].long() * 16 + pos % 16, preset.name)
    seq_lens = torch.tensor([n + 1 for n in lengths], dtype=torch.int32)
    slots = torch.stack([table[s, n // 16].long() * 16 + n % 16 for s, n in enumerate(lengths)])
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    q, k, v = torch.randn(2, 6, 64, generator=gen), torch.randn(2, 2, 64, generator=gen), torch.randn(2, 2, 64, generator=gen)

    def step(q, k, v, cache, slots):
        torch.ops.tqkv.triton_kv_write(k, v, cache, slots, tables["rotation"], tables["midpoints"], tables["centroids"],
                                         preset.name)
        out = torch.ops.tqkv.triton_attention(q, cache, table, seq_lens, qsl, tables["rotation"], tables["centroids"],
                                              tables["key_lut"], tables["signs"], 0.125, preset.name)
        return out * 2 + 1

    eager_cache, compiled_cache = cache.clone(), cache.clone()
    eager = step(q, k, v, eager_cache, slots)
    compiled, code = run_and_get_code(torch.compile(step, dynamic=False), q, k, v, compiled_cache, slots)
    assert torch.equal(eager_cache, compiled_cache) and not torch.equal(cache, eager_cache)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)
    source = "\n".join(code)
    assert "torch.ops.tqkv.kv_write.default(" in source and "torch.ops.tqkv.attention.default(" in source


def test_the_inductor_lowering_example_runs_on_the_cpu():
    """The example docs/design.md points to (on the H200 it shows Inductor launching our kernels) runs here too
    (off CUDA the ops are the checked ``tqkv`` ops on the CPU's backend): it broke once when an op input was removed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "inductor_lowering.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cache bytes equal True" in done.stdout and done.stdout.rstrip().endswith("OK"), done.stdout[-2000:]


@pytest.mark.parametrize("preset_name", tqkv_compile.codec.preset_names() + tqkv_compile.codec.own_preset_names())
def test_every_presets_tables_build(preset_name):
    """The op inputs carrying a preset's tables build for every preset, ours included (5-bit keys have no
    stream-kernel table and get a placeholder); where the stream kernel reads the keys (3- and 4-bit Lloyd-Max)
    the fp16 lookup table's entries are the preset's centroids in order."""
    from tqkv_compile.lowerings.cache_tables import _lut_words

    t = inductor_ops.tables(preset_name, 64, torch.device("cpu"))
    preset = tqkv_compile.get_preset(preset_name, 64)
    assert t["key_lut"].shape == (8,) and t["key_lut"].dtype == torch.int32
    if not preset.key_fp8 and preset.key_bits in (3, 4):
        cents = preset.centroids("cpu").float()
        padded = torch.cat([cents, torch.zeros(16 - cents.numel())])
        assert torch.equal(t["key_lut"], _lut_words(padded))
