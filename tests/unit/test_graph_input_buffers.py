"""Static input buffers: allocated once, written in place, padded harmlessly, watched for moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.graphs.dispatcher import BatchDescriptor
from worker.graphs.input_buffers import AddressRecord, GraphAddressError, StaticInputBuffers, StepShape

CPU = torch.device("cpu")


def buffers_with_step(n: int = 5, r: int = 2) -> StaticInputBuffers:
    buffers = StaticInputBuffers(max_num_tokens=32, max_num_reqs=8, max_blocks_per_req=4, device=CPU)
    buffers.write(
        StepShape(num_tokens=n, num_reqs=r, max_query_len=n - r + 1, max_seq_len=20),
        input_ids=np.arange(100, 100 + n),
        positions=np.arange(n),
        slot_mapping=np.arange(40, 40 + n),
        query_start_loc=np.array([0, *range(n - r + 1, n + 1)], dtype=np.int32),
        seq_lens=np.full(r, 20, dtype=np.int32),
        block_table=np.arange(3 * r, dtype=np.int32).reshape(r, 3),
        logits_indices=np.arange(n - r, n),
    )
    return buffers


def test_write_fills_the_first_rows_in_place() -> None:
    buffers = buffers_with_step()
    before = {name: t.data_ptr() for name, t in buffers.named_tensors().items()}
    assert buffers.input_ids[:5].tolist() == [100, 101, 102, 103, 104]
    assert buffers.block_table[0, :2, :3].flatten().tolist() == list(range(6))
    assert buffers.query_start_loc[:3].tolist() == [0, 4, 5]
    # A second step writes into the same tensors.
    buffers.write(
        StepShape(2, 2, 1, 9),
        input_ids=torch.tensor([7, 8]),
        positions=torch.tensor([3, 4]),
        slot_mapping=torch.tensor([1, 2]),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([4, 5], dtype=torch.int32),
        block_table=torch.zeros(2, 4, dtype=torch.int32),
        logits_indices=torch.tensor([0, 1]),
    )
    assert {name: t.data_ptr() for name, t in buffers.named_tensors().items()} == before
    assert buffers.input_ids[:3].tolist() == [7, 8, 102]


def test_metadata_views_share_storage_with_the_buffers() -> None:
    buffers = buffers_with_step()
    (meta,) = buffers.step_metadata()
    assert (meta.num_tokens, meta.num_seqs, meta.max_query_len, meta.max_seq_len) == (5, 2, 4, 20)
    for view, name in [
        (meta.slot_mapping, "slot_mapping"),
        (meta.query_start_loc, "query_start_loc"),
        (meta.seq_lens, "seq_lens"),
        (meta.block_table, "block_table"),
    ]:
        buffer = getattr(buffers, name)
        if name in ("slot_mapping", "block_table"):
            buffer = buffer[0]
        assert view.data_ptr() == buffer.data_ptr(), name
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), name
    buffers.seq_lens[0] = 99
    assert meta.seq_lens[0] == 99


def test_padded_tokens_get_slot_minus_one_and_padded_requests_are_empty() -> None:
    buffers = buffers_with_step(n=5, r=5)
    buffers.pad(BatchDescriptor(8, 8, True))
    assert buffers.slot_mapping[0, :8].tolist() == [40, 41, 42, 43, 44, -1, -1, -1]
    assert buffers.query_start_loc[:9].tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]
    assert buffers.seq_lens[:8].tolist() == [20] * 5 + [0, 0, 0]


def test_piecewise_padding_touches_tokens_but_not_requests() -> None:
    buffers = buffers_with_step(n=5, r=2)
    buffers.seq_lens[2:].fill_(7)
    buffers.pad(BatchDescriptor(8, None, False))
    assert buffers.slot_mapping[0, 5:8].tolist() == [-1, -1, -1]
    assert buffers.seq_lens[2:].tolist() == [7] * 6


def test_fresh_slot_mapping_is_all_padding() -> None:
    buffers = StaticInputBuffers(8, 2, 1, CPU)
    assert (buffers.slot_mapping == -1).all()


def test_address_record_passes_for_the_same_tensors_and_raises_when_one_moved() -> None:
    buffers = buffers_with_step()
    record = AddressRecord(buffers.named_tensors())
    record.check(buffers.named_tensors())
    buffers.input_ids[:3] = 0
    record.check(buffers.named_tensors())
    buffers.positions = torch.zeros_like(buffers.positions)
    with pytest.raises(GraphAddressError, match="positions"):
        record.check(buffers.named_tensors())


def test_address_record_notices_a_missing_tensor() -> None:
    buffers = buffers_with_step()
    record = AddressRecord(buffers.named_tensors())
    tensors = buffers.named_tensors()
    del tensors["seq_lens"]
    with pytest.raises(GraphAddressError):
        record.check(tensors)


def test_step_larger_than_the_buffers_is_refused() -> None:
    buffers = StaticInputBuffers(4, 2, 1, CPU)
    with pytest.raises(AssertionError):
        buffers.set_shape(StepShape(num_tokens=5, num_reqs=1, max_query_len=5, max_seq_len=5))
    with pytest.raises(AssertionError):
        buffers.set_shape(StepShape(num_tokens=3, num_reqs=3, max_query_len=1, max_seq_len=5))
