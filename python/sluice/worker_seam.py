"""Messages between the engine core and its workers.

The engine core sends one SchedulerOutput per step; rank 0 answers with one
ModelRunnerOutput. A new request travels in full once; afterwards only its diff
does. Every field is a plain list, dict, str, int, float or bool so that the
message maps onto msgpack without pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Non-empty when a preempted request resumes: the tokens it had generated.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """Diffs of requests the workers already know, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute for it this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished, were aborted or were preempted since the last step:
    # workers drop their state. A preempted request that resumes comes back as new.
    finished_req_ids: set[str]


@dataclass(slots=True)
class Logprobs:
    """Per sampled token: column 0 is the sampled token, columns 1..N the top N."""

    token_ids: list[int]
    logprobs: list[float]
    # Rank of the sampled token in the distribution (1 = most likely).
    sampled_rank: int


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request: empty while its prompt is still being chunked in.
    sampled_token_ids: list[list[int]]
    # Parallel to req_ids; None for requests that did not ask for logprobs.
    logprobs: list[Logprobs | None]
