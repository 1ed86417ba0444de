"""The Triton paged-attention backend against the slow reference, on random paged caches.

With CUDA the tests run on the GPU. Without it they run in Triton's interpreter,
which triton.jit picks when the kernels module is imported, from TRITON_INTERPRET.
In a whole-suite pytest process that moment is not ours to control (and flipping
the variable there would leak into every other module), so on a CPU-only machine
this module runs itself in a child pytest process with TRITON_INTERPRET=1 set
from the start; the child then takes the RUN_HERE branch.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from paged_attention_cases import MIXED, Case, attend, make_case
from triton_interpreter import run_interpreted
from worker.attention.torch_backend import TorchAttentionBackend

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
RUN_HERE = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
here = pytest.mark.skipif(not RUN_HERE, reason="runs in the TRITON_INTERPRET=1 child process")
gpu_only = pytest.mark.skipif(not CUDA, reason="too large for Triton's interpreter")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def on_device(case: Case) -> Case:
    """A copy on DEVICE; the original is left for the reference, which runs on CPU."""
    m = case.metadata
    metadata = replace(
        m,
        slot_mapping=m.slot_mapping.to(DEVICE),
        query_start_loc=m.query_start_loc.to(DEVICE),
        seq_lens=m.seq_lens.to(DEVICE),
        block_table=m.block_table.to(DEVICE),
    )
    moved = {k: v.to(DEVICE, copy=True) for k, v in case.__dict__.items() if k != "metadata"}
    return Case(**moved, metadata=metadata)


def run_both(
    case: Case, scale: float = 0.125, window: int = 0, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, Case, Case]:
    from worker.attention.triton_backend import TritonAttentionBackend

    ours = on_device(case)
    ref = replace(case, key_cache=case.key_cache.clone(), value_cache=case.value_cache.clone())
    got = attend(TritonAttentionBackend(), ours, scale, window, softcap)
    want = attend(TorchAttentionBackend(), ref, scale, window, softcap)
    return got.cpu(), want, ours, ref


def assert_matches(
    case: Case, dtype: torch.dtype, window: int = 0, softcap: float = 0.0, scale: float = 0.125
) -> None:
    got, want, ours, ref = run_both(case, scale, window, softcap)
    tol = TOLERANCE[dtype]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # Bit-exact, and the NaN fill of unused slots must survive too.
    torch.testing.assert_close(ours.key_cache.cpu(), ref.key_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(ours.value_cache.cpu(), ref.value_cache, atol=0, rtol=0, equal_nan=True)


@pytest.mark.skipif(RUN_HERE, reason="the kernels run in this process")
def test_triton_kernels_under_interpreter() -> None:
    run_interpreted(__file__)


@pytest.mark.skipif(CUDA, reason="CUDA is present")
def test_cpu_tensors_without_interpreter_are_refused() -> None:
    from worker.attention.triton_backend import TritonAttentionBackend
    from worker.attention.triton_kernels import INTERPRETED

    if INTERPRETED:
        pytest.skip("the kernels were imported under the interpreter")
    case = make_case([(5, 2)], num_kv_heads=1, group=1, head_dim=16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        TritonAttentionBackend().forward(
            case.query, case.key, case.value, case.key_cache, case.value_cache, case.metadata, 0.25
        )


@here
def test_kernels_are_interpreted_when_no_gpu_is_present() -> None:
    from worker.attention.triton_kernels import INTERPRETED

    assert CUDA or INTERPRETED


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
def test_mixed_batch_matches_reference(dtype: torch.dtype, group: int) -> None:
    assert_matches(make_case(MIXED, num_kv_heads=2, group=group, head_dim=64, dtype=dtype), dtype)


@here
@pytest.mark.parametrize("block_size", [1, 7, 32])
def test_block_sizes_that_split_or_span_key_tiles(block_size: int) -> None:
    case = make_case(MIXED, num_kv_heads=2, group=3, head_dim=32, dtype=torch.float32, block_size=block_size)
    assert_matches(case, torch.float32)


@here
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float16, 80), (torch.bfloat16, 24)])
def test_head_dims_that_are_not_a_power_of_two(dtype: torch.dtype, head_dim: int) -> None:
    assert_matches(make_case(MIXED, num_kv_heads=1, group=4, head_dim=head_dim, dtype=dtype), dtype)


@here
def test_decode_only_batch() -> None:
    seqs = [(3 + 11 * i, 1) for i in range(9)]
    case = make_case(seqs, num_kv_heads=2, group=3, head_dim=64, dtype=torch.bfloat16, seed=2)
    assert_matches(case, torch.bfloat16)


@here
def test_long_fresh_prefill_spans_many_query_tiles() -> None:
    case = make_case([(150, 150), (40, 1)], num_kv_heads=1, group=3, head_dim=32, dtype=torch.float32, seed=3)
    assert_matches(case, torch.float32)


@here
@pytest.mark.parametrize("fill", [float("nan"), 1e30])
def test_slots_outside_the_table_do_not_leak_in(fill: float) -> None:
    case = make_case(MIXED, num_kv_heads=2, group=3, head_dim=32, dtype=torch.float32, fill=fill)
    assert_matches(case, torch.float32)


@here
def test_strided_query_and_key_views_are_read_correctly() -> None:
    from worker.attention.triton_backend import TritonAttentionBackend

    case = make_case(MIXED, num_kv_heads=2, group=3, head_dim=32, dtype=torch.float32)
    _, want, _, _ = run_both(case)
    ours = on_device(case)
    # The model slices q, k and v out of one fused projection, so they arrive as strided views.
    qkv = torch.cat([ours.query, ours.key, ours.value], dim=1)
    got = TritonAttentionBackend().forward(
        qkv[:, :6], qkv[:, 6:8], qkv[:, 8:], ours.key_cache, ours.value_cache, ours.metadata, 0.125
    )
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


@here
def test_new_rows_land_in_their_slots_and_negative_slots_are_skipped() -> None:
    from worker.attention.triton_backend import write_kv_cache

    case = on_device(make_case([(21, 4), (9, 2)], num_kv_heads=3, group=1, head_dim=16, dtype=torch.bfloat16))
    before_k, before_v = case.key_cache.clone(), case.value_cache.clone()
    slots = case.metadata.slot_mapping.clone()
    # A padded token (as CUDA-graph batches carry) has slot -1.
    slots[-1] = -1
    write_kv_cache(case.key, case.value, case.key_cache, case.value_cache, slots)
    flat_k, flat_v = case.key_cache.view(-1, 3, 16), case.value_cache.view(-1, 3, 16)
    assert torch.equal(flat_k[slots[:-1]], case.key[:-1])
    assert torch.equal(flat_v[slots[:-1]], case.value[:-1])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[:-1]] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, 3, 16)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, 3, 16)[untouched])


@here
@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_large_mixed_batch_on_gpu(dtype: torch.dtype, head_dim: int) -> None:
    seqs = [(1000, 1000), (700, 300), (2049, 1)] + [(20 + 37 * i, 1) for i in range(60)] + [(513, 129)]
    case = make_case(seqs, num_kv_heads=4, group=4, head_dim=head_dim, dtype=dtype, seed=5)
    assert_matches(case, dtype)


@here
@pytest.mark.parametrize("window", [1, 5, 40])
def test_sliding_windows_match_reference(window: int) -> None:
    """Windows narrower than a key tile and than a prefill chunk: rows of one tile start at different keys,
    and the first tiles of late rows hold no key they see."""
    case = make_case(
        MIXED, num_kv_heads=2, group=3, head_dim=32, dtype=torch.float32, seed=6, fill=float("nan")
    )
    assert_matches(case, torch.float32, window)


@here
def test_soft_capped_scores_match_reference() -> None:
    case = make_case(
        MIXED, num_kv_heads=2, group=3, head_dim=32, dtype=torch.float32, seed=7, fill=float("nan")
    )
    assert_matches(case, torch.float32, window=40, softcap=2.0, scale=1.0)
