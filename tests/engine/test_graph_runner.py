"""The graph runner against the model run op by op, step by step, over padded batches.

On CPU the recorder runs each closure once at capture (like the CUDA warm-up) and "replays" by
calling it again, so everything but torch.cuda.graph itself runs here: the piecewise split, the
static tensors, padding, the dispatcher's choices and the address checks. The main test also runs
with the Triton backend (CUDA's) inside the FULL graphs, under Triton's interpreter in a child
process (see test_triton_attention.py for why a child). With CUDA the same test captures real
CUDA graphs.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sluice.model_spec import read_model_spec
from tiny_models import tiny_model_dir, write_tiny_encoder
from triton_interpreter import run_interpreted
from worker.attention.backend import AttentionMetadata
from worker.attention.selector import select_attention_backend
from worker.graphs.dispatcher import GraphDispatcher, GraphMode, PaddingTable
from worker.graphs.graph_runner import GraphRunner, Recorder, Replay
from worker.graphs.input_buffers import GraphAddressError, StaticInputBuffers, StepShape
from worker.model_loader import load_encoder, load_model
from worker.models.llama import LlamaForCausalLM

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
VARIANTS = [
    pytest.param("cpu"),
    pytest.param(
        "triton-interpreted",
        marks=pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process"),
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")),
]
BLOCK_SIZE = 16
MAX_MODEL_LEN = 128
BOTH = frozenset({GraphMode.FULL, GraphMode.PIECEWISE})


def replay_by_calling(fn: Callable[[], None]) -> Replay:
    fn()
    return fn


def recorder_for(variant: str) -> Recorder:
    if variant == "cuda":
        from worker.graphs.cuda_graphs import CudaGraphRecorder

        return CudaGraphRecorder(torch.device("cuda"))
    return replay_by_calling


def small_dispatcher(modes: frozenset[GraphMode] = BOTH) -> GraphDispatcher:
    return GraphDispatcher(modes, PaddingTable([1, 2, 4, 8]), PaddingTable([4, 8, 16, 48]))


class Sequences:
    """A few sequences with scattered blocks; each step yields the flat inputs of a schedule."""

    def __init__(self, lengths: list[int], device: torch.device, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.tokens = [[rng.randrange(256) for _ in range(n + 16)] for n in lengths]
        self.computed = [0] * len(lengths)
        per_seq = MAX_MODEL_LEN // BLOCK_SIZE
        blocks = list(range(1, len(lengths) * per_seq + 1))
        rng.shuffle(blocks)
        self.num_blocks = len(blocks) + 1
        self.block_table = torch.tensor(
            [blocks[i * per_seq : (i + 1) * per_seq] for i in range(len(lengths))], dtype=torch.int32
        )
        self.device = device

    def step(self, schedule: dict[int, int]) -> tuple[StepShape, dict[str, torch.Tensor]]:
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, n in sorted(schedule.items()):
            for pos in range(self.computed[seq], self.computed[seq] + n):
                ids.append(self.tokens[seq][pos])
                positions.append(pos)
                block = int(self.block_table[seq, pos // BLOCK_SIZE])
                slots.append(block * BLOCK_SIZE + pos % BLOCK_SIZE)
            self.computed[seq] += n
            starts.append(starts[-1] + n)
            seq_lens.append(self.computed[seq])
        rows = sorted(schedule)
        shape = StepShape(len(ids), len(rows), max(schedule.values()), max(seq_lens))
        d = self.device
        return shape, {
            "input_ids": torch.tensor(ids, device=d),
            "positions": torch.tensor(positions, device=d),
            "slot_mapping": torch.tensor(slots, device=d),
            "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=d),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=d),
            "block_table": self.block_table[rows].to(d),
            "logits_indices": torch.tensor(starts[1:], device=d) - 1,
        }


def nan_caches(model: LlamaForCausalLM, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """NaN everywhere: a slot written by a padded token, or read before it is written, shows up."""
    shape = (num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    device = model.embed_tokens.weight.device
    return [
        (torch.full(shape, float("nan"), device=device), torch.full(shape, float("nan"), device=device))
        for _ in model.layers
    ]


def load_tiny(variant: str = "cpu", arch: str = "llama") -> LlamaForCausalLM:
    """ "cpu": the C++ attention; "triton-interpreted": Triton's, on CPU tensors; "cuda": the selector's."""
    device = torch.device("cuda" if variant == "cuda" else "cpu")
    if variant == "triton-interpreted":
        from worker.attention.triton_backend import TritonAttentionBackend

        attention = TritonAttentionBackend()
    else:
        attention = select_attention_backend(device, BLOCK_SIZE, torch.float32)
    spec = read_model_spec(tiny_model_dir(arch))
    return load_model(spec, torch.float32, device, attention, MAX_MODEL_LEN)


def eager_reference(
    model: LlamaForCausalLM, caches: list, shape: StepShape, inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    metadata = AttentionMetadata(
        num_tokens=shape.num_tokens,
        num_seqs=shape.num_reqs,
        slot_mapping=inputs["slot_mapping"],
        query_start_loc=inputs["query_start_loc"],
        seq_lens=inputs["seq_lens"],
        block_table=inputs["block_table"],
        max_query_len=shape.max_query_len,
        max_seq_len=shape.max_seq_len,
    )
    with torch.inference_mode():
        return model(
            inputs["input_ids"], inputs["positions"], caches, [metadata] * model.kv_cache_groups.num_groups
        )


# Prefill of three prompts (41 tokens: PIECEWISE at 48), decodes (FULL at 4 and at 1), a step too
# large for any graph (NONE), and a decode of four (FULL, unpadded).
SCHEDULES: list[tuple[dict[int, int], GraphMode, int]] = [
    ({0: 13, 1: 7, 2: 21}, GraphMode.PIECEWISE, 48),
    ({0: 1, 1: 1, 2: 1}, GraphMode.FULL, 4),
    ({0: 1, 1: 1, 2: 1}, GraphMode.FULL, 4),
    ({0: 1, 1: 1, 2: 1, 3: 60}, GraphMode.NONE, 63),
    ({0: 1, 1: 1, 2: 1, 3: 1}, GraphMode.FULL, 4),
    ({1: 1}, GraphMode.FULL, 1),
    ({0: 2, 3: 1}, GraphMode.PIECEWISE, 4),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_replayed_steps_match_the_model_run_op_by_op(variant: str) -> None:
    model = load_tiny(variant)
    device = model.embed_tokens.weight.device
    seqs_ref = Sequences([13, 7, 21, 60], device)
    seqs_graph = Sequences([13, 7, 21, 60], device)
    caches_ref = nan_caches(model, seqs_ref.num_blocks)
    caches_graph = nan_caches(model, seqs_ref.num_blocks)
    dispatcher = small_dispatcher()
    buffers = StaticInputBuffers(64, 8, MAX_MODEL_LEN // BLOCK_SIZE, device)
    runner = GraphRunner(
        model, caches_graph, dispatcher, recorder_for(variant), MAX_MODEL_LEN, check_addresses=True
    )
    runner.capture(buffers)
    # fp32 throughout; a padded GEMM may pick another cuBLAS kernel than the unpadded one.
    tol = 1e-4 if variant == "cuda" else 2e-5
    for schedule, want_mode, want_tokens in SCHEDULES:
        shape, inputs = seqs_ref.step(schedule)
        want = eager_reference(model, caches_ref, shape, inputs)
        shape, inputs = seqs_graph.step(schedule)
        buffers.write(shape, **inputs)
        mode, padded = dispatcher.dispatch(shape.batch_descriptor())
        assert (mode, padded.num_tokens) == (want_mode, want_tokens), schedule
        got = runner.run(mode, padded, buffers)
        assert got.shape[0] >= shape.num_tokens
        torch.testing.assert_close(got[: shape.num_tokens], want, atol=tol, rtol=tol)
        # Padded tokens wrote no KV: the caches agree slot for slot, NaN where nothing was written.
        for (k_graph, v_graph), (k_ref, v_ref) in zip(caches_graph, caches_ref, strict=True):
            torch.testing.assert_close(k_graph, k_ref, atol=tol, rtol=tol, equal_nan=True)
            torch.testing.assert_close(v_graph, v_ref, atol=tol, rtol=tol, equal_nan=True)
    assert dispatcher.num_fallbacks == 1


@pytest.mark.skipif(CUDA or INTERPRETED, reason="CUDA runs it here; the child runs only the Triton variant")
def test_triton_variant_under_interpreter() -> None:
    run_interpreted(__file__, "-k", "triton-interpreted")


def test_piecewise_pieces_without_padding_are_bitwise_the_model() -> None:
    model = load_tiny()
    seqs = Sequences([9, 30, 5], torch.device("cpu"))
    caches_ref, caches_graph = nan_caches(model, seqs.num_blocks), nan_caches(model, seqs.num_blocks)
    dispatcher = GraphDispatcher(frozenset({GraphMode.PIECEWISE}), PaddingTable([]), PaddingTable([44]))
    buffers = StaticInputBuffers(64, 4, MAX_MODEL_LEN // BLOCK_SIZE, torch.device("cpu"))
    runner = GraphRunner(
        model, caches_graph, dispatcher, replay_by_calling, MAX_MODEL_LEN, check_addresses=True
    )
    runner.capture(buffers)
    shape, inputs = seqs.step({0: 9, 1: 30, 2: 5})
    want = eager_reference(model, caches_ref, shape, inputs)
    buffers.write(shape, **inputs)
    mode, padded = dispatcher.dispatch(shape.batch_descriptor())
    assert (mode, padded.num_tokens) == (GraphMode.PIECEWISE, 44)
    assert torch.equal(runner.run(mode, padded, buffers), want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_model_with_nothing_to_capture_is_never_cut_into_pieces(variant: str) -> None:
    """A Gemma runs eagerly on CUDA (its layers are not Llama's, which the pieces mirror): with nothing to
    capture, the runner builds no pieces and runs every step op by op. Its windowed and global layers
    read a block table each (here the same one: every layer has caches of its own)."""
    model = load_tiny(variant, "gemma2")
    groups = model.kv_cache_groups.num_groups
    assert groups == 2
    device = model.embed_tokens.weight.device
    seqs_ref, seqs_eager = Sequences([9, 30], device), Sequences([9, 30], device)
    caches_ref, caches_eager = nan_caches(model, seqs_ref.num_blocks), nan_caches(model, seqs_ref.num_blocks)
    dispatcher = small_dispatcher(frozenset())
    buffers = StaticInputBuffers(64, 4, MAX_MODEL_LEN // BLOCK_SIZE, device, groups)
    runner = GraphRunner(model, caches_eager, dispatcher, recorder_for(variant), MAX_MODEL_LEN)
    runner.capture(buffers)
    for schedule in ({0: 9, 1: 30}, {0: 1, 1: 1}):
        shape, inputs = seqs_ref.step(schedule)
        want = eager_reference(model, caches_ref, shape, inputs)
        shape, inputs = seqs_eager.step(schedule)
        for name in ("slot_mapping", "block_table"):
            inputs[name] = torch.stack([inputs[name]] * groups)
        buffers.write(shape, **inputs)
        mode, padded = dispatcher.dispatch(shape.batch_descriptor())
        assert mode is GraphMode.NONE
        torch.testing.assert_close(runner.run(mode, padded, buffers)[: shape.num_tokens], want)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.values[0] != "triton-interpreted"])
def test_an_encoder_runs_eagerly_through_the_runner(variant: str, tmp_path: Path) -> None:
    """An encoder has no embed_tokens and no graphs: the runner is built without sizing a graph buffer by
    them, and runs its steps op by op."""
    device = torch.device("cuda" if variant == "cuda" else "cpu")
    folder = write_tiny_encoder("bert", tmp_path / "bert", "mean_tokens", True)
    encoder = load_encoder(read_model_spec(folder), torch.float32, device, True, True)
    seqs = Sequences([9, 30], device)
    dispatcher = small_dispatcher(frozenset())
    buffers = StaticInputBuffers(64, 4, MAX_MODEL_LEN // BLOCK_SIZE, device)
    runner = GraphRunner(encoder, [], dispatcher, recorder_for(variant), MAX_MODEL_LEN)  # type: ignore[arg-type]
    runner.capture(buffers)
    shape, inputs = seqs.step({0: 9, 1: 30})
    buffers.write(shape, **inputs)
    mode, padded = dispatcher.dispatch(shape.batch_descriptor())
    assert mode is GraphMode.NONE
    want = encoder(inputs["input_ids"], inputs["positions"], [], buffers.step_metadata())
    torch.testing.assert_close(runner.run(mode, padded, buffers)[: shape.num_tokens], want)


def test_capture_covers_every_shape_largest_first_with_one_graph_per_piece() -> None:
    model = load_tiny()
    captured: list[int] = []

    def counting(fn: Callable[[], None]) -> Replay:
        captured.append(len(captured))
        return fn

    dispatcher = small_dispatcher()
    buffers = StaticInputBuffers(64, 8, MAX_MODEL_LEN // BLOCK_SIZE, torch.device("cpu"))
    caches = nan_caches(model, 8)
    order: list[int] = []
    original = buffers.fill_dummy

    def tracking(num_tokens: int, num_reqs: int) -> None:
        order.append(num_tokens)
        original(num_tokens, num_reqs)

    buffers.fill_dummy = tracking  # type: ignore[method-assign]
    GraphRunner(model, caches, dispatcher, counting, MAX_MODEL_LEN).capture(buffers)
    num_pieces = len(model.layers) + 1
    assert len(captured) == 4 + 4 * num_pieces
    assert order == sorted(order, reverse=True)
    # Capturing wrote no KV.
    assert all(torch.isnan(k).all() and torch.isnan(v).all() for k, v in caches)


def test_a_moved_buffer_stops_the_replay() -> None:
    model = load_tiny()
    seqs = Sequences([3, 4], torch.device("cpu"))
    dispatcher = small_dispatcher()
    buffers = StaticInputBuffers(64, 8, MAX_MODEL_LEN // BLOCK_SIZE, torch.device("cpu"))
    caches = nan_caches(model, seqs.num_blocks)
    runner = GraphRunner(model, caches, dispatcher, replay_by_calling, MAX_MODEL_LEN, check_addresses=True)
    runner.capture(buffers)
    buffers.seq_lens = buffers.seq_lens.clone()
    shape, inputs = seqs.step({0: 3, 1: 4})
    buffers.write(shape, **inputs)
    mode, padded = dispatcher.dispatch(shape.batch_descriptor())
    with pytest.raises(GraphAddressError, match="seq_lens"):
        runner.run(mode, padded, buffers)
    # Eager steps read the buffers as they are now, so they need no check.
    runner.run(GraphMode.NONE, shape.batch_descriptor(), buffers)


def test_graph_runner_refuses_a_shape_free_dispatcher() -> None:
    model = load_tiny()
    dispatcher = GraphDispatcher(BOTH, PaddingTable([1]), PaddingTable([1]), shape_free=True)
    with pytest.raises(AssertionError, match="shape-free"):
        GraphRunner(model, nan_caches(model, 2), dispatcher, replay_by_calling, MAX_MODEL_LEN)
