"""The C++ paged-attention backend against the slow reference, on random paged caches."""

from __future__ import annotations

import pytest
import torch

from paged_attention_cases import Case, make_case
from reference_attention import ReferenceAttentionBackend
from worker.attention.cpu_backend import CpuAttentionBackend


def run_both(
    case: Case, scale: float = 0.125, decode_path: bool = True
) -> tuple[torch.Tensor, torch.Tensor, Case, Case]:
    ours = Case(
        **{**case.__dict__, "key_cache": case.key_cache.clone(), "value_cache": case.value_cache.clone()}
    )
    ref = Case(
        **{**case.__dict__, "key_cache": case.key_cache.clone(), "value_cache": case.value_cache.clone()}
    )
    got = CpuAttentionBackend(decode_path=decode_path).forward(
        ours.query, ours.key, ours.value, ours.key_cache, ours.value_cache, ours.metadata, scale
    )
    want = ReferenceAttentionBackend().forward(
        ref.query, ref.key, ref.value, ref.key_cache, ref.value_cache, ref.metadata, scale
    )
    return got, want, ours, ref


# Prefill chunks that start mid-sequence, a fresh prefill, and decodes; no length a multiple of 16.
MIXED = [(37, 37), (70, 19), (5, 1), (130, 1), (200, 33), (17, 1), (1, 1), (99, 60)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3])
def test_mixed_batch_matches_reference(dtype: torch.dtype, head_dim: int, group: int) -> None:
    case = make_case(MIXED, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    got, want, ours, ref = run_both(case)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(ours.key_cache, ref.key_cache)
    assert torch.equal(ours.value_cache, ref.value_cache)


@pytest.mark.parametrize("block_size", [1, 7, 32])
def test_block_sizes_that_split_or_span_chunks(block_size: int) -> None:
    case = make_case(MIXED, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32, block_size=block_size)
    got, want, _, _ = run_both(case)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dims_that_are_not_a_multiple_of_64(dtype: torch.dtype, head_dim: int) -> None:
    case = make_case(MIXED, num_kv_heads=1, group=4, head_dim=head_dim, dtype=dtype)
    got, want, _, _ = run_both(case)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_long_fresh_prefill_and_many_decodes() -> None:
    seqs = [(300, 300)] + [(40 + 7 * i, 1) for i in range(40)]
    case = make_case(seqs, num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16, seed=3)
    got, want, _, _ = run_both(case)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fill", [float("nan"), 1e30])
def test_slots_outside_the_table_do_not_leak_in(fill: float) -> None:
    case = make_case(MIXED, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32, fill=fill)
    got, want, _, _ = run_both(case)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_new_rows_land_in_their_slots_and_nowhere_else() -> None:
    case = make_case([(21, 4), (9, 1)], num_kv_heads=2, group=1, head_dim=64, dtype=torch.bfloat16)
    before_k, before_v = case.key_cache.clone(), case.value_cache.clone()
    CpuAttentionBackend().forward(
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


def test_strided_query_and_key_views_are_read_correctly() -> None:
    case = make_case(MIXED, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32)
    # The model slices q, k and v out of one fused projection, so they arrive as strided views.
    qkv = torch.cat([case.query, case.key, case.value], dim=1)
    case.query, case.key, case.value = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    got, want, _, _ = run_both(case)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_negative_slots_are_skipped() -> None:
    case = make_case([(10, 3)], num_kv_heads=1, group=1, head_dim=64, dtype=torch.float32)
    before = case.key_cache.clone()
    from worker.native_ops import load_native_ops

    padded = torch.full_like(case.metadata.slot_mapping, -1)
    load_native_ops().write_kv_cache(case.key, case.value, case.key_cache, case.value_cache, padded)
    assert torch.equal(case.key_cache, before)


# Decode-only batches: contexts below, at and past one 256-key segment, none a multiple of 16 but one.
DECODES = [(1, 1), (15, 1), (16, 1), (130, 1), (256, 1), (257, 1), (600, 1)]


# decode_path False is the off switch (--no-cpu-decode-attention): decodes on the general tile path.
@pytest.mark.parametrize("decode_path", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("group", [1, 3, 5])
def test_decode_rows_match_reference_with_poisoned_spare_slots(
    dtype: torch.dtype, head_dim: int, group: int, decode_path: bool
) -> None:
    case = make_case(
        DECODES, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=7, fill=float("nan")
    )
    got, want, _, _ = run_both(case, decode_path=decode_path)
    assert torch.isfinite(got.float()).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_single_token_tail_of_a_prefill_chunk_is_causal() -> None:
    # 3 query heads per kv head make 16-token tiles, so 33 new tokens leave a 1-token tile at the end.
    case = make_case(
        [(90, 33), (300, 17)], num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16, seed=5
    )
    got, want, _, _ = run_both(case)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
