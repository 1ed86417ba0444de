"""Paged attention with flash-attn 2's flash_attn_varlen_func over the block table (--device cuda).

flash_attn_varlen_func attends a varlen batch of queries (cu_seqlens_q) to K/V read through
block_table from a cache laid out [num_blocks, block_size, num_kv_heads, head_dim], Sluice's own
layout, with the causal mask aligned to the bottom right: each sequence's new queries are its last
tokens. It does not write the cache, so new K/V rows go in first with the Triton writer, which
skips the -1 slots of padded tokens.

Its requirements, checked at construction: fp16 or bf16, and a cache block_size divisible by 256
(flash-attn 2's varlen forward rejects paged KV with any other page size). Sluice's default block
size is 16, so flash-attn is picked only when --block-size is a multiple of 256; otherwise the
selector uses the Triton backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.errors import AttentionBackendError
from worker.attention.backend import AttentionMetadata
from worker.attention.triton_backend import write_kv_cache

PAGE_MULTIPLE = 256
DTYPES = (torch.float16, torch.bfloat16)


class FlashAttentionBackend:
    # In a uniform decode batch every length is read from tensors; max_seqlen_k is max_model_len.
    supports_full_graph = True

    def __init__(self, block_size: int, dtype: torch.dtype) -> None:
        if block_size % PAGE_MULTIPLE:
            raise AttentionBackendError(
                f"flash-attn 2 reads a paged KV cache only in blocks of a multiple of {PAGE_MULTIPLE} "
                f"tokens, and --block-size is {block_size}"
            )
        if dtype not in DTYPES:
            raise AttentionBackendError(f"flash-attn 2 computes in float16 or bfloat16 only, not {dtype}")
        # Imported here so that the checks above hold (and are tested) where flash_attn is absent.
        from flash_attn import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func

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
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        if metadata.num_tokens == 0:
            return query.new_empty(query.shape)
        # flash-attn takes key lengths as prefix sums; one small kernel, so it also runs inside a graph.
        cu_seqlens_k = F.pad(torch.cumsum(metadata.seq_lens, 0, dtype=torch.int32), (1, 0))
        return self._varlen(
            query,
            key_cache,
            value_cache,
            cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale,
            causal=True,
            # (left, right) keys around the diagonal; (-1, -1) is the whole causal context.
            window_size=(window - 1, 0) if window else (-1, -1),
            softcap=softcap,
            block_table=metadata.block_table,
        )
