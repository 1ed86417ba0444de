"""What the worker remembers of one request between steps, whether or not it is in the batch."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # Its block table in each KV cache group.
    block_ids: list[list[int]]
    num_computed_tokens: int
    # A cross-encoder's pair: where the second text's tokens begin (type 1 from there on).
    second_text_start: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
