"""The persistent input batch: long-lived per-row arrays that each step changes only by deltas.

Rows 0..num_rows-1 are always occupied (holes are filled by moving the last
rows down), so a step's inputs are contiguous slices of these arrays.
"""

from __future__ import annotations

import numpy as np

from worker.block_table import BlockTable
from worker.request_state import RequestState
from worker.sampling_state import SamplingState


class InputBatch:
    def __init__(
        self,
        max_num_rows: int,
        max_model_len: int,
        block_size: int,
        sampling_state: SamplingState,
    ) -> None:
        self.max_num_rows = max_num_rows
        self.row_req_ids: list[str | None] = [None] * max_num_rows
        self.req_id_to_row: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_rows, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_rows, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_rows, dtype=np.int32)
        max_blocks = (max_model_len + block_size - 1) // block_size
        self.block_table = BlockTable(max_num_rows, max_blocks, block_size)
        self.sampling = sampling_state
        self._holes: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self.req_id_to_row)

    def add(self, state: RequestState) -> int:
        row = self._holes.pop() if self._holes else self.num_rows
        assert row < self.max_num_rows, "the persistent batch is full"
        assert self.row_req_ids[row] is None
        self.row_req_ids[row] = state.req_id
        self.req_id_to_row[state.req_id] = row
        n_prompt = len(state.prompt_token_ids)
        n = n_prompt + len(state.output_token_ids)
        self.token_ids[row, :n_prompt] = state.prompt_token_ids
        self.token_ids[row, n_prompt:n] = state.output_token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.block_table.set_row(row, state.block_ids)
        self.sampling.add(row, state.sampling_params, state.prompt_token_ids, state.output_token_ids)
        return row

    def remove(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.row_req_ids[row] = None
        self.sampling.remove(row)
        self._holes.append(row)

    def condense(self) -> None:
        """Move the last occupied rows into the holes so that rows 0..num_rows-1 are dense."""
        if not self._holes:
            return
        num_rows = self.num_rows
        extent = num_rows + len(self._holes)
        holes = sorted(h for h in self._holes if h < num_rows)
        self._holes.clear()
        movers = [r for r in range(num_rows, extent) if self.row_req_ids[r] is not None]
        assert len(movers) == len(holes)
        for src, dst in zip(reversed(movers), holes):
            self._move(src, dst)
        assert all(r is not None for r in self.row_req_ids[:num_rows])

    def _move(self, src: int, dst: int) -> None:
        req_id = self.row_req_ids[src]
        assert req_id is not None and self.row_req_ids[dst] is None
        self.row_req_ids[dst], self.row_req_ids[src] = req_id, None
        self.req_id_to_row[req_id] = dst
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.num_tokens[dst] = n
        self.num_computed_tokens[dst] = self.num_computed_tokens[src]
        self.block_table.move_row(src, dst)
        self.sampling.move(src, dst)

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
        self.sampling.append_output_token(row, token_id)
