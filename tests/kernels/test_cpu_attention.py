"""The paged-attention kernels, at every tier this CPU runs, against torch's attention on random paged caches."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from paged_attention_cases import Case, attend, make_case
from worker.attention.cpu_backend import CpuAttentionBackend
from worker.attention.torch_backend import TorchAttentionBackend


@pytest.fixture(scope="module")
def ops(native):
    return native


def run_both(
    ops,
    case: Case,
    scale: float = 0.125,
    decode_path: bool = True,
    split_keys: bool = True,
    window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, Case, Case]:
    ours = Case(
        **{**case.__dict__, "key_cache": case.key_cache.clone(), "value_cache": case.value_cache.clone()}
    )
    ref = Case(
        **{**case.__dict__, "key_cache": case.key_cache.clone(), "value_cache": case.value_cache.clone()}
    )
    got = attend(
        CpuAttentionBackend(ops, decode_path=decode_path, split_keys=split_keys), ours, scale, window, softcap
    )
    want = attend(TorchAttentionBackend(), ref, scale, window, softcap)
    return got, want, ours, ref


# Prefill chunks that start mid-sequence, a fresh prefill, and decodes; no length a multiple of 16.
MIXED = [(37, 37), (70, 19), (5, 1), (130, 1), (200, 33), (17, 1), (1, 1), (99, 60)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3])
def test_mixed_batch_matches_reference(ops, dtype: torch.dtype, head_dim: int, group: int) -> None:
    case = make_case(MIXED, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    got, want, ours, ref = run_both(ops, case)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(ours.key_cache, ref.key_cache)
    assert torch.equal(ours.value_cache, ref.value_cache)


@pytest.mark.parametrize("block_size", [1, 7, 32])
def test_block_sizes_that_split_or_span_chunks(ops, block_size: int) -> None:
    case = make_case(MIXED, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32, block_size=block_size)
    got, want, _, _ = run_both(ops, case)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dims_that_are_not_a_multiple_of_64(ops, dtype: torch.dtype, head_dim: int) -> None:
    case = make_case(MIXED, num_kv_heads=1, group=4, head_dim=head_dim, dtype=dtype)
    got, want, _, _ = run_both(ops, case)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_long_fresh_prefill_and_many_decodes(ops) -> None:
    seqs = [(300, 300)] + [(40 + 7 * i, 1) for i in range(40)]
    case = make_case(seqs, num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16, seed=3)
    got, want, _, _ = run_both(ops, case)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fill", [float("nan"), 1e30])
def test_slots_outside_the_table_do_not_leak_in(ops, fill: float) -> None:
    case = make_case(MIXED, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32, fill=fill)
    got, want, _, _ = run_both(ops, case)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_new_rows_land_in_their_slots_and_nowhere_else(ops) -> None:
    case = make_case([(21, 4), (9, 1)], num_kv_heads=2, group=1, head_dim=64, dtype=torch.bfloat16)
    before_k, before_v = case.key_cache.clone(), case.value_cache.clone()
    CpuAttentionBackend(ops).forward(
        case.query, case.key, case.value, case.key_cache, case.value_cache, case.metadata, 0.125
    )
    slots = case.metadata.slot_mapping
    flat_k = case.key_cache.view(-1, 2, 64)
    flat_v = case.value_cache.view(-1, 2, 64)
    assert torch.equal(flat_k[slots], case.key)
    assert torch.equal(flat_v[slots], case.value)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, 64)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, 2, 64)[untouched])


def test_strided_query_and_key_views_are_read_correctly(ops) -> None:
    case = make_case(MIXED, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32)
    # The model slices q, k and v out of one fused projection, so they arrive as strided views.
    qkv = torch.cat([case.query, case.key, case.value], dim=1)
    case.query, case.key, case.value = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    got, want, _, _ = run_both(ops, case)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_negative_slots_are_skipped(ops) -> None:
    case = make_case([(10, 3)], num_kv_heads=1, group=1, head_dim=64, dtype=torch.float32)
    before = case.key_cache.clone()
    padded = torch.full_like(case.metadata.slot_mapping, -1)
    ops.write_kv_cache(case.key, case.value, case.key_cache, case.value_cache, padded)
    assert torch.equal(case.key_cache, before)


# Decode-only batches: contexts below, at and past one 256-key segment, none a multiple of 16 but one.
DECODES = [(1, 1), (15, 1), (16, 1), (130, 1), (256, 1), (257, 1), (600, 1)]


# decode_path False is the off switch (--no-cpu-decode-attention): decodes on the general tile path.
@pytest.mark.parametrize("decode_path", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("group", [1, 3, 5])
def test_decode_rows_match_reference_with_poisoned_spare_slots(
    ops, dtype: torch.dtype, head_dim: int, group: int, decode_path: bool
) -> None:
    case = make_case(
        DECODES, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=7, fill=float("nan")
    )
    got, want, _, _ = run_both(ops, case, decode_path=decode_path)
    assert torch.isfinite(got.float()).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Runs the test with torch (and the kernels' parallel_for) on `request.param` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# Few decodes with long contexts, so that the decode path splits their keys among the threads (parts of
# at least 512 keys): one sequence, or one with a prefill chunk beside it; none a multiple of 16.
FEW_LONG_DECODES = [[(1100, 1)], [(2999, 1)], [(1537, 1), (300, 45)], [(5000, 1), (700, 1), (90, 1)]]


@pytest.mark.parametrize("threads", [2, 3], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(1, 8), (3, 3)])
@pytest.mark.parametrize("seqs", FEW_LONG_DECODES)
def test_few_long_decodes_split_among_threads_match_reference(
    ops, threads: int, dtype: torch.dtype, num_kv_heads: int, group: int, seqs: list[tuple[int, int]]
) -> None:
    case = make_case(
        seqs, num_kv_heads=num_kv_heads, group=group, head_dim=64, dtype=dtype, seed=11, fill=float("nan")
    )
    split, want, _, _ = run_both(ops, case, split_keys=True)
    whole, _, _, _ = run_both(ops, case, split_keys=False)
    assert torch.isfinite(split.float()).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(split.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(whole.float(), want.float(), atol=tol, rtol=tol)
    # The rule: split where the decode items (sequences x KV heads) do not share out evenly among the
    # threads and are fewer than 4 a thread, for sequences with keys for 2 parts of 512 or more.
    decodes = [ctx for ctx, q_len in seqs if q_len == 1]
    items = len(decodes) * num_kv_heads
    splits = items % threads != 0 and items < 4 * threads and max(decodes) >= 1024
    if dtype == torch.float32:
        # The parts' merged sums round differently from one pass over the keys: whether the bits differ
        # shows whether the split ran (in bf16 and fp16 the output's rounding may hide it).
        assert torch.equal(split, whole) != splits


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_evenly_shared_or_short_decodes_are_not_split(ops, threads: int) -> None:
    # 2 sequences x 3 KV heads share out evenly on 2 threads; 1,000 keys make fewer than 2 parts of 512.
    for seqs, num_kv_heads in (([(3000, 1), (2500, 1)], 3), ([(1000, 1)], 3)):
        case = make_case(seqs, num_kv_heads=num_kv_heads, group=3, head_dim=64, dtype=torch.float32, seed=4)
        split, _, _, _ = run_both(ops, case, split_keys=True)
        whole, _, _, _ = run_both(ops, case, split_keys=False)
        assert torch.equal(split, whole)


def test_single_token_tail_of_a_prefill_chunk_is_causal(ops) -> None:
    # 3 query heads per kv head make 16-token tiles, so 33 new tokens leave a 1-token tile at the end.
    case = make_case(
        [(90, 33), (300, 17)], num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16, seed=5
    )
    got, want, _, _ = run_both(ops, case)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# Windows of one key, narrower than a 16-key chunk, than a prefill chunk and than most contexts; with
# decodes long enough that their windowed keys still split among the threads.
@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("window", [1, 7, 16, 50, 1100])
@pytest.mark.parametrize("decode_path", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_windows_match_reference(ops, threads: int, window: int, decode_path: bool, dtype) -> None:
    seqs = [*MIXED, (3000, 1), (1500, 1), (800, 200)]
    case = make_case(seqs, num_kv_heads=1, group=3, head_dim=64, dtype=dtype, seed=9, fill=float("nan"))
    got, want, _, _ = run_both(ops, case, decode_path=decode_path, window=window)
    assert torch.isfinite(got.float()).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    whole, _, _, _ = run_both(ops, case, decode_path=decode_path)
    # The window changed what the rows with more keys than it see.
    assert not torch.allclose(got.float(), whole.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("softcap", [0.5, 3.0])
@pytest.mark.parametrize("decode_path", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores_match_reference(
    ops, threads: int, softcap: float, decode_path: bool, dtype
) -> None:
    """Gemma 2's softcap * tanh(score / softcap), on prefill tiles, decodes and split decodes, with a window."""
    seqs = [*MIXED, (3000, 1), (800, 200)]
    case = make_case(seqs, num_kv_heads=1, group=3, head_dim=64, dtype=dtype, seed=12, fill=float("nan"))
    # A scale of 1 makes scores of several units, which the caps bend.
    got, want, _, _ = run_both(ops, case, scale=1.0, decode_path=decode_path, window=40, softcap=softcap)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    uncapped, _, _, _ = run_both(ops, case, scale=1.0, decode_path=decode_path, window=40)
    assert not torch.allclose(got.float(), uncapped.float(), atol=tol, rtol=tol)
