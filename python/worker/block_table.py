"""Each batch row's KV block ids, kept in one long-lived array."""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, max_num_rows: int, max_blocks_per_row: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks_per_row = max_blocks_per_row
        self.table = np.zeros((max_num_rows, max_blocks_per_row), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_rows, dtype=np.int32)

    def set_row(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        assert n <= self.max_blocks_per_row, f"{n} blocks exceed the per-row capacity"
        self.table[row, :n] = block_ids
        self.num_blocks[row] = n

    def append_to_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        assert end <= self.max_blocks_per_row, f"{end} blocks exceed the per-row capacity"
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.num_blocks[src])
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = n
        self.num_blocks[src] = 0

    def slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat cache slot of each (row, position) pair."""
        block_ids = self.table[rows, positions // self.block_size].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size
