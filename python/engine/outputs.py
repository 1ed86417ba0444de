"""What the offline API returns, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    # 1 = the most likely token.
    rank: int
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # One dict per generated token: token id -> Logprob (the sampled token and the top N).
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    # The token id that stopped generation, when a stop token did.
    stop_reason: int | None = None
    cumulative_logprob: float | None = None
    # With finish_reason "error": why the request failed, and the request field at fault (as the
    # server's 400 names it); a failed request does not stop the rest of the batch.
    error: str | None = None
    error_param: str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token, its logprob and the top N (None for the first).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """LLM.embed's result per prompt, as vLLM's: `.outputs.embedding` is the vector."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """LLM.score's result per pair, as vLLM's: `.outputs.score`; the prompt is the pair's two token lists."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
