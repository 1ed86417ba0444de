"""What the engine core reports per request per step (its stats are frontend_seam.EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.worker_seam import Logprobs


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    # One entry per new token, or None when the request did not ask for logprobs.
    new_logprobs: list[Logprobs] | None = None
    # "stop", "length", "abort" or "error" once the request has ended.
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    # Seconds since the Unix epoch when the scheduler first scheduled the request; None if it never did.
    first_scheduled_time: float | None = None
    # One entry per prompt token after the first, in the output of the first generated token only.
    prompt_logprobs: list[Logprobs] | None = None
    # With finish_reason "error": why, and the request field at fault.
    error: str | None = None
    invalid_param: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
