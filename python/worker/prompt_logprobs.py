"""Prompt logprobs: for each prompt token after the first, its logprob under the model plus the top N.

The hidden state at position j predicts the token at j + 1, so a step that computes positions
[c, c + s) of a request predicts prompt tokens c + 1 .. min(c + s, P - 1), P its prompt length
(the prediction at P - 1 is the first generated token, which the sampler handles). Chunked
prefill therefore yields them chunk by chunk. They are computed eagerly from the step's hidden
states after the forward, whatever mode ran it (graphs only produce the hidden states), in slices
so that the [rows, vocab] logits stay small. Like sampled-token logprobs they are raw: the
log-softmax of the model's logits, before any sampling parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sluice.worker_seam import Logprobs, PromptLogprobs
from worker.request_state import RequestState

# Rows of logits computed at once: 256 x a 49k vocabulary in float32 is 50 MB.
SLICE_ROWS = 256


@dataclass(slots=True)
class _Span:
    """One row's predictions of prompt tokens in a step."""

    row: int
    # The prompt position of the first predicted token.
    start: int
    count: int
    num_top: int


@dataclass(slots=True)
class StepPromptLogprobs:
    """One step's prompt logprobs, still on the device; to_wire brings them to the host."""

    num_rows: int
    spans: list[_Span]
    # Concatenated over the spans: the actual token's logprob and rank, the top-N ids and logprobs.
    token_ids: torch.Tensor
    token_logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to_wire(self) -> list[PromptLogprobs | None]:
        """Per row of the step: its PromptLogprobs, or None when it predicted no prompt token."""
        token_ids = self.token_ids.tolist()
        token_logprobs = self.token_logprobs.tolist()
        ranks = self.ranks.tolist()
        top_ids = self.top_ids.tolist()
        top_logprobs = self.top_logprobs.tolist()
        per_row: list[PromptLogprobs | None] = [None] * self.num_rows
        offset = 0
        for span in self.spans:
            entries = []
            for i in range(offset, offset + span.count):
                n = span.num_top
                entries.append(
                    Logprobs(
                        [token_ids[i], *top_ids[i][:n]],
                        [token_logprobs[i], *top_logprobs[i][:n]],
                        ranks[i],
                    )
                )
            per_row[span.row] = PromptLogprobs(span.start, entries)
            offset += span.count
        return per_row


def step_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    states: list[RequestState],
    num_computed: np.ndarray,
    num_scheduled: np.ndarray,
) -> StepPromptLogprobs | None:
    """The prompt logprobs this step's rows predicted, or None when no row asked for any.

    hidden: the step's hidden states, rows in the order of `states`; num_computed: each row's
    tokens computed before this step; num_scheduled: the tokens it computes in this step.
    compute_logits: the model's hidden -> float32 logits (every tensor-parallel rank calls it alike).
    """
    # The common step: nobody asked, and the hot path pays one scan of the rows.
    if all(state.sampling_params.prompt_logprobs is None for state in states):
        return None
    spans: list[_Span] = []
    hidden_starts: list[int] = []
    query_start = 0
    for row, (state, computed, scheduled) in enumerate(
        zip(states, num_computed.tolist(), num_scheduled.tolist(), strict=True)
    ):
        num_top = state.sampling_params.prompt_logprobs
        last = min(computed + scheduled, len(state.prompt_token_ids) - 1)
        if num_top is not None and last > computed:
            spans.append(_Span(row, computed + 1, last - computed, num_top))
            hidden_starts.append(query_start)
        query_start += scheduled
    if not spans:
        return None
    device = hidden.device
    rows = torch.cat(
        [torch.arange(start, start + span.count) for start, span in zip(hidden_starts, spans, strict=True)]
    ).to(device)
    targets = torch.tensor(
        [
            token
            for span in spans
            for token in states[span.row].prompt_token_ids[span.start : span.start + span.count]
        ],
        dtype=torch.int64,
        device=device,
    )
    max_top = max(span.num_top for span in spans)
    parts: list[tuple[torch.Tensor, ...]] = []
    for begin in range(0, len(rows), SLICE_ROWS):
        end = min(begin + SLICE_ROWS, len(rows))
        logprobs = torch.log_softmax(compute_logits(hidden[rows[begin:end]]), dim=-1)
        actual = logprobs.gather(1, targets[begin:end].unsqueeze(1))
        ranks = (logprobs > actual).sum(dim=-1) + 1
        top = logprobs.topk(max_top, dim=-1) if max_top else None
        empty = torch.empty(end - begin, 0, device=device)
        parts.append(
            (
                actual.squeeze(1),
                ranks,
                top.indices if top is not None else empty.long(),
                top.values if top is not None else empty,
            )
        )
    token_logprobs, ranks, top_ids, top_logprobs = (torch.cat(column) for column in zip(*parts, strict=True))
    return StepPromptLogprobs(len(states), spans, targets, token_logprobs, ranks, top_ids, top_logprobs)
