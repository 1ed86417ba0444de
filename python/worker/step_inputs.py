"""Writes one step's model inputs into the static input buffers.

Only per-row counters cross from the host (tokens already computed and tokens scheduled, plus the
block-table rows); the per-token arrays (input ids, positions, slot mapping) are built from them,
gathering input ids from the persistent batch's token table, where the previous step's sampled ids
already sit. On an accelerator they are built on the device. On CPU the device is the host: they are
built with numpy over the buffers' own memory, since each of the two dozen small torch ops would cost
about 20 us of dispatch, a twentieth of a small model's decode step.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.graphs.input_buffers import StaticInputBuffers, StepShape
from worker.input_batch import InputBatch


class StepInputBuilder:
    def __init__(self, buffers: StaticInputBuffers, block_size: int) -> None:
        self.buffers = buffers
        self.block_size = block_size
        device = buffers.device
        self.on_host = device.type == "cpu"
        self._arange = torch.arange(buffers.max_num_tokens, dtype=torch.int64, device=device)
        self._computed = torch.zeros(buffers.max_num_reqs, dtype=torch.int64, device=device)
        self._num_scheduled = torch.zeros(buffers.max_num_reqs, dtype=torch.int64, device=device)

    def build(self, batch: InputBatch, num_scheduled: np.ndarray) -> StepShape:
        """num_scheduled[i]: the tokens row i computes this step (every row 0..len-1 is scheduled)."""
        num_reqs = len(num_scheduled)
        computed = batch.num_computed_tokens[:num_reqs]
        seq_lens = computed + num_scheduled
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if self.on_host:
            self._write_on_host(batch, num_scheduled, computed, seq_lens, query_start_loc)
        else:
            self._write_on_device(batch, num_scheduled, computed, seq_lens, query_start_loc)
        shape = StepShape(
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
        )
        self.buffers.set_shape(shape)
        return shape

    def _write_on_host(
        self,
        batch: InputBatch,
        num_scheduled: np.ndarray,
        computed: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> None:
        buffers = self.buffers
        num_reqs, num_tokens = len(num_scheduled), int(query_start_loc[-1])
        buffers.query_start_loc.numpy()[: num_reqs + 1] = query_start_loc
        buffers.seq_lens.numpy()[:num_reqs] = seq_lens
        if num_tokens == num_reqs:
            # Pure decode: one token per row, so every array is per row already.
            rows = np.arange(num_reqs)
            positions = computed.astype(np.int64)
        else:
            rows = np.repeat(np.arange(num_reqs), num_scheduled)
            positions = np.arange(num_tokens) - query_start_loc[rows] + computed[rows]
        buffers.positions.numpy()[:num_tokens] = positions
        buffers.input_ids.numpy()[:num_tokens] = batch.token_ids.numpy()[rows, positions]
        offsets = positions % self.block_size
        block_columns = positions // self.block_size
        for table, device_table, slot_mapping in zip(
            batch.block_tables, buffers.block_table, buffers.slot_mapping, strict=True
        ):
            table.mirror(device_table, num_reqs)
            block_ids = table.table[rows, block_columns].astype(np.int64)
            slot_mapping.numpy()[:num_tokens] = block_ids * self.block_size + offsets
        buffers.logits_indices.numpy()[:num_reqs] = query_start_loc[1:] - 1

    def _write_on_device(
        self,
        batch: InputBatch,
        num_scheduled: np.ndarray,
        computed: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> None:
        buffers = self.buffers
        num_reqs, num_tokens = len(num_scheduled), int(query_start_loc[-1])

        # Per-row values up to the device.
        buffers.query_start_loc[: num_reqs + 1].copy_(torch.from_numpy(query_start_loc), non_blocking=True)
        buffers.seq_lens[:num_reqs].copy_(torch.from_numpy(seq_lens), non_blocking=True)
        for table, device_table in zip(batch.block_tables, buffers.block_table, strict=True):
            table.mirror(device_table, num_reqs)
        computed_dev = self._computed[:num_reqs]
        computed_dev.copy_(torch.from_numpy(computed), non_blocking=True)

        # Per-token values built on the device.
        positions = buffers.positions[:num_tokens]
        if num_tokens == num_reqs:
            # Pure decode: one token per row, so every array is per row already.
            rows = self._arange[:num_reqs]
            positions.copy_(computed_dev)
        else:
            scheduled_dev = self._num_scheduled[:num_reqs]
            scheduled_dev.copy_(torch.from_numpy(num_scheduled), non_blocking=True)
            rows = torch.repeat_interleave(self._arange[:num_reqs], scheduled_dev, output_size=num_tokens)
            starts = buffers.query_start_loc[:num_reqs].to(torch.int64)
            torch.sub(self._arange[:num_tokens], starts[rows], out=positions)
            positions.add_(computed_dev[rows])
        buffers.input_ids[:num_tokens] = batch.token_ids[rows, positions]
        offsets = positions % self.block_size
        block_columns = positions // self.block_size
        for block_table, slot_mapping in zip(buffers.block_table, buffers.slot_mapping, strict=True):
            block_ids = block_table[rows, block_columns].to(torch.int64)
            torch.add(offsets, block_ids * self.block_size, out=slot_mapping[:num_tokens])
        torch.sub(
            buffers.query_start_loc[1 : num_reqs + 1].to(torch.int64),
            1,
            out=buffers.logits_indices[:num_reqs],
        )
