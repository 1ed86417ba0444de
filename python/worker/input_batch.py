"""The persistent input batch: long-lived per-row state that each step changes only by deltas.

Rows 0..num_rows-1 are always occupied (holes are filled by moving the last rows down), so a
step's inputs are contiguous slices. Each row's token ids live on the device: a step's sampled
ids are written there by the device itself, and the next step's input ids are gathered from
there, so a sampled token reaches the next step without a trip through the host. The host keeps
only counters (tokens per row, tokens computed) and the block table.
"""

from __future__ import annotations

import numpy as np
import torch

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
        device: torch.device,
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_rows = max_num_rows
        self.device = device
        self.row_req_ids: list[str | None] = [None] * max_num_rows
        self.req_id_to_row: dict[str, int] = {}
        self.token_ids = torch.zeros((max_num_rows, max_model_len), dtype=torch.int64, device=device)
        self.num_tokens = np.zeros(max_num_rows, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_rows, dtype=np.int32)
        max_blocks = (max_model_len + block_size - 1) // block_size
        # One per KV cache group (sluice/kv_cache_groups.py).
        self.block_tables = [
            BlockTable(max_num_rows, max_blocks, pin_memory=device.type == "cuda")
            for _ in range(num_kv_groups)
        ]
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
        tokens = [*state.prompt_token_ids, *state.output_token_ids]
        self.token_ids[row, : len(tokens)].copy_(torch.tensor(tokens, dtype=torch.int64), non_blocking=True)
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = state.num_computed_tokens
        for table, block_ids in zip(self.block_tables, state.block_ids, strict=True):
            table.set_row(row, block_ids)
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
        for table in self.block_tables:
            table.move_row(src, dst)
        self.sampling.move(src, dst)

    def append_sampled(self, rows: list[int], sampled: torch.Tensor) -> None:
        """Write each row's sampled token (sampled[i] for rows[i], on the device) after its last token."""
        if not rows:
            return
        if self.token_ids.is_cpu:
            # Through numpy: four small torch ops cost more in dispatch than the tokens they move.
            self.token_ids.numpy()[rows, self.num_tokens[rows]] = sampled.numpy()
        else:
            index = torch.tensor(rows, dtype=torch.int64)
            positions = torch.from_numpy(self.num_tokens[rows].astype(np.int64))
            self.token_ids.index_put_((index.to(self.device), positions.to(self.device)), sampled)
        self.num_tokens[rows] += 1
        self.sampling.append_output_tokens(rows, sampled)

    def append_token_list(self, row: int, token_ids: list[int]) -> None:
        """Write a row's new tokens, known on the host, after its last token (a verified draft run)."""
        start = int(self.num_tokens[row])
        ids = torch.tensor(token_ids, dtype=torch.int64)
        self.token_ids[row, start : start + len(token_ids)].copy_(ids, non_blocking=True)
        self.num_tokens[row] += len(token_ids)
        self.sampling.append_output_tokens([row] * len(token_ids), ids.to(self.device))
