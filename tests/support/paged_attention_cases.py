"""Random paged-attention cases: shuffled block tables, mixed prefill chunks and decodes.

Shared by the tests of every attention backend, which all compare against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention.backend import AttentionBackend, AttentionMetadata

# Prefill chunks that start mid-sequence, a fresh prefill, and decodes; no length a multiple of 16.
MIXED = [(37, 37), (70, 19), (5, 1), (130, 1), (45, 13), (17, 1), (1, 1)]


@dataclass
class Case:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: AttentionMetadata
    used_slots: torch.Tensor


def make_case(
    seqs: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    seed: int = 0,
    fill: float | None = None,
) -> Case:
    """seqs holds (context length once this step's tokens are in, number of new query tokens)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [(ctx + block_size - 1) // block_size for ctx, _ in seqs]
    num_blocks = sum(blocks_needed) + 5
    max_blocks = max(blocks_needed) + 2
    # Shuffled ids make every table non-contiguous; the spare ids are never referenced.
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    spare = ids[sum(blocks_needed)]
    block_table = torch.full((len(seqs), max_blocks), int(spare), dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    slots, used, q_lens = [], [], []
    taken = 0
    for i, (ctx, q_len) in enumerate(seqs):
        table = ids[taken : taken + blocks_needed[i]]
        taken += blocks_needed[i]
        block_table[i, : len(table)] = table
        seq_slots = (table[:, None].long() * block_size + torch.arange(block_size)).flatten()[:ctx]
        used.append(seq_slots)
        slots.append(seq_slots[ctx - q_len :])
        q_lens.append(q_len)
    used_slots = torch.cat(used)
    if fill is not None:
        # Everything no sequence may read: other blocks and the tail of each last block.
        unused = torch.ones(num_blocks * block_size, dtype=torch.bool)
        unused[used_slots] = False
        key_cache.view(-1, num_kv_heads, head_dim)[unused] = fill
        value_cache.view(-1, num_kv_heads, head_dim)[unused] = fill
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    metadata = AttentionMetadata(
        num_tokens=num_tokens,
        num_seqs=len(seqs),
        slot_mapping=torch.cat(slots),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
        block_table=block_table,
        max_query_len=max(q_lens),
        max_seq_len=max(ctx for ctx, _ in seqs),
    )
    return Case(query, key, value, key_cache, value_cache, metadata, used_slots)


def attend(
    backend: AttentionBackend, case: Case, scale: float, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """backend.forward over the case: its new rows written into its caches, then attention."""
    return backend.forward(
        case.query,
        case.key,
        case.value,
        case.key_cache,
        case.value_cache,
        case.metadata,
        scale,
        window,
        softcap,
    )
