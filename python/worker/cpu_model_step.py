"""The CPU's own graph: a Llama-family forward pass as C++ calls over activation buffers allocated once.

The graph dispatcher's modes map onto it as follows:
- FULL (`forward_full`): the whole forward, embedding to final norm with every layer's KV write and
  paged attention, in one C++ call with the GIL released. Single rank only.
- PIECEWISE (`forward_piecewise`): the model's own forward with each layer's three dense stages
  replaced by one C++ call each; attention, and under tensor parallelism the all-reduces, stay in
  Python between them.
- NONE: the model's eager forward; `cpu_model_step_for` returns None for --enforce-eager.
Each is bitwise the eager forward. Any batch from 1 to max_num_tokens tokens runs unpadded; the
hidden states returned are a view of a buffer that the next step overwrites.
"""

from __future__ import annotations

from dataclasses import fields
from types import ModuleType

import torch

from sluice.config import GraphConfig
from worker.attention.backend import AttentionMetadata
from worker.attention.cpu_backend import CpuAttentionBackend
from worker.graphs.dispatcher import BatchDescriptor, GraphMode
from worker.graphs.graph_runner import eager_forward
from worker.graphs.input_buffers import StaticInputBuffers
from worker.models.llama import DecoderLayer, LlamaForCausalLM
from worker.native_ops import load_native_ops

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class CpuModelStep:
    """Built once after the model is loaded (and its weights are in their final form)."""

    def __init__(self, model: LlamaForCausalLM, max_num_tokens: int, tensor_parallel_size: int = 1) -> None:
        assert model.embed_tokens.weight.device.type == "cpu", "the C++ step runs CPU models only"
        native = load_native_ops()
        self.model = model
        self.max_num_tokens = max_num_tokens
        attention = model.attention
        cpu_attention = isinstance(attention, CpuAttentionBackend)
        self._step = native.ModelStep(
            [_layer_weights(native, layer) for layer in model.layers],
            embedding=model.embed_tokens.weight,
            final_norm=model.norm.weight,
            final_eps=model.norm.eps,
            cos_table=model.rotary.cos,
            sin_table=model.rotary.sin_signed,
            max_tokens=max_num_tokens,
            # FULL runs only over the CPU backend (supports_full), so it follows that backend's settings.
            decode_attention=attention.decode_path if cpu_attention else True,
            decode_split_keys=attention.split_keys if cpu_attention else True,
        )
        # One C++ DecoderStages per layer, each with DecoderLayer's three stage methods.
        self.stages = self._step.layers
        # FULL hard-codes the C++ attention kernels and a whole-vocabulary embedding.
        self.supports_full = tensor_parallel_size == 1 and cpu_attention
        self._bound_kv_caches: KVCaches | None = None

    def fits(self, num_tokens: int) -> bool:
        return 1 <= num_tokens <= self.max_num_tokens

    def forward_full(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states [num_tokens, hidden], as LlamaForCausalLM.forward returns them."""
        assert self.supports_full, "FULL needs a single rank and the CPU attention backend"
        # The runner allocates its cache list once; binding it costs a conversion per layer, so only on change.
        if kv_caches is not self._bound_kv_caches:
            self._step.set_kv_caches(kv_caches)
            self._bound_kv_caches = kv_caches
        return self._step.forward(
            input_ids,
            positions,
            metadata.slot_mapping,
            metadata.block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
        )

    def forward_piecewise(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model.forward(input_ids, positions, kv_caches, metadata, stages=self.stages)

    def workspace_data_ptrs(self) -> list[int]:
        """Addresses of the step's buffers, which stay fixed for its lifetime."""
        return [buffer.data_ptr() for buffer in self._step.workspace_buffers()]


def cpu_model_step_for(
    model: LlamaForCausalLM, graph: GraphConfig, max_num_tokens: int, tensor_parallel_size: int
) -> CpuModelStep | None:
    """The fast path for a CPU model, or None where every step is to run eagerly (--enforce-eager)."""
    if graph.enforce_eager or graph.mode == "none" or model.embed_tokens.weight.device.type != "cpu":
        return None
    return CpuModelStep(model, max_num_tokens, tensor_parallel_size)


class CpuStepRunner:
    """The CPU's StepExecutor: FULL and PIECEWISE run the C++ step at the batch's own size (the CPU's
    dispatcher is shape-free, so nothing is captured or padded), NONE the model's eager forward."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: KVCaches, step: CpuModelStep | None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.step = step

    def capture(self, buffers: StaticInputBuffers) -> None:
        # Nothing to record: the C++ step's workspaces were allocated when it was built.
        assert self.step is None or buffers.input_ids.shape[0] <= self.step.max_num_tokens

    def run(self, mode: GraphMode, padded: BatchDescriptor, buffers: StaticInputBuffers) -> torch.Tensor:
        shape = buffers.shape
        assert shape is not None, "set_shape before running a step"
        # Shape-free: the dispatcher never pads a CPU step.
        assert padded.num_tokens == shape.num_tokens, (padded, shape)
        if mode is GraphMode.NONE or self.step is None:
            return eager_forward(self.model, self.kv_caches, buffers)
        n = shape.num_tokens
        forward = self.step.forward_full if mode is GraphMode.FULL else self.step.forward_piecewise
        return forward(buffers.input_ids[:n], buffers.positions[:n], self.kv_caches, buffers.step_metadata())


def _layer_weights(native: ModuleType, layer: DecoderLayer) -> object:
    tensors = layer.tensors
    # Not dataclasses.asdict: that deep-copies the tensors, and the step must share the model's.
    values = {f.name: getattr(tensors, f.name) for f in fields(tensors)}
    # From the module, not a weight's shape: a packed weight's shape is its layout's, not [out, in].
    values["intermediate_size"] = layer.mlp.inner
    return native.DecoderLayerWeights(**values)
