"""The attention backend interface: every backend reads and writes the paged KV cache in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner and shared by every layer.

    Tokens of the flattened batch are grouped by sequence in order; sequence i
    owns query rows query_start_loc[i]:query_start_loc[i+1]. Its last query row
    sits at position seq_lens[i] - 1, so the queries of one sequence are its
    newest tokens and attend causally to everything before them.
    """

    num_tokens: int
    num_seqs: int
    # [num_tokens] int64: flat index (block_id * block_size + offset) of each new token's KV.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: prefix sums of query lengths.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence once this step's tokens are in.
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32: the block ids of each sequence.
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int


class AttentionBackend(Protocol):
    # Whether the backend may run inside a FULL graph of a uniform decode batch: every per-step
    # length comes from tensors, and a batch size always launches the same kernels.
    supports_full_graph: bool

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
        """Write key/value into the caches at slot_mapping, then attend: each query row to every key up to
        its own position, or with a sliding window (window > 0) to the last `window` of them; softcap > 0
        caps each scaled score s at softcap * tanh(s / softcap) (Gemma 2) before the softmax.

        query [num_tokens, num_heads, head_dim]; key, value [num_tokens,
        num_kv_heads, head_dim]; key_cache, value_cache [num_blocks,
        block_size, num_kv_heads, head_dim]. Returns [num_tokens, num_heads,
        head_dim].
        """
        ...
