"""Each batch row's KV block ids: a long-lived host array, mirrored into the device's step buffer."""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    def __init__(self, max_num_rows: int, max_blocks_per_row: int, pin_memory: bool) -> None:
        self.max_blocks_per_row = max_blocks_per_row
        # Pinned where there is a device, so the per-step mirror copy runs asynchronously.
        host = torch.zeros((max_num_rows, max_blocks_per_row), dtype=torch.int32, pin_memory=pin_memory)
        self._host = host
        self.table = host.numpy()
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

    def mirror(self, device_table: torch.Tensor, num_rows: int) -> None:
        """Copy rows 0..num_rows-1 (the columns in use) into the device's block-table buffer."""
        width = int(self.num_blocks[:num_rows].max()) if num_rows else 0
        if not width:
            return
        if device_table.is_cpu:
            # Through numpy: a torch copy costs more in dispatch than the few rows it moves.
            device_table.numpy()[:num_rows, :width] = self.table[:num_rows, :width]
        else:
            device_table[:num_rows, :width].copy_(self._host[:num_rows, :width], non_blocking=True)
