"""A request inside the engine core: token ids and the counters that chase them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.pooling import PoolingParams
from sluice.sampling_params import SamplingParams
from sluice.worker_seam import Logprobs, PromptLogprobs

if TYPE_CHECKING:
    from engine.structured_output import RequestGrammar
    from engine.thinking_budget import ThinkingBudgetState


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Every status from here on is final.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # No token could be sampled under the request's own constraints (see Request.error).
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason of a final status, None while the request lives."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """No prefill or decode phase: num_computed_tokens chases num_tokens, and that is all."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    # Lower value is served first, as in vLLM.
    priority: int = 0
    # vLLM's: a request shares cached KV blocks only with requests of the same salt (or none).
    cache_salt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt then outputs; appended to per token so the hot path never concatenates.
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Tokens sampled by steps in flight whose ids the engine has not seen yet (async scheduling):
    # the next step already computes them, so num_computed_tokens may run ahead of num_tokens.
    num_output_placeholders: int = 0
    # Prompt tokens served by the prefix cache on the first schedule (not on resumptions).
    num_cached_tokens: int = 0
    # Seconds since the Unix epoch when the scheduler first gave it tokens (kept across preemptions).
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # The stop token id that ended the request, if one did (EOS leaves it None).
    stop_reason: int | None = None
    # With FINISHED_ERROR: why, and the request field at fault.
    error: str | None = None
    invalid_param: str | None = None
    # Chained hashes of the request's full blocks, extended lazily by the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    # The matcher of its structured output constraint: it has consumed every output token.
    grammar: RequestGrammar | None = None
    # Its thinking budget's state (sampling_params.thinking_budget): it has seen every output token.
    thinking: ThinkingBudgetState | None = None
    # With prompt_logprobs: the entries of prompt positions 1, 2, ... received so far (None without).
    prompt_logprobs: list[Logprobs] | None = field(init=False)
    # Whether the prompt logprobs went out (with the first generated token).
    prompt_logprobs_sent: bool = False
    # A pooling request: computed once through its prompt, it finishes with its embedding and samples nothing.
    pooling: PoolingParams | None = None
    # Set for a pooling request when the model pools over every position (mean or first token),
    # which a prefix-cache hit would skip.
    pools_every_position: bool = False
    # An encoder's request: its prompt is computed whole in one step (attention is bidirectional, so
    # neither a chunk nor a cached prefix could stand for part of it).
    encodes_whole_prompt: bool = False
    # A cross-encoder's pair of texts: the position of the second text's first token (token type 1
    # from there on); None: one text.
    second_text_start: int | None = None

    def __post_init__(self) -> None:
        assert len(self.prompt_token_ids) > 0, "the boundary rejects empty prompts"
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        self.prompt_logprobs = None if self.sampling_params.prompt_logprobs is None else []

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt positions are still to be computed for their logprobs (no prefix-cache hits then)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Keep a step's prompt logprobs; positions already kept (recomputed after a preemption) are skipped."""
        assert self.prompt_logprobs is not None, "prompt logprobs for a request that did not ask for them"
        already = len(self.prompt_logprobs) + 1 - chunk.start
        assert already >= 0, (
            f"prompt logprobs from position {chunk.start} before {len(self.prompt_logprobs) + 1}"
        )
        self.prompt_logprobs.extend(chunk.logprobs[already:])
        assert len(self.prompt_logprobs) <= self.num_prompt_tokens - 1

    def take_prompt_logprobs(self) -> list[Logprobs] | None:
        """The complete prompt logprobs the first time they are asked for, then None."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        assert not self.needs_prompt_logprobs, (
            "the first token was sampled before the prompt's logprobs were in"
        )
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    def samples_under_mask(self, num_unseen: int) -> bool:
        """Whether a step that samples the token after `num_unseen` tokens in flight needs a bitmask
        from the engine core: a structured output constraint, or a thinking budget that may force
        that token."""
        return self.grammar is not None or (
            self.thinking is not None and self.thinking.may_force_after(num_unseen)
        )

    def next_token_mask(self) -> RequestGrammar | ThinkingBudgetState | None:
        """What fills its next bitmask row: a forced end of thinking first, then its constraint
        (None: every token)."""
        if self.thinking is not None and self.thinking.forced_token is not None:
            return self.thinking
        return self.grammar

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt position must be computed, so that no prefix-cache hit may skip any."""
        return self.needs_prompt_logprobs or self.pools_every_position or self.encodes_whole_prompt

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
