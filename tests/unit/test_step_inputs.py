"""A step's model inputs, written by StepInputBuilder: built with numpy on CPU (the host path), with torch ops
elsewhere (the device path, which runs on CPU tensors too); both against values worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.sampling_params import SamplingParams
from worker.graphs.input_buffers import StaticInputBuffers
from worker.input_batch import InputBatch
from worker.request_state import RequestState
from worker.sampling_state import SamplingState
from worker.step_inputs import StepInputBuilder

CPU = torch.device("cpu")
BLOCK_SIZE = 4
MAX_MODEL_LEN = 32


def batch_of(groups: int) -> InputBatch:
    """Row 0: 10 prompt tokens, 6 computed (a chunk of 4 to go); row 1: 5 tokens, 4 computed (a decode);
    row 2: 3 tokens, none computed (a whole prompt). Each group's block ids differ."""
    batch = InputBatch(4, MAX_MODEL_LEN, BLOCK_SIZE, SamplingState(4, 1000, CPU), CPU, groups)
    rows = [
        (list(range(100, 110)), 6, [7, 3, 9]),
        (list(range(200, 205)), 4, [5, 1]),
        ([300, 301, 302], 0, [8]),
    ]
    for i, (tokens, computed, blocks) in enumerate(rows):
        block_ids = [[b + 10 * g for b in blocks] for g in range(groups)]
        batch.add(RequestState(f"r{i}", tokens, [], SamplingParams(), block_ids, computed))
    return batch


def build(on_host: bool, groups: int, num_scheduled: list[int]) -> StaticInputBuffers:
    buffers = StaticInputBuffers(32, 4, MAX_MODEL_LEN // BLOCK_SIZE, CPU, groups)
    builder = StepInputBuilder(buffers, BLOCK_SIZE)
    builder.on_host = on_host
    shape = builder.build(batch_of(groups), np.array(num_scheduled, dtype=np.int32))
    assert (shape.num_tokens, shape.num_reqs) == (sum(num_scheduled), len(num_scheduled))
    return buffers


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("groups", [1, 2])
def test_a_mixed_step_gets_the_tokens_positions_and_slots_worked_out_by_hand(
    on_host: bool, groups: int
) -> None:
    buffers = build(on_host, groups, [4, 1, 3])
    assert buffers.input_ids[:8].tolist() == [106, 107, 108, 109, 204, 300, 301, 302]
    assert buffers.positions[:8].tolist() == [6, 7, 8, 9, 4, 0, 1, 2]
    assert buffers.query_start_loc[:4].tolist() == [0, 4, 5, 8]
    assert buffers.seq_lens[:3].tolist() == [10, 5, 3]
    assert buffers.logits_indices[:3].tolist() == [3, 4, 7]
    for g in range(groups):
        # Position p of a row sits in its block p // 4 at offset p % 4.
        blocks = [b + 10 * g for b in (3, 3, 9, 9)], [1 + 10 * g], [8 + 10 * g] * 3
        offsets = [2, 3, 0, 1], [0], [0, 1, 2]
        expected = [b * BLOCK_SIZE + o for bs, os in zip(blocks, offsets) for b, o in zip(bs, os)]
        assert buffers.slot_mapping[g, :8].tolist() == expected
        assert buffers.block_table[g, 0, :3].tolist() == [7 + 10 * g, 3 + 10 * g, 9 + 10 * g]


@pytest.mark.parametrize("num_scheduled", [[4, 1, 3], [1, 1, 1], [2, 1, 1]])
def test_the_host_path_writes_what_the_device_path_writes(num_scheduled: list[int]) -> None:
    host, device = build(True, 2, num_scheduled), build(False, 2, num_scheduled)
    for name, tensor in host.named_tensors().items():
        assert torch.equal(tensor, device.named_tensors()[name]), name


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
def test_a_decode_step_reads_the_tokens_the_last_step_sampled(on_host: bool) -> None:
    batch = batch_of(1)
    batch.num_computed_tokens[:3] = [10, 5, 3]
    batch.append_sampled([0, 2], torch.tensor([11, 22]))
    batch.append_sampled([1], torch.tensor([33]))
    assert batch.num_tokens[:3].tolist() == [11, 6, 4]
    buffers = StaticInputBuffers(32, 4, MAX_MODEL_LEN // BLOCK_SIZE, CPU)
    builder = StepInputBuilder(buffers, BLOCK_SIZE)
    builder.on_host = on_host
    builder.build(batch, np.ones(3, dtype=np.int32))
    assert buffers.input_ids[:3].tolist() == [11, 33, 22]
    assert buffers.positions[:3].tolist() == [10, 5, 3]
