"""Triton paged attention: the CUDA backend, also runnable on CPU tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import math

import torch
import triton

from worker.attention.backend import AttentionMetadata
from worker.attention.triton_kernels import INTERPRETED, paged_attention_kernel, write_kv_cache_kernel

# Key tile length; independent of the cache's block_size, which the kernel resolves per key.
BLOCK_N = 32


class TritonAttentionBackend:
    supports_full_graph = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        _check_device(query)
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        return paged_attention(query, key_cache, value_cache, metadata, scale, window, softcap)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copies each token's K/V rows to its flat slot; negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        flat_k,
        flat_v,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        flat_k.stride(0),
        flat_k.stride(1),
        flat_v.stride(0),
        flat_v.stride(1),
        num_kv_heads,
        head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context (the last `window` keys
    up to each query where window > 0; scores capped at softcap tanh(s / softcap) where softcap > 0)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the KV caches must be contiguous in head_dim")
    query = _last_dim_contiguous(query)
    out = query.new_empty((num_tokens, num_heads, head_dim))
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    # Triton's interpreter computes tl.dot on bf16 operands wrongly, so it gets fp32 operands there.
    dot_in_fp32 = INTERPRETED and key_cache.dtype == torch.bfloat16
    exact_dot = dot_in_fp32 or key_cache.dtype == torch.float32
    block_m = _query_tile_rows(metadata.max_query_len, group)
    tokens_per_tile = block_m // group
    grid = (metadata.num_seqs, num_kv_heads, triton.cdiv(metadata.max_query_len, tokens_per_tile))
    paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        metadata.block_table,
        metadata.query_start_loc,
        metadata.seq_lens,
        scale * math.log2(math.e),
        window,
        softcap * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        metadata.block_table.stride(0),
        block_size,
        head_dim,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        # fp32 operands must not silently drop to tf32 inside tl.dot.
        DOT_PRECISION="ieee" if exact_dot else "tf32",
        DOT_IN_FP32=dot_in_fp32,
    )
    return out


def _query_tile_rows(max_query_len: int, group: int) -> int:
    """Rows of one program's tile (tokens x group heads): small for decodes, up to 64 for prefill."""
    rows = triton.next_power_of_2(max_query_len * group)
    return max(16, triton.next_power_of_2(group), min(rows, 64))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_device(query: torch.Tensor) -> None:
    if query.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "TritonAttentionBackend got CPU tensors: run it on CUDA, or set TRITON_INTERPRET=1 "
            "before triton is first imported to run it in Triton's interpreter"
        )
