"""Sequences of a batch with scattered block tables, fed to a model step by step over a paged KV cache."""

from __future__ import annotations

import random

import torch

from worker.attention.backend import AttentionMetadata
from worker.models.llama import LlamaForCausalLM

BLOCK_SIZE = 16


class PagedSequences:
    def __init__(self, model: LlamaForCausalLM, seqs: list[list[int]], seed: int = 0) -> None:
        self.model, self.seqs = model, seqs
        per_seq = max(len(s) for s in seqs) // BLOCK_SIZE + 1
        blocks = list(range(1, len(seqs) * per_seq + 1))
        random.Random(seed).shuffle(blocks)
        self.block_table = torch.tensor(
            [blocks[i * per_seq : (i + 1) * per_seq] for i in range(len(seqs))], dtype=torch.int32
        )
        self.num_blocks = len(blocks) + 1
        self.kv_caches = self.new_kv_caches()
        self.computed = [0] * len(seqs)

    def new_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed (key_cache, value_cache) pairs, one per layer, that fit these sequences."""
        attn = self.model.layers[0].self_attn
        shape = (self.num_blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
        dtype = self.model.dtype
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in self.model.layers]

    def next_inputs(self, query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids, positions and metadata of the next query_lens[i] tokens of each sequence."""
        ids, positions, slots = [], [], []
        for i, n in enumerate(query_lens):
            for pos in range(self.computed[i], self.computed[i] + n):
                ids.append(self.seqs[i][pos])
                positions.append(pos)
                slots.append(int(self.block_table[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
            self.computed[i] += n
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        metadata = AttentionMetadata(
            num_tokens=len(ids),
            num_seqs=len(query_lens),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(self.computed, dtype=torch.int32),
            block_table=self.block_table,
            max_query_len=max(query_lens),
            max_seq_len=max(self.computed),
        )
        return torch.tensor(ids), torch.tensor(positions), metadata

    def step(self, query_lens: list[int]) -> torch.Tensor:
        """Run the next query_lens[i] tokens of each sequence; float32 logits of every new token."""
        ids, positions, metadata = self.next_inputs(query_lens)
        with torch.inference_mode():
            hidden = self.model.forward(ids, positions, self.kv_caches, metadata)
            return self.model.compute_logits(hidden)
