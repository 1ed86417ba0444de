"""The graph dispatcher's logic on CPU: capture sizes, the padding table, and the choice of mode."""

from __future__ import annotations

import itertools

import pytest

from sluice.capture_sizes import capture_size_ladder, resolve_capture_sizes, validate_graph_config
from sluice.config import GraphConfig, SchedulerConfig
from sluice.errors import GraphConfigError
from worker.graphs.dispatcher import (
    BatchDescriptor,
    GraphDispatcher,
    GraphMode,
    PaddingTable,
    build_dispatcher,
)

SCHED = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024)
BOTH = frozenset({GraphMode.FULL, GraphMode.PIECEWISE})


def cuda_dispatcher(mode: str = "full_and_piecewise", **graph: object) -> GraphDispatcher:
    return build_dispatcher(GraphConfig(mode=mode, **graph), SCHED, "cuda", supports_full_graph=True)  # type: ignore[arg-type]


def test_ladder_is_one_two_four_then_eights_then_sixteens() -> None:
    ladder = capture_size_ladder(512)
    assert ladder[:5] == (1, 2, 4, 8, 16)
    assert all(b - a == 8 for a, b in itertools.pairwise(ladder[3:]) if b <= 256)
    assert all(b - a == 16 for a, b in itertools.pairwise(ladder) if a >= 256)
    assert ladder[-1] == 512
    assert capture_size_ladder(20) == (1, 2, 4, 8, 16)


def test_default_sizes_cap_full_at_max_num_seqs_and_piecewise_at_512_tokens() -> None:
    sizes = resolve_capture_sizes(GraphConfig(), SCHED)
    assert sizes.full[-1] == 64
    assert sizes.piecewise[-1] == 512
    small_budget = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=100)
    sizes = resolve_capture_sizes(GraphConfig(), small_budget)
    assert max(sizes.full) <= 100 and max(sizes.piecewise) <= 100


def test_given_sizes_serve_both_modes_sorted_and_unique() -> None:
    sizes = resolve_capture_sizes(GraphConfig(capture_sizes=(8, 2, 8, 32)), SCHED)
    assert sizes.full == sizes.piecewise == (2, 8, 32)


@pytest.mark.parametrize("sizes", [(1, 65), (0, 4), ()])
def test_unreachable_capture_sizes_are_a_typed_error(sizes: tuple[int, ...]) -> None:
    with pytest.raises(GraphConfigError):
        validate_graph_config(GraphConfig(capture_sizes=sizes), SCHED)


def test_size_above_max_num_seqs_names_both_numbers() -> None:
    with pytest.raises(GraphConfigError, match=r"capture size 65 .*max_num_seqs 64"):
        build_dispatcher(GraphConfig(capture_sizes=(65,)), SCHED, "cuda", supports_full_graph=True)
    # On CPU too, although nothing is captured there.
    with pytest.raises(GraphConfigError):
        build_dispatcher(GraphConfig(capture_sizes=(65,)), SCHED, "cpu", supports_full_graph=True)


def test_size_above_the_token_budget_is_refused() -> None:
    with pytest.raises(GraphConfigError, match="max_num_batched_tokens 16"):
        validate_graph_config(GraphConfig(capture_sizes=(32,)), SchedulerConfig(64, 16))


def test_every_size_pads_to_the_smallest_captured_size_at_least_as_large() -> None:
    sizes = [1, 2, 4, 8, 16, 24, 48, 100]
    table = PaddingTable(sizes)
    for n in range(1, 101):
        assert table.pad(n) == min(s for s in sizes if s >= n), n
    assert table.pad(101) is None
    assert PaddingTable([]).pad(1) is None


def test_uniform_decode_pads_to_a_full_graph() -> None:
    dispatcher = cuda_dispatcher()
    mode, padded = dispatcher.dispatch(BatchDescriptor.of_step(5, 5))
    assert (mode, padded) == (GraphMode.FULL, BatchDescriptor(8, 8, True))
    assert dispatcher.num_padding_tokens == 3
    assert dispatcher.num_fallbacks == 0


