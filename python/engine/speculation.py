"""Speculative decoding in the engine core: which requests get draft tokens, how many, and what came of them.

A decoding request that is eligible gets up to K draft tokens appended to its one scheduled token,
and the worker verifies all of them in the same forward pass: it keeps the longest prefix of
drafts that greedy decoding would have produced, plus the token that follows it. The drafts are
never part of the request's known tokens: their KV slots are allocated like any others, and those
of rejected drafts are simply overwritten by the next step (num_computed_tokens moves back over
them), so no block is hashed for, or leaked by, a rejected token.

Only greedy requests are eligible: for them verification is exact (the accepted tokens are the
ones speculation off would produce). Sampled requests, and requests whose next token depends on
anything but the raw logits at its position (penalties, logit bias, logprobs, min_tokens still
in force), decode one token per step as usual.
"""

from __future__ import annotations

from engine.ngram_proposer import NgramProposer
from engine.request import Request
from sluice.config import SpeculativeConfig
from sluice.sampling_params import SamplingParams


def accepts_drafts(request: Request) -> bool:
    """The one predicate of a request's eligibility for speculation, re-checked at every step.

    A structured output request is not eligible: its matcher would have to follow, and roll back,
    every draft; nor, for the same reason, is one with a thinking budget. Nor is one with prompt
    logprobs, which are collected only on the plain path.
    """
    params: SamplingParams = request.sampling_params
    return (
        params.is_greedy
        and params.logprobs is None
        and params.structured_output is None
        and params.thinking_budget is None
        and params.prompt_logprobs is None
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words_token_ids
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and request.num_output_tokens >= params.min_tokens
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        assert config.method == "ngram", config.method
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        # Running totals, as vLLM counts them: verification steps with drafts, drafts verified, drafts kept.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def drafts_for(self, request: Request, token_budget: int) -> list[int]:
        """Draft tokens to verify after the request's one scheduled token (its last known one)."""
        if not accepts_drafts(request):
            return []
        params = request.sampling_params
        # Every accepted draft and the bonus token must fit the request's limits and the budget.
        room = min(
            self.num_speculative_tokens,
            params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
            token_budget - 1,
        )
        return self.proposer.propose(request.all_token_ids, room)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_drafts
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
