"""Picks, for each step, how its forward runs: one FULL graph, PIECEWISE graphs around eager
attention, or NONE (eager), and the padded batch shape that the chosen graphs were captured for.

A captured graph replays fixed shapes, so a batch is padded up to the next captured size; the
padding table makes that a list lookup. FULL holds attention inside the graph, and attention's
kernels depend on how tokens split into requests, so FULL is keyed on a uniform decode batch of
one token per request. PIECEWISE graphs hold only the dense stages, which see a flat token count,
so their key is the token count alone. A batch that fits nothing runs eagerly, and that fallback
is counted: it is the regression to watch for.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.capture_sizes import resolve_capture_sizes
from sluice.config import GraphConfig, SchedulerConfig


class GraphMode(enum.Enum):
    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"


# Which modes each --graph-mode lets the dispatcher pick.
_ALLOWED_MODES: dict[str, frozenset[GraphMode]] = {
    "full_and_piecewise": frozenset({GraphMode.FULL, GraphMode.PIECEWISE}),
    "full": frozenset({GraphMode.FULL}),
    "piecewise": frozenset({GraphMode.PIECEWISE}),
    "none": frozenset(),
}


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    num_tokens: int
    # None in a PIECEWISE key: the dense stages do not care how tokens split into requests.
    num_reqs: int | None
    # Every request has exactly one new token (num_tokens == num_reqs).
    uniform_decode: bool

    @classmethod
    def of_step(cls, num_tokens: int, num_reqs: int) -> BatchDescriptor:
        assert 1 <= num_reqs <= num_tokens, (num_tokens, num_reqs)
        return cls(num_tokens, num_reqs, uniform_decode=num_tokens == num_reqs)


class PaddingTable:
    """Maps a batch size to the smallest captured size at least as large, in O(1)."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(sorted(set(sizes)))
        assert not self.sizes or self.sizes[0] >= 1, self.sizes
        self.max_size = self.sizes[-1] if self.sizes else 0
        # _padded[n] for n in 0..max_size; index 0 is never looked up.
        self._padded = [0] * (self.max_size + 1)
        n = 1
        for size in self.sizes:
            while n <= size:
                self._padded[n] = size
                n += 1

    def pad(self, n: int) -> int | None:
        """The captured size for a batch of n, or None when n is above every captured size."""
        assert n >= 1, n
        return self._padded[n] if n <= self.max_size else None


class GraphDispatcher:
    """Chooses the mode and padded shape of each step and counts eager fallbacks.

    `shape_free` marks a device whose fast path takes any batch shape (the CPU's C++ steps): its
    tables say every size up to the limit is captured, so no batch is padded or falls back.
    """

    def __init__(
        self,
        allowed_modes: frozenset[GraphMode],
        full_sizes: PaddingTable,
        piecewise_sizes: PaddingTable,
        shape_free: bool = False,
    ) -> None:
        self.allowed_modes = allowed_modes
        self.full_sizes = full_sizes
        self.piecewise_sizes = piecewise_sizes
        self.shape_free = shape_free
        # Steps that graphs were on for but that ran eagerly because no captured shape fit them.
        self.num_fallbacks = 0
        # Tokens of padding run so far: the compute that padding wastes.
        self.num_padding_tokens = 0

    def dispatch(self, batch: BatchDescriptor) -> tuple[GraphMode, BatchDescriptor]:
        if not self.allowed_modes:
            return GraphMode.NONE, batch
        if GraphMode.FULL in self.allowed_modes and batch.uniform_decode:
            padded_size = self.full_sizes.pad(batch.num_tokens)
            if padded_size is not None:
                return self._chosen(GraphMode.FULL, batch, BatchDescriptor(padded_size, padded_size, True))
        if GraphMode.PIECEWISE in self.allowed_modes:
            padded_size = self.piecewise_sizes.pad(batch.num_tokens)
            if padded_size is not None:
                return self._chosen(GraphMode.PIECEWISE, batch, BatchDescriptor(padded_size, None, False))
        self.num_fallbacks += 1
        return GraphMode.NONE, batch

    def _chosen(
        self, mode: GraphMode, batch: BatchDescriptor, padded: BatchDescriptor
    ) -> tuple[GraphMode, BatchDescriptor]:
        self.num_padding_tokens += padded.num_tokens - batch.num_tokens
        return mode, padded

    def capture_descriptors(self) -> list[tuple[GraphMode, BatchDescriptor]]:
        """Every (mode, padded shape) that needs a captured graph, largest first, so that smaller
        captures reuse the pool memory the larger ones reserved. Empty when shape-free."""
        if self.shape_free:
            return []
        wanted: list[tuple[GraphMode, BatchDescriptor]] = []
        if GraphMode.FULL in self.allowed_modes:
            wanted += [(GraphMode.FULL, BatchDescriptor(s, s, True)) for s in self.full_sizes.sizes]
        if GraphMode.PIECEWISE in self.allowed_modes:
            wanted += [
                (GraphMode.PIECEWISE, BatchDescriptor(s, None, False)) for s in self.piecewise_sizes.sizes
            ]
        return sorted(wanted, key=lambda entry: entry[1].num_tokens, reverse=True)


def build_dispatcher(
    graph: GraphConfig, scheduler: SchedulerConfig, device_type: str, supports_full_graph: bool
) -> GraphDispatcher:
    """The dispatcher for a device. `supports_full_graph`: the attention backend (or the CPU's
    whole-model step) can run inside a FULL graph; without it FULL is never picked.

    On CUDA the sizes come from the capture ladder (or --capture-sizes). On CPU nothing is
    captured: the C++ steps that FULL and PIECEWISE select there take any shape, so padding would
    only add compute. The CPU tables are the identity up to the scheduler's limits, which makes
    every batch "captured" at its own size; --capture-sizes is validated but has nothing to size.
    """
    allowed = frozenset() if graph.enforce_eager else _ALLOWED_MODES[graph.mode]
    if not supports_full_graph:
        allowed = allowed - {GraphMode.FULL}
    if device_type == "cpu":
        resolve_capture_sizes(graph, scheduler)
        every_decode = range(1, min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens) + 1)
        every_step = range(1, scheduler.max_num_batched_tokens + 1)
        return GraphDispatcher(allowed, PaddingTable(every_decode), PaddingTable(every_step), shape_free=True)
    sizes = resolve_capture_sizes(graph, scheduler)
    return GraphDispatcher(allowed, PaddingTable(sizes.full), PaddingTable(sizes.piecewise))
