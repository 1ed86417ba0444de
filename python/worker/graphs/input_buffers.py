"""The step inputs that graphs read, in device tensors allocated once at their largest size.

A captured graph reads its inputs from the addresses it saw at capture, so every step writes its
inputs into the first rows of these same tensors and never rebinds them. Rows past the step's
batch are padding: `pad` makes them harmless (slot -1 writes no KV; a padded request has no
query tokens and no context, so attention skips it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from worker.attention.backend import AttentionMetadata
from worker.graphs.dispatcher import BatchDescriptor

# Checks, before every replay, that no buffer a graph reads has moved (costs a few microseconds).
DEBUG_GRAPHS = os.environ.get("SLUICE_DEBUG_GRAPHS") == "1"

PAD_SLOT = -1


class GraphAddressError(RuntimeError):
    """A tensor that a captured graph reads is no longer at the address the graph was captured on."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """The real (unpadded) extent of the step written into the buffers."""

    num_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int

    def batch_descriptor(self) -> BatchDescriptor:
        return BatchDescriptor.of_step(self.num_tokens, self.num_reqs)


class StaticInputBuffers:
    """input_ids, positions [max_num_tokens]; query_start_loc [max_num_reqs + 1]; seq_lens, logits_indices
    [max_num_reqs]; and per KV cache group (sluice/kv_cache_groups.py): slot_mapping [num_kv_groups,
    max_num_tokens], block_table [num_kv_groups, max_num_reqs, max_blocks_per_req]."""

    NAMES = (
        "input_ids",
        "positions",
        "slot_mapping",
        "query_start_loc",
        "seq_lens",
        "block_table",
        "logits_indices",
    )

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: torch.device,
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.device = device

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_num_tokens, dtype=torch.int64)
        self.positions = zeros(max_num_tokens, dtype=torch.int64)
        self.slot_mapping = torch.full(
            (num_kv_groups, max_num_tokens), PAD_SLOT, dtype=torch.int64, device=device
        )
        self.query_start_loc = zeros(max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = zeros(max_num_reqs, dtype=torch.int32)
        self.block_table = zeros(num_kv_groups, max_num_reqs, max_blocks_per_req, dtype=torch.int32)
        self.logits_indices = zeros(max_num_reqs, dtype=torch.int64)
        self.shape: StepShape | None = None

    def set_shape(self, shape: StepShape) -> None:
        """Declare the step whose inputs were written into the first rows of the buffers."""
        assert 1 <= shape.num_reqs <= min(shape.num_tokens, self.max_num_reqs), shape
        assert shape.num_tokens <= self.max_num_tokens, shape
        self.shape = shape

    def write(
        self,
        shape: StepShape,
        *,
        input_ids: torch.Tensor | np.ndarray,
        positions: torch.Tensor | np.ndarray,
        slot_mapping: torch.Tensor | np.ndarray,
        query_start_loc: torch.Tensor | np.ndarray,
        seq_lens: torch.Tensor | np.ndarray,
        block_table: torch.Tensor | np.ndarray,
        logits_indices: torch.Tensor | np.ndarray,
    ) -> None:
        """Copy one step's host (ideally pinned) or device arrays into the buffers, then set_shape.

        slot_mapping [num_kv_groups, n] and block_table [num_kv_groups, r, width] (a model of one group
        may leave the group out); block_table may be narrower than the buffer: only its columns are copied."""
        self.set_shape(shape)
        n, r = shape.num_tokens, shape.num_reqs
        groups = self.slot_mapping.shape[0]
        _copy_into(self.input_ids[:n], input_ids)
        _copy_into(self.positions[:n], positions)
        _copy_into(self.slot_mapping[:, :n], slot_mapping.reshape(groups, n))
        _copy_into(self.query_start_loc[: r + 1], query_start_loc)
        _copy_into(self.seq_lens[:r], seq_lens)
        width = block_table.shape[-1]
        _copy_into(self.block_table[:, :r, :width], block_table.reshape(groups, r, width))
        _copy_into(self.logits_indices[:r], logits_indices)

    def pad(self, padded: BatchDescriptor) -> None:
        """Make rows between the step's shape and `padded` harmless for a graph of that shape.

        Stale input_ids and positions stay: earlier steps wrote valid ids and positions there."""
        shape = self.shape
        assert shape is not None, "set_shape before pad"
        n, r = shape.num_tokens, shape.num_reqs
        assert padded.num_tokens >= n, (padded, shape)
        if padded.num_tokens > n:
            self.slot_mapping[:, n : padded.num_tokens].fill_(PAD_SLOT)
        if padded.num_reqs is not None and padded.num_reqs > r:
            assert padded.num_reqs <= self.max_num_reqs, padded
            # Padded requests start and end at the last real token: no query rows, no context.
            self.query_start_loc[r + 1 : padded.num_reqs + 1].fill_(n)
            self.seq_lens[r : padded.num_reqs].fill_(0)

    def metadata(
        self, num_tokens: int, num_reqs: int, max_query_len: int, max_seq_len: int
    ) -> list[AttentionMetadata]:
        """Each KV cache group's attention metadata over the first rows: views, so a graph captured on them
        reads later steps."""
        return [
            AttentionMetadata(
                num_tokens=num_tokens,
                num_seqs=num_reqs,
                slot_mapping=slot_mapping[:num_tokens],
                query_start_loc=self.query_start_loc[: num_reqs + 1],
                seq_lens=self.seq_lens[:num_reqs],
                block_table=block_table[:num_reqs],
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
            )
            for slot_mapping, block_table in zip(self.slot_mapping, self.block_table, strict=True)
        ]

    def step_metadata(self) -> list[AttentionMetadata]:
        """The metadata of the step set by set_shape, unpadded: for eager attention."""
        shape = self.shape
        assert shape is not None, "set_shape before step_metadata"
        return self.metadata(shape.num_tokens, shape.num_reqs, shape.max_query_len, shape.max_seq_len)

    def fill_dummy(self, num_tokens: int, num_reqs: int) -> None:
        """A capture-time batch that touches nothing: valid ids at position 0, no KV writes, and
        requests with no query rows and no context."""
        self.input_ids[:num_tokens].zero_()
        self.positions[:num_tokens].zero_()
        self.slot_mapping[:, :num_tokens].fill_(PAD_SLOT)
        self.query_start_loc[: num_reqs + 1].zero_()
        self.seq_lens[:num_reqs].zero_()
        self.shape = None

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.NAMES}


class AddressRecord:
    """The data pointers of the tensors a graph reads, saved at capture and compared at replay."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._addresses = {name: t.data_ptr() for name, t in tensors.items()}

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        moved = [
            f"{name} ({self._addresses[name]:#x} -> {t.data_ptr():#x})"
            for name, t in tensors.items()
            if self._addresses.get(name) != t.data_ptr()
        ]
        if moved or tensors.keys() != self._addresses.keys():
            raise GraphAddressError(
                "a captured graph would read stale memory: moved since capture: "
                + (", ".join(moved) or f"names differ: {sorted(tensors)} vs {sorted(self._addresses)}")
            )


def _copy_into(dst: torch.Tensor, src: torch.Tensor | np.ndarray) -> None:
    if isinstance(src, np.ndarray):
        src = torch.from_numpy(src)
    assert src.shape == dst.shape, (tuple(src.shape), tuple(dst.shape))
    dst.copy_(src, non_blocking=True)
