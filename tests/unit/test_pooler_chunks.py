"""worker/pooler.py over a prompt chunked across steps whose hidden states live in one reused buffer, as
CUDA graphs leave them (the buffer is rewritten by the next step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.sampling_params import SamplingParams
from worker.pooler import Pooler
from worker.request_state import RequestState


@pytest.mark.parametrize(
    ("method", "expected"), [("cls", [1.0, 2.0]), ("mean", [3.0, 4.0]), ("last", [5.0, 6.0])]
)
def test_a_chunked_prompt_pools_what_each_step_computed(method, expected):
    state = RequestState("r", [7, 8, 9], [], SamplingParams(), [], 0)
    buffer = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    pooler = Pooler(method)
    assert pooler.pool(buffer[:2], [state], np.array([0]), np.array([2])) == [None]
    # The next step overwrites the buffer in place: positions 0 and 1 must already be held by the pooler.
    buffer.copy_(torch.tensor([[5.0, 6.0], [-1.0, -1.0]]))
    (vector,) = pooler.pool(buffer[:1], [state], np.array([2]), np.array([1]))
    assert vector is not None
    assert np.frombuffer(vector, dtype="<f4").tolist() == expected
    assert not pooler.partial
