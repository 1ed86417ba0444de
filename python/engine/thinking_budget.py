"""A reasoning model's thinking budget in the engine core: follow the output's tokens and, once the
thinking has used its budget without closing, force its closing tag.

The phases, in order (llama.cpp's reasoning budget sampler has the same shape):
- OPENING: the output must open with the start tag for thinking to begin (skipped when the prompt
  opened it); any other first token means the output does not think, and the budget is done.
- THINKING: each token counts; the end tag, written by the model, ends the thinking.
- FORCING: the budget is spent: the next tokens are the end tag's, one per step, and nothing else
  may be sampled (the step's bitmask allows one token).
- DONE: the answer, free (or under its structured output constraint).

The forced tag goes on from any part of it the model had already written, so it is never doubled.
"""

from __future__ import annotations

import enum

import numpy as np

from sluice.sampling_params import ThinkingBudget


class Phase(enum.Enum):
    OPENING = "opening"
    THINKING = "thinking"
    FORCING = "forcing"
    DONE = "done"


class ThinkingBudgetState:
    """One request's budget: it has seen exactly the request's output tokens so far."""

    def __init__(self, budget: ThinkingBudget) -> None:
        assert budget.max_tokens >= 0 and budget.end_token_ids, "validated with the request"
        self.budget = budget
        self.phase = Phase.OPENING if budget.start_token_ids else Phase.THINKING
        # OPENING: start tag tokens matched; FORCING: end tag tokens out.
        self.matched = 0
        self.num_thinking_tokens = 0
        # The thinking's last tokens, as many as the end tag has: where a written tag is found.
        self.tail: list[int] = []
        self._force_if_spent()

    def may_force_after(self, num_unseen: int) -> bool:
        """Whether the token that follows `num_unseen` tokens not yet seen here (in flight) may be
        forced: only the steps that sample such a token need a bitmask, so the thinking before
        them keeps async scheduling's overlap."""
        if self.phase is Phase.DONE:
            return False
        if self.phase is Phase.FORCING:
            return True
        to_go = self.budget.max_tokens - self.num_thinking_tokens
        if self.phase is Phase.OPENING:
            to_go += len(self.budget.start_token_ids) - self.matched
        return num_unseen >= to_go

    @property
    def forced_token(self) -> int | None:
        """The only token the next step may sample, while the end tag is forced."""
        return self.budget.end_token_ids[self.matched] if self.phase is Phase.FORCING else None

    def accept_token(self, token_id: int) -> bool:
        """Follow one output token; False when a forced token was not the one sampled (the step's
        other masks left it no token at all)."""
        if self.phase is Phase.OPENING:
            start = self.budget.start_token_ids
            if token_id != start[self.matched]:
                self.phase = Phase.DONE
            else:
                self.matched += 1
                if self.matched == len(start):
                    self.phase = Phase.THINKING
                    self._force_if_spent()
        elif self.phase is Phase.THINKING:
            end = self.budget.end_token_ids
            self.num_thinking_tokens += 1
            self.tail = (self.tail + [token_id])[-len(end) :]
            if self.tail == end:
                self.phase = Phase.DONE
            else:
                self._force_if_spent()
        elif self.phase is Phase.FORCING:
            if token_id != self.forced_token:
                self.phase = Phase.DONE
                return False
            self.matched += 1
            if self.matched == len(self.budget.end_token_ids):
                self.phase = Phase.DONE
        return True

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Allow the forced token alone (bit t of word t // 32)."""
        token_id = self.forced_token
        assert token_id is not None, "only a forcing budget masks the row"
        row[:] = 0
        row.view(np.uint32)[token_id // 32] = np.uint32(1 << (token_id % 32))

    def _force_if_spent(self) -> None:
        if self.phase is Phase.THINKING and self.num_thinking_tokens >= self.budget.max_tokens:
            self.phase = Phase.FORCING
            # The longest part of the end tag that the thinking already ends with goes on.
            end = self.budget.end_token_ids
            self.matched = max(n for n in range(len(end)) if n == 0 or self.tail[-n:] == end[:n])
