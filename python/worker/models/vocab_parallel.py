"""A [vocab, hidden] table split by vocab rows over the tensor-parallel ranks: the embedding and the LM head.

Rank r holds rows [r * shard, (r + 1) * shard) with shard = ceil(vocab / size). When vocab does not
divide by size, the last rank's table is padded with zero rows; no token id falls in the padding,
and the padding's logits are cut off after the gather, so a vocab of any size works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.distributed import TensorParallelGroup
from worker.layer_ops import LayerOps
from worker.quantized_weights import QuantizedRows, covering_parts


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.shard_size
        # The rows of this shard that are real tokens; the rest (on the last rank only) is padding.
        self.num_tokens_held = max(0, min(self.shard_size, vocab_size - self.vocab_start))
        # Left uninitialised: the loader fills the token rows and zeroes the padding.
        self.weight = nn.Parameter(
            torch.empty(self.shard_size, hidden_size, dtype=dtype), requires_grad=False
        )
        # The table as the LM head reads it: the loaded weight's storage until prepare() gives ops.linear
        # its own form (a packed copy on CPU), which F.embedding cannot read. A plain tensor, not a
        # second parameter, so that the loader sees one table.
        self.head_weight: torch.Tensor = self.weight.detach()

    def prepare(
        self, ops: LayerOps, k_blocks: bool = True, quantized: list[tuple[int, QuantizedRows]] | None = None
    ) -> None:
        """Once, after loading: the LM head's weight in the form ops.linear reads fastest (k_blocks as
        LayerOps.prepare_linear_weight takes it), packed from quantized parts where a GGUF file gave them
        (the embedding's own table stays as loaded: a step looks up a few of its rows)."""
        if quantized:
            self.head_weight = ops.prepare_quantized_linear_weight(
                covering_parts(quantized, self.weight.data), self.weight.dtype
            )
            return
        self.head_weight = ops.prepare_linear_weight(self.weight.data, k_blocks)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden]: each rank looks up the ids it holds, zeros elsewhere, then the sum over ranks."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        elsewhere = (local_ids < 0) | (local_ids >= self.num_tokens_held)
        rows = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        rows.masked_fill_(elsewhere.unsqueeze(1), 0.0)
        return self.tp.all_reduce(rows)

    def logits(self, hidden_states: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """float32 logits [n, vocab], the whole vocab on every rank: each rank's shard, gathered."""
        logits = self.tp.all_gather_last_dim(ops.linear_float32(hidden_states, self.head_weight, None))
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, : self.vocab_size].contiguous()
        return logits
