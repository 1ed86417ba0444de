"""The CPU's own graph: a Llama-family forward pass as kernel-library calls over activation buffers
allocated once (csrc/cpu/model_step.h).

The graph dispatcher's modes map onto it as follows:
- FULL (`forward_full`): the whole forward, embedding to final norm with every layer's KV write and
  paged attention, in one call with the GIL released. Single rank only.
- PIECEWISE (`forward_piecewise`): the model's own forward with each layer's three dense stages
  replaced by one call each; attention, and under tensor parallelism the all-reduces, stay in
  Python between them.
- NONE: the model's eager forward; `cpu_model_step_for` returns None for --enforce-eager, at the
  "none" tier (no kernels), where the weights were left unpacked (--no-packed-linear: the step
  multiplies packed weights only), and for a mixture of experts under --no-fused-moe.
Each is bitwise the eager forward. Any batch from 1 to max_num_tokens tokens runs unpadded; the
hidden states returned are a view of a buffer that the next step overwrites.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from sluice.config import GraphConfig
from worker import native_abi as abi
from worker.attention.backend import AttentionMetadata
from worker.attention.cpu_backend import CpuAttentionBackend
from worker.graphs.dispatcher import BatchDescriptor, GraphMode
from worker.graphs.graph_runner import eager_forward
from worker.graphs.input_buffers import StaticInputBuffers
from worker.models.bert import BertEncoder
from worker.models.llama import DecoderLayer, LlamaForCausalLM
from worker.native_ops import (
    NativeOps,
    batch,
    cpu_kernels,
    is_packed_weight,
    kv_cache,
    matrix,
    packed_ref,
    slots,
)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class ModelStep:
    """The library's model step over this model's weights and a workspace of max_tokens rows."""

    def __init__(
        self,
        ops: NativeOps,
        model: LlamaForCausalLM,
        max_tokens: int,
        decode_attention: bool,
        split_keys: bool,
    ) -> None:
        self.ops = ops
        self.library = ops.library
        layers = model.layers
        self.hidden = model.embed_tokens.weight.shape[1]
        self.max_tokens = max_tokens
        widths = {
            "normed": self.hidden,
            "qkv": max((t.num_heads + 2 * t.num_kv_heads) * t.head_dim for t in _tensors(layers)),
            "attn": max(t.num_heads * t.head_dim for t in _tensors(layers)),
            "attn_out": self.hidden,
            "gate_up": max(2 * layer.mlp.inner for layer in layers),
            "act": max(layer.mlp.inner for layer in layers),
            "mlp_out": self.hidden,
            "residual": self.hidden,
            "cos": model.rotary.cos.shape[1],
            "sin": model.rotary.cos.shape[1],
            "hidden": self.hidden,
        }
        dtype = model.dtype
        # Flat buffers: a layer of any width views the first n * width elements as [n, width]; gate_up is
        # written only where the weight is not packed gated, so otherwise its pages stay untouched.
        self.buffers = {name: torch.empty(max_tokens * width, dtype=dtype) for name, width in widths.items()}
        self.widths = widths
        self._layer_structs = (abi.LayerWeights * len(layers))(
            *(_layer_weights(ops, layer) for layer in layers)
        )
        shape = abi.ModelShape(
            abi.DTYPE_OF[dtype],
            self.hidden,
            model.embed_tokens.weight.shape[0],
            max_tokens,
            model.rotary.cos.shape[0],
            model.rotary.cos.shape[1],
        )
        workspace = abi.Workspace(*(self.buffers[name].data_ptr() for name, _ in abi.Workspace._fields_))
        # The step reads these tensors' memory for its whole life: they are held here.
        self._held = (model.embed_tokens.weight, model.norm.weight, model.rotary.cos, model.rotary.sin_signed)
        handle = self.library.sluice_model_step_new(
            self._layer_structs,
            len(layers),
            ctypes.byref(shape),
            model.embed_tokens.weight.data_ptr(),
            model.norm.weight.data_ptr(),
            model.norm.eps,
            model.rotary.cos.data_ptr(),
            model.rotary.sin_signed.data_ptr(),
            ctypes.byref(workspace),
            int(decode_attention),
            int(split_keys),
        )
        if not handle:
            ops.check(1)
        self.handle = handle
        self._caches: ctypes.Array | None = None

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self.library.sluice_model_step_free(self.handle)

    def rows(self, name: str, n: int, width: int | None = None) -> torch.Tensor:
        """The first n rows of a workspace buffer as a contiguous [n, width] tensor."""
        width = self.widths[name] if width is None else width
        return self.buffers[name][: n * width].view(n, width)

    def set_kv_caches(self, kv_caches: KVCaches) -> None:
        caches = (abi.KvCache * len(kv_caches))(*(kv_cache(k, v) for k, v in kv_caches))
        self.ops.check(self.library.sluice_model_step_set_kv_caches(self.handle, caches, len(kv_caches)))
        self._caches = caches

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Sequence[AttentionMetadata]
    ) -> torch.Tensor:
        """metadata: the KV cache groups' (FULL runs a model of one group: supports_full)."""
        (step,) = metadata
        n = input_ids.shape[0]
        if (
            input_ids.dtype != torch.int64
            or positions.dtype != torch.int64
            or positions.shape != input_ids.shape
        ):
            raise ValueError("input_ids and positions must be [num_tokens] int64 each")
        self.ops.check(
            self.library.sluice_model_step_forward(
                self.handle,
                input_ids.data_ptr(),
                positions.data_ptr(),
                n,
                ctypes.byref(slots(step.slot_mapping)),
                ctypes.byref(batch(step.block_table, step.query_start_loc, step.seq_lens)),
            )
        )
        return self.rows("hidden", n)


