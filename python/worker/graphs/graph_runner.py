"""Runs a step's forward in the mode the dispatcher chose: replays captured graphs, or runs eagerly.

The runner is device-agnostic: capturing is delegated to a recorder (cuda_graphs.CudaGraphRecorder
on CUDA), a function that takes a closure over static tensors and returns the callable that replays
it. Every graph reads the StaticInputBuffers it was captured on, and writes its result into one
static hidden-state tensor that the runner returns a view of.

The model runner's calls (any StepExecutor; on CPU the C++ step runner takes GraphRunner's place):
    runner = GraphRunner(model, kv_caches, dispatcher, recorder, max_model_len)
    runner.capture(buffers)                       # once at startup, after the KV cache exists
    # each step: write inputs into buffers (write(), or the views then set_shape()), then
    mode, padded = dispatcher.dispatch(buffers.shape.batch_descriptor())
    hidden = runner.run(mode, padded, buffers)    # the step's rows first; valid until the next run
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from worker.graphs.dispatcher import BatchDescriptor, GraphDispatcher, GraphMode
from worker.graphs.input_buffers import DEBUG_GRAPHS, AddressRecord, StaticInputBuffers
from worker.graphs.model_pieces import ModelPieces
from worker.models.llama import LlamaForCausalLM

Replay = Callable[[], None]
# Captures a closure over static tensors; returns what replays it (the closure itself, when eager).
Recorder = Callable[[Callable[[], None]], Replay]


class StepExecutor(Protocol):
    """What runs a dispatched step: GraphRunner on CUDA, the C++ step runner on CPU."""

    def capture(self, buffers: StaticInputBuffers) -> None: ...

    def run(self, mode: GraphMode, padded: BatchDescriptor, buffers: StaticInputBuffers) -> torch.Tensor:
        """Hidden states whose first rows are the step's tokens, for any mode the dispatcher picks."""
        ...


def eager_forward(
    model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buffers: StaticInputBuffers
) -> torch.Tensor:
    """Mode NONE: the model op by op over the step's unpadded rows of the buffers."""
    shape = buffers.shape
    assert shape is not None, "set_shape before running a step"
    n = shape.num_tokens
    return model(buffers.input_ids[:n], buffers.positions[:n], kv_caches, buffers.step_metadata())


class GraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        dispatcher: GraphDispatcher,
        recorder: Recorder,
        max_model_len: int,
        check_addresses: bool = DEBUG_GRAPHS,
    ) -> None:
        assert not dispatcher.shape_free, (
            "a shape-free device (CPU) runs FULL and PIECEWISE in its own step runner"
        )
        self.model = model
        self.kv_caches = kv_caches
        self.recorder = recorder
        self.max_model_len = max_model_len
        self.check_addresses = check_addresses
        self._wanted = dispatcher.capture_descriptors()
        max_tokens = max((desc.num_tokens for _, desc in self._wanted), default=0)
        # Every graph writes its hidden states here; run() returns a view of it. A model that no graph
        # captures (an encoder, a Gemma, --enforce-eager) has nothing to write, and an encoder has no
        # embed_tokens to size it by.
        self._hidden = (
            torch.zeros(
                max_tokens,
                model.embed_tokens.weight.shape[1],
                dtype=model.dtype,
                device=model.embed_tokens.weight.device,
            )
            if self._wanted
            else torch.empty(0, 0)
        )
        # Only PIECEWISE graphs cut the model into Llama's pieces; a model that runs eagerly (a Gemma, or
        # --enforce-eager) is never cut.
        piecewise = any(mode is GraphMode.PIECEWISE for mode, _ in self._wanted)
        self._pieces = ModelPieces(model, max_tokens, self._hidden) if piecewise else None
        self._full: dict[int, Replay] = {}
        self._piecewise: dict[int, list[Replay]] = {}
        self._addresses: AddressRecord | None = None

    @torch.inference_mode()
    def capture(self, buffers: StaticInputBuffers) -> None:
        """Capture every graph the dispatcher may pick, largest shape first."""
        assert self._hidden.shape[0] <= buffers.max_num_tokens, (self._hidden.shape, buffers.max_num_tokens)
        for mode, desc in self._wanted:
            if mode is GraphMode.FULL:
                self._full[desc.num_tokens] = self._capture_full(desc, buffers)
            else:
                self._piecewise[desc.num_tokens] = self._capture_piecewise(desc, buffers)
        self._addresses = AddressRecord(self._read_tensors(buffers))

    def _capture_full(self, desc: BatchDescriptor, buffers: StaticInputBuffers) -> Replay:
        size = desc.num_tokens
        assert desc.uniform_decode and desc.num_reqs == size, desc
        assert size <= buffers.max_num_reqs, f"a FULL graph of {size} requests needs buffers that wide"
        buffers.fill_dummy(size, size)
        # Attention inside the graph: lengths come from the tensors, and the longest context is
        # fixed at capture to max_model_len, so no per-step host value is baked into the graph.
        metadata = buffers.metadata(size, size, max_query_len=1, max_seq_len=self.max_model_len)
        input_ids, positions = buffers.input_ids[:size], buffers.positions[:size]
        hidden_out = self._hidden[:size]
        model, kv_caches = self.model, self.kv_caches

        def full_forward() -> None:
            hidden_out.copy_(model(input_ids, positions, kv_caches, metadata))

        return self.recorder(full_forward)

    def _capture_piecewise(self, desc: BatchDescriptor, buffers: StaticInputBuffers) -> list[Replay]:
        size = desc.num_tokens
        buffers.fill_dummy(size, 1)
        pieces = self._pieces
        assert pieces is not None
        input_ids, positions = buffers.input_ids[:size], buffers.positions[:size]
        return [self.recorder(pieces.piece(i, input_ids, positions)) for i in range(pieces.num_pieces)]

    @torch.inference_mode()
    def run(self, mode: GraphMode, padded: BatchDescriptor, buffers: StaticInputBuffers) -> torch.Tensor:
        """Hidden states [padded.num_tokens or more, hidden]; the step's rows come first."""
        if mode is GraphMode.NONE:
            return eager_forward(self.model, self.kv_caches, buffers)
        if self.check_addresses:
            assert self._addresses is not None, "run before capture"
            self._addresses.check(self._read_tensors(buffers))
        buffers.pad(padded)
        if mode is GraphMode.FULL:
            self._full[padded.num_tokens]()
        else:
            self._run_piecewise(self._piecewise[padded.num_tokens], buffers)
        return self._hidden[: padded.num_tokens]

    def _run_piecewise(self, replays: list[Replay], buffers: StaticInputBuffers) -> None:
        pieces = self._pieces
        assert pieces is not None
        metadata = buffers.step_metadata()
        for layer_index, kv_cache in enumerate(self.kv_caches):
            replays[layer_index]()
            pieces.attention(layer_index, kv_cache, metadata)
        replays[-1]()

    def _read_tensors(self, buffers: StaticInputBuffers) -> dict[str, torch.Tensor]:
        """Every tensor some graph reads or writes, by name, for the address record."""
        tensors = buffers.named_tensors()
        for i, (key_cache, value_cache) in enumerate(self.kv_caches):
            tensors[f"key_cache[{i}]"] = key_cache
            tensors[f"value_cache[{i}]"] = value_cache
        return tensors
