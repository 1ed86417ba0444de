"""What the engine core reports per request per step, and the scheduler's stats for metrics."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.worker_seam import Logprobs


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    # One entry per new token, or None when the request did not ask for logprobs.
    new_logprobs: list[Logprobs] | None = None
    # "stop", "length" or "abort" once the request has ended.
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    # Fraction of KV blocks held by requests, in [0, 1].
    kv_cache_usage: float
    # Both in tokens, cumulative since start, as vLLM counts them.
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Cumulative since start.
    num_preemptions: int
    # Rank 0's count of steps that ran eagerly for want of a captured graph shape, cumulative since start.
    num_eager_fallbacks: int
