"""Turns the persistent batch plus one step's schedule into flat model inputs, with numpy only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker.input_batch import InputBatch


@dataclass(slots=True)
class StepInputs:
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    # Row of the last scheduled token of each batch row: where logits are taken.
    logits_indices: np.ndarray
    max_query_len: int
    max_seq_len: int


def build_step_inputs(batch: InputBatch, num_scheduled: np.ndarray) -> StepInputs:
    """num_scheduled[i] is the token count of batch row i this step (every row is scheduled)."""
    num_rows = len(num_scheduled)
    total = int(num_scheduled.sum())
    query_start_loc = np.zeros(num_rows + 1, dtype=np.int32)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    computed = batch.num_computed_tokens[:num_rows]
    if total == num_rows:
        # Pure decode: one token per row, so every array is per-row already.
        rows = np.arange(num_rows)
        positions = computed.astype(np.int64)
    else:
        rows = np.repeat(np.arange(num_rows), num_scheduled)
        offsets = np.arange(total) - np.repeat(query_start_loc[:-1], num_scheduled)
        positions = computed[rows].astype(np.int64) + offsets
    seq_lens = (computed + num_scheduled).astype(np.int32)
    return StepInputs(
        input_ids=batch.token_ids[rows, positions],
        positions=positions,
        slot_mapping=batch.block_table.slot_mapping(rows, positions),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        logits_indices=(query_start_loc[1:] - 1).astype(np.int64),
        max_query_len=int(num_scheduled.max()),
        max_seq_len=int(seq_lens.max()),
    )
