"""Prompt lookup: draft tokens are what followed the request's last n tokens the last time they appeared.

Repetitive text (code being edited, a summary quoting its source) repeats long runs of its own
tokens, so the continuation of an earlier occurrence of the current suffix is a cheap guess at
the next tokens. The longest suffix (up to prompt_lookup_max tokens, at least prompt_lookup_min)
that occurred before wins; among its occurrences, the most recent one.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to max_drafts tokens that followed the longest earlier match of the sequence's suffix."""
        num_tokens = len(token_ids)
        if max_drafts <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = num_tokens - 1
        # Candidate ends of an earlier occurrence: positions before the last one holding the last token.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        if ends.size == 0:
            return []
        # Grow each candidate's match backwards, one token at a time, while it keeps agreeing.
        match_len = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for offset in range(1, self.max_n):
            if offset > last:
                break
            starts = ends - offset
            agrees = (starts >= 0) & (tokens[np.maximum(starts, 0)] == tokens[last - offset])
            alive &= agrees
            if not alive.any():
                break
            match_len += alive
        longest = int(match_len.max())
        if longest < self.min_n:
            return []
        # The most recent of the longest matches: nearby text is the likeliest to be repeated next.
        end = int(ends[np.flatnonzero(match_len == longest)[-1]])
        return token_ids[end + 1 : end + 1 + max_drafts]
