"""The pooling runner's reduction: a prompt's final hidden states into one vector, chunk by chunk.

A pooling request is computed like a prefill that never decodes. Its prompt may be chunked over
several steps, so mean and first-token pooling keep a partial result per request between steps;
the step that computes a prompt's last position hands its vector out (raw: the engine core
truncates and normalises it, sluice.pooling.finish_embedding). A cross-encoder's vector goes through
its head first, which makes it the pair's one score.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from sluice.pooling import PoolingMethod
from worker.request_state import RequestState


class Pooler:
    def __init__(
        self, method: PoolingMethod, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        self.method = method
        # A cross-encoder's: the pooled vector [hidden] -> its score [1].
        self.head = head
        # req_id -> the float32 sum of its positions so far (mean), or its first position's state (cls).
        self.partial: dict[str, torch.Tensor] = {}

    def pool(
        self,
        hidden: torch.Tensor,
        states: list[RequestState],
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
    ) -> list[bytes | None]:
        """Per row: the pooled vector (little-endian float32 bytes) if this step finished its prompt, else None.

        hidden: the step's hidden states, rows in the order of `states`; num_computed: each row's
        tokens computed before this step; num_scheduled: the tokens it computes in this step."""
        pooled: list[bytes | None] = []
        start = 0
        for state, computed, scheduled in zip(
            states, num_computed.tolist(), num_scheduled.tolist(), strict=True
        ):
            rows = hidden[start : start + scheduled]
            start += scheduled
            req_id = state.req_id
            if computed == 0:
                # A first chunk, or a recomputation after a preemption: nothing earlier counts.
                self.partial.pop(req_id, None)
            if self.method == "mean":
                total = rows.float().sum(dim=0)
                self.partial[req_id] = total if computed == 0 else self.partial[req_id] + total
            elif self.method == "cls" and computed == 0:
                # A copy: on CUDA the step's hidden states are a graph buffer that the next step rewrites.
                self.partial[req_id] = rows[0].to(torch.float32, copy=True)
            num_prompt = len(state.prompt_token_ids)
            if computed + scheduled < num_prompt:
                pooled.append(None)
                continue
            assert computed + scheduled == num_prompt, (
                "a pooling request computes its prompt and nothing more"
            )
            if self.method == "last":
                vector = rows[-1].float()
            elif self.method == "mean":
                vector = self.partial.pop(req_id) / num_prompt
            else:
                vector = self.partial.pop(req_id)
            if self.head is not None:
                vector = self.head(vector)
            pooled.append(vector.cpu().numpy().astype("<f4").tobytes())
        return pooled

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the partial results of requests that ended before their prompt was in."""
        for req_id in req_ids:
            self.partial.pop(req_id, None)
