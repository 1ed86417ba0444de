"""An encoder's attention kernel (attention_within_sequences), at every tier this CPU runs, against the
softmax of each sequence's scores written out in float64, one sequence and one head at a time."""

from __future__ import annotations

import pytest
import torch

from worker.native_ops import NativeKernelError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Sequence lengths of one step: empty, one token, a block of query rows and one more (6 and 12 rows are
# the AVX2 and AVX-512 blocks), a tail of keys past a whole key tile, and a long one.
LENGTHS = [0, 1, 6, 7, 12, 13, 33, 300, 5]


@pytest.fixture(scope="module")
def ops(native):
    return native


def starts_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float
) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        for h in range(q.shape[1]):
            scores = q[rows, h].double() @ k[rows, h // group].double().T * scale
            out[rows, h] = scores.softmax(-1) @ v[rows, h // group].double()
        start += n
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 16), (3, 3, 32), (2, 2, 80), (4, 2, 64)])
def test_each_row_attends_to_all_of_its_own_sequence(ops, dtype, heads, kv_heads, head_dim):
    torch.manual_seed(heads * head_dim)
    tokens = sum(LENGTHS)
    # Views into one fused projection's output, as an encoder layer passes them: strided rows.
    qkv = torch.randn(tokens + 3, heads + 2 * kv_heads, head_dim, dtype=dtype) * 2
    q, k, v = qkv[:tokens].split([heads, kv_heads, kv_heads], dim=1)
    scale = head_dim**-0.5
    ours = ops.attention_within_sequences(q, k, v, starts_of(LENGTHS), len(LENGTHS), scale)
    expected = reference(q, k, v, LENGTHS, scale)
    assert ours.shape == q.shape and ours.dtype == dtype
    # float32 throughout; a half type's rounding of the result (values below 4 in magnitude).
    tolerance = 2e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    assert (ours.double() - expected).abs().max().item() <= tolerance


def test_a_sequence_sees_nothing_of_its_neighbours(ops):
    torch.manual_seed(3)
    q, k, v = torch.randn(3, 20, 2, 16).unbind(0)
    lengths = [8, 12]
    together = ops.attention_within_sequences(q, k, v, starts_of(lengths), 2, 0.25)
    alone = ops.attention_within_sequences(q[8:], k[8:], v[8:], starts_of([12]), 1, 0.25)
    assert torch.equal(together[8:], alone)


def test_bad_shapes_are_refused(ops):
    q = torch.randn(4, 2, 16)
    with pytest.raises(NativeKernelError, match="multiple of 16"):
        ops.attention_within_sequences(*(torch.randn(4, 2, 8) for _ in range(3)), starts_of([4]), 1, 1.0)
    with pytest.raises(NativeKernelError, match="query_start_loc"):
        ops.attention_within_sequences(q, q, q, starts_of([4]), 2, 1.0)
    with pytest.raises(NativeKernelError, match="query rows"):
        ops.attention_within_sequences(q, q, q, starts_of([5]), 1, 1.0)
    with pytest.raises(NativeKernelError, match="num_kv_heads"):
        ops.attention_within_sequences(
            q, torch.randn(4, 3, 16), torch.randn(4, 3, 16), starts_of([4]), 1, 1.0
        )
