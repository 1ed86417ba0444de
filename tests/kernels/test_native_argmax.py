"""The C++ greedy pick (argmax_rows) against torch.argmax(dim=-1): the same index for every row, ties,
infinities and NaNs included, and the sampler's greedy rows take it when KernelConfig.native_argmax is on."""

from __future__ import annotations

import pytest
import torch

from sluice.sampling_params import SamplingParams
from worker.sampler import Sampler, native_argmax, torch_argmax
from worker.sampling_state import SamplingState

INF, NAN = float("inf"), float("nan")


@pytest.fixture(scope="module")
def ops(native):
    return native


@pytest.mark.parametrize(("rows", "width"), [(1, 1), (3, 15), (5, 16), (7, 33), (64, 49152), (2, 1000)])
def test_random_rows_pick_as_torch_does(ops, rows: int, width: int) -> None:
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * width))
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_infinities_and_nans_pick_as_torch_does(ops) -> None:
    logits = torch.zeros(8, 70)
    logits[0, [5, 40, 69]] = 3.0  # equal maxima in two vector lanes and the tail: the first
    logits[1, [20, 4]] = 2.0  # a later lane's maximum before an earlier lane's
    logits[2] = -INF  # nothing but -inf: index 0
    logits[3, 66] = INF  # +inf in the tail
    logits[4, [50, 9]] = NAN  # NaNs win, the first of them
    logits[5, 69] = NAN  # a NaN in the tail only
    logits[6, :] = -INF
    logits[6, 68] = -1.0
    logits[7, [1, 17, 33, 49, 65]] = 1.0  # one maximum per lane, the same value
    expected = [5, 4, 0, 66, 9, 69, 68, 1]
    assert logits.argmax(dim=-1).tolist() == expected
    assert ops.argmax_rows(logits).tolist() == expected


def test_rows_need_not_be_adjacent(ops) -> None:
    wide = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    view = wide[:, 7:250]
    assert torch.equal(ops.argmax_rows(view), view.argmax(dim=-1))


def test_bad_input_is_refused(ops) -> None:
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="non-empty"):
        ops.argmax_rows(torch.zeros(2, 0))


def test_greedy_rows_of_the_sampler_take_the_kernels_pick(ops) -> None:
    kernel = native_argmax(ops)
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(9))
    logits[1, [90, 10]] = 50.0
    state = SamplingState(4, 100, torch.device("cpu"))
    for row in range(4):
        # Rows 0 and 1 greedy, 2 and 3 random (seeded): greedy rows of a mixed batch take the argmax too.
        state.add(row, SamplingParams(temperature=0.0 if row < 2 else 1.0, seed=row), [1], [])
    for rows in (2, 4):
        with_kernel = Sampler(argmax=kernel).sample(logits[:rows].clone(), state.metadata(rows))
        with_torch = Sampler(argmax=torch_argmax).sample(logits[:rows].clone(), state.metadata(rows))
        assert with_kernel.token_ids.tolist() == with_torch.token_ids.tolist()
        assert with_kernel.token_ids[:2].tolist() == logits[:2].argmax(dim=-1).tolist()
        assert with_kernel.token_ids[1].item() == 10
    # bf16 logits are not the kernel's: they go to torch.argmax.
    assert kernel(logits.bfloat16()).tolist() == logits.bfloat16().argmax(dim=-1).tolist()