def test_mixed_batch_pads_to_piecewise_keyed_on_tokens_alone() -> None:
    dispatcher = cuda_dispatcher()
    mode, padded = dispatcher.dispatch(BatchDescriptor.of_step(70, 3))
    assert (mode, padded) == (GraphMode.PIECEWISE, BatchDescriptor(72, None, False))


def test_decode_wider_than_every_full_graph_goes_piecewise() -> None:
    dispatcher = GraphDispatcher(BOTH, PaddingTable([1, 2, 4]), PaddingTable([4, 8, 16]))
    assert dispatcher.dispatch(BatchDescriptor.of_step(6, 6)) == (
        GraphMode.PIECEWISE,
        BatchDescriptor(8, None, False),
    )


def test_batch_beyond_every_graph_falls_back_and_is_counted() -> None:
    dispatcher = cuda_dispatcher()
    batch = BatchDescriptor.of_step(600, 2)
    assert dispatcher.dispatch(batch) == (GraphMode.NONE, batch)
    assert dispatcher.dispatch(batch)[0] is GraphMode.NONE
    assert dispatcher.num_fallbacks == 2


@pytest.mark.parametrize("graph", [GraphConfig(enforce_eager=True), GraphConfig(mode="none")])
def test_eager_configurations_run_none_without_counting_fallbacks(graph: GraphConfig) -> None:
    dispatcher = build_dispatcher(graph, SCHED, "cuda", supports_full_graph=True)
    for batch in (BatchDescriptor.of_step(4, 4), BatchDescriptor.of_step(40, 2)):
        assert dispatcher.dispatch(batch) == (GraphMode.NONE, batch)
    assert dispatcher.num_fallbacks == 0
    assert dispatcher.capture_descriptors() == []


def test_full_only_mode_runs_mixed_batches_eagerly_and_counts_them() -> None:
    dispatcher = cuda_dispatcher(mode="full")
    assert dispatcher.dispatch(BatchDescriptor.of_step(3, 3))[0] is GraphMode.FULL
    mixed = BatchDescriptor.of_step(9, 3)
    assert dispatcher.dispatch(mixed) == (GraphMode.NONE, mixed)
    assert dispatcher.num_fallbacks == 1


def test_piecewise_only_mode_serves_decodes_piecewise() -> None:
    dispatcher = cuda_dispatcher(mode="piecewise")
    assert dispatcher.dispatch(BatchDescriptor.of_step(3, 3)) == (
        GraphMode.PIECEWISE,
        BatchDescriptor(4, None, False),
    )


def test_backend_without_full_graph_support_never_gets_full() -> None:
    dispatcher = build_dispatcher(GraphConfig(), SCHED, "cuda", supports_full_graph=False)
    assert dispatcher.dispatch(BatchDescriptor.of_step(3, 3))[0] is GraphMode.PIECEWISE
    assert all(mode is GraphMode.PIECEWISE for mode, _ in dispatcher.capture_descriptors())


def test_capture_list_runs_largest_first_and_covers_both_modes() -> None:
    dispatcher = cuda_dispatcher(capture_sizes=(1, 4, 16))
    wanted = dispatcher.capture_descriptors()
    sizes = [desc.num_tokens for _, desc in wanted]
    assert sizes == sorted(sizes, reverse=True)
    assert set(wanted) == {
        (mode, BatchDescriptor(s, s, True) if mode is GraphMode.FULL else BatchDescriptor(s, None, False))
        for mode in BOTH
        for s in (1, 4, 16)
    }


def test_cpu_is_shape_free_no_padding_no_capture_no_fallback() -> None:
    dispatcher = build_dispatcher(GraphConfig(), SCHED, "cpu", supports_full_graph=True)
    assert dispatcher.capture_descriptors() == []
    for n in (1, 7, 64):
        decode = BatchDescriptor.of_step(n, n)
        assert dispatcher.dispatch(decode) == (GraphMode.FULL, decode)
    for n, r in ((2, 1), (333, 5), (1024, 64)):
        mode, padded = dispatcher.dispatch(BatchDescriptor.of_step(n, r))
        assert (mode, padded.num_tokens) == (GraphMode.PIECEWISE, n)
    assert dispatcher.num_fallbacks == 0 and dispatcher.num_padding_tokens == 0
