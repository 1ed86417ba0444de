"""Sequences of a batch with scattered block tables, fed to a model step by step over a paged KV cache."""

from __future__ import annotations

import random

import torch

from worker.attention.backend import AttentionMetadata
from worker.models.llama import LlamaForCausalLM

BLOCK_SIZE = 16


class PagedSequences:
    """`seqs` may grow between steps (a generation loop appends to them) up to `capacity` tokens each."""

    def __init__(
        self, model: LlamaForCausalLM, seqs: list[list[int]], seed: int = 0, capacity: int | None = None
    ) -> None:
        self.model, self.seqs = model, seqs
        self.device = model.norm.weight.device
        per_seq = (capacity or max(len(s) for s in seqs)) // BLOCK_SIZE + 1
        blocks = list(range(1, len(seqs) * per_seq + 1))
        random.Random(seed).shuffle(blocks)
        self.block_table = torch.tensor(
            [blocks[i * per_seq : (i + 1) * per_seq] for i in range(len(seqs))], dtype=torch.int32
        )
        self.num_blocks = len(blocks) + 1
        self.kv_caches = self.new_kv_caches()
        self.computed = [0] * len(seqs)

    def new_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed (key_cache, value_cache) pairs, one per layer, that fit these sequences; this rank's KV
        heads under tensor parallelism."""
        model = self.model
        shape = (self.num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        return [
            (
                torch.zeros(shape, dtype=model.dtype, device=self.device),
                torch.zeros(shape, dtype=model.dtype, device=self.device),
            )
            for _ in model.layers
        ]

    def next_inputs(
        self, query_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """input_ids, positions and metadata of the next query_lens[i] tokens of each sequence: the same for
        each of the model's KV cache groups, whose layers here keep their own caches."""
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
        device = self.device
        metadata = AttentionMetadata(
            num_tokens=len(ids),
            num_seqs=len(query_lens),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(self.computed, dtype=torch.int32, device=device),
            block_table=self.block_table.to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(self.computed),
        )
        groups = [metadata] * self.model.kv_cache_groups.num_groups
        return torch.tensor(ids, device=device), torch.tensor(positions, device=device), groups

    def step(self, query_lens: list[int]) -> torch.Tensor:
        """Run the next query_lens[i] tokens of each sequence; float32 logits of every new token."""
        ids, positions, metadata = self.next_inputs(query_lens)
        with torch.inference_mode():
            hidden = self.model.forward(ids, positions, self.kv_caches, metadata)
            return self.model.compute_logits(hidden)