class DecoderStages:
    """One layer's three dense stages (PIECEWISE), as llama.py's DenseStages: calls into the model step,
    whose results are views of its workspace, valid until the same stage of any layer runs again."""

    def __init__(self, step: ModelStep, index: int, layer: DecoderLayer) -> None:
        self.step = step
        self.index = index
        t = layer.tensors
        self.num_heads, self.num_kv_heads, self.head_dim = t.num_heads, t.num_kv_heads, t.head_dim
        self.qkv_width = (t.num_heads + 2 * t.num_kv_heads) * t.head_dim

    def attention_input(
        self, delta: torch.Tensor | None, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        step = self.step
        delta_matrix = None if delta is None else ctypes.byref(matrix(delta))
        step.ops.check(
            step.library.sluice_model_step_attention_input(
                step.handle,
                self.index,
                delta_matrix,
                ctypes.byref(matrix(residual)),
                ctypes.byref(matrix(cos)),
                ctypes.byref(matrix(sin)),
            )
        )
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = step.rows("qkv", residual.shape[0], self.qkv_width).view(-1, heads, self.head_dim)
        q_end, k_end = self.num_heads, self.num_heads + self.num_kv_heads
        return qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]

    def attention_output(self, attn: torch.Tensor) -> torch.Tensor:
        step = self.step
        flat = attn.view(attn.shape[0], -1)
        step.ops.check(
            step.library.sluice_model_step_attention_output(
                step.handle, self.index, ctypes.byref(matrix(flat))
            )
        )
        return step.rows("attn_out", attn.shape[0])

    def feed_forward(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        step = self.step
        step.ops.check(
            step.library.sluice_model_step_feed_forward(
                step.handle, self.index, ctypes.byref(matrix(delta)), ctypes.byref(matrix(residual))
            )
        )
        return step.rows("mlp_out", residual.shape[0])


class CpuModelStep:
    """Built once after the model is loaded (and its weights are in their final form)."""

    def __init__(
        self, ops: NativeOps, model: LlamaForCausalLM, max_num_tokens: int, tensor_parallel_size: int = 1
    ) -> None:
        assert model.embed_tokens.weight.device.type == "cpu", "the kernel step runs CPU models only"
        self.model = model
        self.max_num_tokens = max_num_tokens
        attention = model.attention
        cpu_attention = isinstance(attention, CpuAttentionBackend)
        self._step = ModelStep(
            ops,
            model,
            max_num_tokens,
            # FULL runs only over the CPU backend (supports_full), so it follows that backend's settings.
            decode_attention=attention.decode_path if cpu_attention else True,
            split_keys=attention.split_keys if cpu_attention else True,
        )
        # One DecoderStages per layer, each with DecoderLayer's three stage methods.
        self.stages = [DecoderStages(self._step, i, layer) for i, layer in enumerate(model.layers)]
        # FULL hard-codes the kernels' attention, a whole-vocabulary embedding and one block table (a
        # hybrid KV cache's layers read their group's: PIECEWISE, whose attention runs per layer in Python).
        self.supports_full = (
            tensor_parallel_size == 1 and cpu_attention and model.kv_cache_groups.num_groups == 1
        )
        self._bound_kv_caches: KVCaches | None = None

    def fits(self, num_tokens: int) -> bool:
        return 1 <= num_tokens <= self.max_num_tokens

    def forward_full(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        metadata: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """Final-normed hidden states [num_tokens, hidden], as LlamaForCausalLM.forward returns them."""
        assert self.supports_full, "FULL needs a single rank and the CPU attention backend"
        # The runner allocates its cache list once; binding it costs a conversion per layer, so only on change.
        if kv_caches is not self._bound_kv_caches:
            self._step.set_kv_caches(kv_caches)
            self._bound_kv_caches = kv_caches
        return self._step.forward(input_ids, positions, metadata)

    def forward_piecewise(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        metadata: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        return self.model.forward(input_ids, positions, kv_caches, metadata, stages=self.stages)

    def workspace_data_ptrs(self) -> list[int]:
        """Addresses of the step's buffers, which stay fixed for its lifetime."""
        return [buffer.data_ptr() for buffer in self._step.buffers.values()]


def cpu_model_step_for(
    model: LlamaForCausalLM | BertEncoder, graph: GraphConfig, max_num_tokens: int, tensor_parallel_size: int
) -> CpuModelStep | None:
    """The fast path for a CPU model, or None where every step is to run eagerly: --enforce-eager, the
    "none" tier, weights left unpacked (--no-packed-linear), experts run one by one (--no-fused-moe:
    the step runs MoE layers in the kernels' one call only), or layers that are not Llama's (Gemma's,
    an encoder's)."""
    if not model.runs_llama_layers or graph.enforce_eager or graph.mode == "none":
        return None
    if model.embed_tokens.weight.device.type != "cpu" or (model.has_experts and not model.fused_moe):
        return None
    ops = cpu_kernels()
    if ops is None or not is_packed_weight(model.layers[0].tensors.qkv_weight):
        return None
    return CpuModelStep(ops, model, max_num_tokens, tensor_parallel_size)


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


def _tensors(layers: torch.nn.ModuleList) -> list:
    return [layer.tensors for layer in layers]


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _layer_weights(ops: NativeOps, layer: DecoderLayer) -> abi.LayerWeights:
    t = layer.tensors
    return abi.LayerWeights(
        input_norm=t.input_norm.data_ptr(),
        post_norm=t.post_norm.data_ptr(),
        eps=t.eps,
        qkv=packed_ref(t.qkv_weight),
        qkv_bias=_pointer(t.qkv_bias),
        o=packed_ref(t.o_weight),
        o_bias=_pointer(t.o_bias),
        gate_up=packed_ref(t.gate_up_weight),
        gate_up_bias=_pointer(t.gate_up_bias),
        down=packed_ref(t.down_weight),
        down_bias=_pointer(t.down_bias),
        # ops holds the MoeWeights (and its arrays) as long as the layer's tensors live.
        moe=None if t.moe is None else ctypes.pointer(ops.moe_weights(t.moe)),
        q_norm=_pointer(t.q_norm),
        k_norm=_pointer(t.k_norm),
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        # From the module, not a weight's shape: a packed weight's shape is its layout's, not [out, in].
        intermediate_size=0 if t.moe is not None else layer.mlp.inner,
        sliding_window=t.sliding_window,
        scale=t.scale,
    )
