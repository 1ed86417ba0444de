"""The flash-attn backend: its cache requirements and the selector on any machine; its output
against the reference attention where CUDA and flash_attn exist."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from paged_attention_cases import MIXED, Case, attend, make_case
from sluice.config import KernelConfig
from sluice.errors import AttentionBackendError
from worker.attention.flash_attn_backend import FlashAttentionBackend
from worker.attention.selector import select_attention_backend
from worker.attention.torch_backend import TorchAttentionBackend
from worker.attention.triton_backend import TritonAttentionBackend

CUDA = torch.cuda.is_available()
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
on_gpu = pytest.mark.skipif(not (CUDA and HAS_FLASH_ATTN), reason="needs CUDA and the flash_attn package")
CUDA_DEVICE = torch.device("cuda")
FORCE_FLASH_ATTN = KernelConfig(cuda_attention_backend="flash_attn")


def test_block_size_not_a_multiple_of_256_is_refused_with_the_reason() -> None:
    with pytest.raises(AttentionBackendError, match=r"multiple of 256 tokens, and --block-size is 16"):
        FlashAttentionBackend(16, torch.bfloat16)


def test_float32_is_refused() -> None:
    with pytest.raises(AttentionBackendError, match="float16 or bfloat16"):
        FlashAttentionBackend(256, torch.float32)


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="flash_attn is installed here")
def test_selector_falls_back_to_triton_without_flash_attn() -> None:
    backend = select_attention_backend(CUDA_DEVICE, 256, torch.bfloat16)
    assert isinstance(backend, TritonAttentionBackend)
    with pytest.raises(AttentionBackendError, match="flash_attn"):
        select_attention_backend(CUDA_DEVICE, 256, torch.bfloat16, FORCE_FLASH_ATTN)


@pytest.mark.parametrize(("block_size", "dtype"), [(16, torch.bfloat16), (256, torch.float32), (None, None)])
def test_selector_uses_triton_where_flash_attn_cannot_serve_the_cache(
    block_size: int | None, dtype: torch.dtype | None
) -> None:
    assert isinstance(select_attention_backend(CUDA_DEVICE, block_size, dtype), TritonAttentionBackend)
    with pytest.raises(AttentionBackendError, match="cuda_attention_backend is flash_attn, but"):
        select_attention_backend(CUDA_DEVICE, block_size, dtype, FORCE_FLASH_ATTN)


def test_selector_off_switch_and_unknown_names() -> None:
    triton = KernelConfig(cuda_attention_backend="triton")
    assert isinstance(
        select_attention_backend(CUDA_DEVICE, 256, torch.bfloat16, triton), TritonAttentionBackend
    )
    unknown = KernelConfig(cuda_attention_backend="xformers")  # type: ignore[arg-type]
    with pytest.raises(AttentionBackendError, match="xformers"):
        select_attention_backend(CUDA_DEVICE, 256, torch.bfloat16, unknown)


@on_gpu
def test_selector_picks_flash_attn_for_a_fitting_cache() -> None:
    assert isinstance(select_attention_backend(CUDA_DEVICE, 256, torch.bfloat16), FlashAttentionBackend)


def _on_cuda(case: Case) -> Case:
    m = case.metadata
    metadata = replace(
        m,
        slot_mapping=m.slot_mapping.cuda(),
        query_start_loc=m.query_start_loc.cuda(),
        seq_lens=m.seq_lens.cuda(),
        block_table=m.block_table.cuda(),
    )
    moved = {k: v.to(CUDA_DEVICE, copy=True) for k, v in case.__dict__.items() if k != "metadata"}
    return Case(**moved, metadata=metadata)


def _assert_matches_reference(case: Case, tol: float, window: int = 0, softcap: float = 0.0) -> None:
    ours = _on_cuda(case)
    got = attend(FlashAttentionBackend(256, case.query.dtype), ours, 0.125, window, softcap)
    ref = replace(case, key_cache=case.key_cache.clone(), value_cache=case.value_cache.clone())
    want = attend(TorchAttentionBackend(), ref, 0.125, window, softcap)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(ours.key_cache.cpu(), ref.key_cache, atol=0, rtol=0, equal_nan=True)


@on_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
def test_mixed_batch_matches_reference(dtype: torch.dtype, group: int) -> None:
    seqs = [*MIXED, (700, 1), (600, 300)]
    # Slots no sequence may read hold 1e4, which would swamp any softmax it leaked into (fp16 has no 1e30).
    case = make_case(seqs, num_kv_heads=2, group=group, head_dim=64, dtype=dtype, block_size=256, fill=1e4)
    _assert_matches_reference(case, 2e-2 if dtype == torch.bfloat16 else 4e-3)


@on_gpu
def test_soft_capped_scores_match_reference() -> None:
    case = make_case(
        [*MIXED, (700, 1)], num_kv_heads=2, group=3, head_dim=64, dtype=torch.bfloat16, block_size=256
    )
    _assert_matches_reference(case, 2e-2, window=100, softcap=0.5)


@on_gpu
@pytest.mark.parametrize("window", [1, 50, 400])
def test_sliding_windows_match_reference(window: int) -> None:
    seqs = [*MIXED, (700, 1), (600, 300)]
    case = make_case(
        seqs, num_kv_heads=2, group=3, head_dim=64, dtype=torch.bfloat16, block_size=256, fill=1e4
    )
    _assert_matches_reference(case, 2e-2, window)


@on_gpu
def test_decode_batch_matches_reference() -> None:
    seqs = [(3 + 97 * i, 1) for i in range(9)]
    case = make_case(
        seqs, num_kv_heads=2, group=4, head_dim=128, dtype=torch.bfloat16, block_size=256, seed=4
    )
    _assert_matches_reference(case, 2e-2)


@on_gpu
def test_decode_with_a_longer_max_seqlen_k_and_empty_padded_requests() -> None:
    """The FULL graph's view of a decode: max_seqlen_k fixed at max_model_len, padding requests empty."""
    seqs = [(40, 1), (300, 1), (5, 1)]
    case = make_case(seqs, num_kv_heads=2, group=4, head_dim=64, dtype=torch.bfloat16, block_size=256, seed=6)
    ours = _on_cuda(case)
    want = FlashAttentionBackend(256, torch.bfloat16).forward(
        ours.query,
        ours.key,
        ours.value,
        ours.key_cache.clone(),
        ours.value_cache.clone(),
        ours.metadata,
        0.125,
    )
    m = ours.metadata
    pad = 2
    padded = replace(
        m,
        num_tokens=m.num_tokens + pad,
        num_seqs=m.num_seqs + pad,
        slot_mapping=torch.cat([m.slot_mapping, m.slot_mapping.new_full((pad,), -1)]),
        query_start_loc=torch.cat([m.query_start_loc, m.query_start_loc[-1:].repeat(pad)]),
        seq_lens=torch.cat([m.seq_lens, m.seq_lens.new_zeros(pad)]),
        block_table=torch.cat([m.block_table, m.block_table[:1].repeat(pad, 1)]),
        max_seq_len=m.block_table.shape[1] * 256,
    )
    query = torch.cat([ours.query, ours.query[:pad]])
    key, value = torch.cat([ours.key, ours.key[:pad]]), torch.cat([ours.value, ours.value[:pad]])
    got = FlashAttentionBackend(256, torch.bfloat16).forward(
        query, key, value, ours.key_cache, ours.value_cache, padded, 0.125
    )
    torch.testing.assert_close(got[: m.num_tokens], want, atol=2e-2, rtol=2e-2)
