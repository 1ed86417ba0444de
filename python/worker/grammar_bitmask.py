"""Applies a step's structured output bitmask to its logits: disallowed tokens get -inf."""

from __future__ import annotations

import numpy as np
import torch

from sluice.worker_seam import GrammarBitmask

_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: GrammarBitmask, num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] bool: bit t % 32 of word t // 32 of a row allows token t."""
    words = torch.from_numpy(np.frombuffer(bitmask.bitmask, dtype="<i4").copy()).view(num_rows, -1)
    assert words.shape[1] == -(-vocab_size // 32), (tuple(words.shape), vocab_size)
    bits = (words.unsqueeze(-1) >> _BITS) & 1
    return bits.view(num_rows, -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[int], bitmask: GrammarBitmask) -> None:
    """Mask `logits` in place at `rows` (one per bitmask row, in order)."""
    allowed = allowed_tokens(bitmask, len(rows), logits.shape[1]).to(logits.device, non_blocking=True)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
