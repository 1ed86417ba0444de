"""Verifies a step's draft tokens (speculative decoding) in the worker.

A row with d drafts computes d + 1 query tokens: its last known token, then the drafts. The logits
at query j predict the token after it, so queries 0..d-1 give the tokens that greedy decoding
would put where the drafts stand, and the last query (the row's ordinary logits index) gives the
token after the last draft. A row keeps the drafts up to the first that differs from its greedy
token, then that greedy token (or, when every draft held, the token after the last): one to d + 1
tokens per step, exactly those that decoding one token per step would produce.

The engine core sends drafts only for greedy rows whose logits need no processing, so the
sampler's greedy path (the argmax) is what verifies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.input_batch import InputBatch
from worker.sampler import Sampler
from worker.sampling_state import SamplingMetadata


@dataclass(frozen=True, slots=True)
class DraftRows:
    """The step's rows that carry drafts, and the drafts of each, in row order."""

    rows: list[int]
    drafts: list[list[int]]

    @property
    def num_drafts(self) -> int:
        return sum(len(d) for d in self.drafts)


def draft_rows(batch: InputBatch, spec_token_ids: dict[str, list[int]]) -> DraftRows | None:
    """Write each row's drafts into its token table after its known tokens (num_tokens is unchanged:
    drafts are inputs of this step, not tokens of the request). None when the step has no drafts."""
    if not spec_token_ids:
        return None
    pairs = sorted((batch.req_id_to_row[req_id], drafts) for req_id, drafts in spec_token_ids.items())
    for row, drafts in pairs:
        assert drafts, "the engine core sends only non-empty drafts"
        assert batch.sampling.is_plain_greedy(row), "drafts are verified by the argmax alone"
        start = int(batch.num_tokens[row])
        batch.token_ids[row, start : start + len(drafts)] = torch.tensor(drafts, dtype=torch.int64)
    return DraftRows([row for row, _ in pairs], [drafts for _, drafts in pairs])


def verify_logits_indices(rows: DraftRows, num_scheduled: np.ndarray) -> np.ndarray:
    """The query indices whose logits check the drafts: per draft row, its first d queries, in row order."""
    query_ends = np.cumsum(num_scheduled)
    parts = []
    for row, drafts in zip(rows.rows, rows.drafts, strict=True):
        assert num_scheduled[row] == len(drafts) + 1, "a draft row computes its last token and its drafts"
        last = int(query_ends[row]) - 1
        parts.append(np.arange(last - len(drafts), last, dtype=np.int64))
    return np.concatenate(parts)


def accept_drafts(
    sampler: Sampler, verify_logits: torch.Tensor, rows: DraftRows, next_token_ids: torch.Tensor
) -> dict[int, list[int]]:
    """Per draft row, the tokens it keeps. next_token_ids: the step's ordinary sample of every row,
    which for a draft row is the token after its last draft."""
    assert verify_logits.shape[0] == rows.num_drafts
    greedy = sampler.sample(verify_logits, SamplingMetadata(num_rows=rows.num_drafts)).token_ids.tolist()
    after_last = next_token_ids[torch.tensor(rows.rows, device=next_token_ids.device)].tolist()
    kept: dict[int, list[int]] = {}
    offset = 0
    for row, drafts, bonus in zip(rows.rows, rows.drafts, after_last, strict=True):
        targets = greedy[offset : offset + len(drafts)]
        offset += len(drafts)
        num_accepted = 0
        while num_accepted < len(drafts) and drafts[num_accepted] == targets[num_accepted]:
            num_accepted += 1
        tokens = drafts[:num_accepted]
        tokens.append(targets[num_accepted] if num_accepted < len(drafts) else bonus)
        kept[row] = tokens
    return kept
