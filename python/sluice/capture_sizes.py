"""Which batch sizes get a captured graph: the default ladder, and the check of user-given sizes.

Torch-free on purpose: the CLI imports it to reject bad sizes before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.config import GraphConfig, SchedulerConfig
from sluice.errors import GraphConfigError

# Past a few hundred tokens a step's GEMMs run long enough to hide their kernel launches, so a
# graph there saves nothing and costs capture time and pool memory (vLLM caps at 512 too).
MAX_CAPTURE_TOKENS = 512


@dataclass(frozen=True, slots=True)
class CaptureSizes:
    """Ascending sizes; FULL sizes count requests of a uniform decode, PIECEWISE sizes count tokens."""

    full: tuple[int, ...]
    piecewise: tuple[int, ...]


def capture_size_ladder(cap: int) -> tuple[int, ...]:
    """1, 2, 4, then every 8 up to 256 and every 16 beyond, all at most `cap`."""
    steps = [1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)]
    return tuple(size for size in steps if size <= cap)


def validate_graph_config(graph: GraphConfig, scheduler: SchedulerConfig) -> None:
    """Raises GraphConfigError for capture sizes that no step can reach; call before starting processes."""
    if graph.capture_sizes is None:
        return
    if not graph.capture_sizes:
        raise GraphConfigError("capture_sizes is empty: leave it unset for the default ladder")
    for size in graph.capture_sizes:
        if size < 1:
            raise GraphConfigError(f"capture size {size} is not a batch size: each must be at least 1")
        if size > scheduler.max_num_seqs:
            raise GraphConfigError(
                f"capture size {size} is above max_num_seqs {scheduler.max_num_seqs}: a step never holds "
                "that many requests; lower the size or raise --max-num-seqs"
            )
        if size > scheduler.max_num_batched_tokens:
            raise GraphConfigError(
                f"capture size {size} is above max_num_batched_tokens {scheduler.max_num_batched_tokens}: "
                "a step never holds that many tokens"
            )


def resolve_capture_sizes(graph: GraphConfig, scheduler: SchedulerConfig) -> CaptureSizes:
    """The sizes to capture: the user's for both modes, else the ladder (PIECEWISE may go above max_num_seqs)."""
    validate_graph_config(graph, scheduler)
    if graph.capture_sizes is not None:
        sizes = tuple(sorted(set(graph.capture_sizes)))
        return CaptureSizes(full=sizes, piecewise=sizes)
    token_cap = min(scheduler.max_num_batched_tokens, MAX_CAPTURE_TOKENS)
    return CaptureSizes(
        full=capture_size_ladder(min(scheduler.max_num_seqs, token_cap)),
        piecewise=capture_size_ladder(token_cap),
    )
