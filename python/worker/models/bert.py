"""Encoder models of the BERT family (BertModel, XLMRobertaModel) for the pooling runner, and their
cross-encoders (*ForSequenceClassification), which score a pair of texts through a classification head.

Post-LayerNorm encoder layers: bidirectional self-attention with biases, then a GELU feed-forward,
each added to its input and normalised. Every prompt is encoded whole in one step (the scheduler never
chunks an encoder's prompt), so attention needs no KV cache: each sequence of the step attends to
itself alone, reading q, k and v in place from one fused QKV projection. The linears, attention and GELU
run on the layer ops of the process's CPU tier (packed weights, as the decoders' do; attention and GELU
unless KernelConfig.cpu_encoder_kernels is off); LayerNorm is torch's.

A pair's token types ride in the step's token ids (pack_token_types, as vLLM V1 passes them): the
forward takes the same inputs as a decoder's, through the same step executors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.errors import UnsupportedArchitectureError
from sluice.kv_cache_groups import kv_cache_groups
from worker.attention.backend import AttentionMetadata
from worker.distributed import TensorParallelGroup, tensor_parallel_group
from worker.layer_ops import LayerOps, layer_ops_for, sdpa_within_sequences
from worker.models.layers import Projection
from worker.quantized_weights import QuantizedParts

# hidden_act -> the activation (transformers' names).
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Checkpoint prefixes of the same weights inside task models (BertForMaskedLM's "bert.", ...).
_PREFIXES = ("bert.", "roberta.")
# A token id's bits from here up hold its token type; vocabularies stay far below 2**30.
TOKEN_TYPE_SHIFT = 30
# The classification head's tensors -> ours: BERT's pooler then classifier, RoBERTa's head (one
# tanh layer on the first token, then the output), the same computation.
_HEAD_NAMES = {
    "bert.pooler.dense": "head_dense",
    "classifier": "head_out",
    "classifier.dense": "head_dense",
    "classifier.out_proj": "head_out",
}


def pack_token_types(token_ids: torch.Tensor, token_types: torch.Tensor) -> None:
    """Put each token's type (0 or 1) into the high bits of its id, in place."""
    token_ids.bitwise_or_(token_types.to(token_ids.dtype) << TOKEN_TYPE_SHIFT)


# LayerOps.attention_within_sequences' signature: (query, key, value, query_start_loc, num_seqs, scale) -> out.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


class EncoderLayer(nn.Module):
    """Under tensor parallelism split as a decoder's layer is: this rank's heads of q, k and v and its
    part of the feed-forward's width (column), the output projections' matching inputs (row), whose
    partial sums the ranks add up before each residual and LayerNorm."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_heads: int,
        eps: float,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        # sluice.parallel_validation.check_tensor_parallel refuses sizes that do not divide these.
        assert num_heads % tp.size == 0 and intermediate % tp.size == 0, (num_heads, intermediate)
        self.tp = tp
        self.num_heads = num_heads // tp.size
        self.head_dim = hidden // num_heads
        width = hidden // tp.size
        # This rank's heads of query, key and value, one after the other (the loader fills each part).
        self.qkv = Projection(hidden, 3 * width, True, dtype, "column")
        self.attention_out = Projection(width, hidden, True, dtype, "row")
        self.attention_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.intermediate = Projection(hidden, intermediate // tp.size, True, dtype, "column")
        self.output = Projection(intermediate // tp.size, hidden, True, dtype, "row")
        self.output_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)

    def _row_parallel(self, ops: LayerOps, x: torch.Tensor, projection: Projection) -> torch.Tensor:
        # Every rank's partial sum, added up; one rank adds the bias.
        bias = projection.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(ops.linear(x, projection.weight, bias))

    def forward(
        self, x: torch.Tensor, starts: torch.Tensor, ops: LayerOps, activation: Any, attend: Attend
    ) -> torch.Tensor:
        """starts: where each sequence of the step starts, and the end ([num_seqs + 1] int32, on the CPU)."""
        qkv = ops.linear(x, self.qkv.weight, self.qkv.bias).view(
            x.shape[0], 3 * self.num_heads, self.head_dim
        )
        q, k, v = qkv.chunk(3, dim=1)
        attended = attend(q, k, v, starts, starts.shape[0] - 1, self.head_dim**-0.5).flatten(1)
        x = self.attention_norm(x + self._row_parallel(ops, attended, self.attention_out))
        inner = activation(ops.linear(x, self.intermediate.weight, self.intermediate.bias))
        return self.output_norm(x + self._row_parallel(ops, inner, self.output))


class BertEncoder(nn.Module):
    """The encoder with the runner's model interface: forward(ids, positions, kv_caches, metadata) -> hidden."""

    # What the model runner asks of every model: no experts, no Llama layers for the C++ step.
    has_experts = False
    runs_llama_layers = False

    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        cross_encoder: bool = False,
        tp: TensorParallelGroup | None = None,
        kernel_ops: bool = True,
    ) -> None:
        """kernel_ops: attention and GELU on the layer ops (KernelConfig.cpu_encoder_kernels); False runs
        torch's SDPA one sequence at a time and torch's GELU."""
        super().__init__()
        self.tp = tp or tensor_parallel_group()
        if hf_config.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedArchitectureError(
                f"position_embedding_type {hf_config['position_embedding_type']!r}: Sluice's encoders have absolute positions"
            )
        activation = hf_config.get("hidden_act", "gelu")
        if activation not in _ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"hidden_act {activation!r}: Sluice's encoders run {', '.join(_ACTIVATIONS)}"
            )
        self.dtype = dtype
        hidden = int(hf_config["hidden_size"])
        eps = float(hf_config.get("layer_norm_eps", 1e-12))
        heads = int(hf_config["num_attention_heads"])
        self.head_dim = hidden // heads
        self.ops = layer_ops_for(torch.get_default_device())
        self.activation = self.ops.gelu if activation == "gelu" and kernel_ops else _ACTIVATIONS[activation]
        # The attention kernel takes head dims in multiples of 16.
        kernel_attention = kernel_ops and self.head_dim % 16 == 0
        self.attend: Attend = (
            self.ops.attention_within_sequences if kernel_attention else sdpa_within_sequences
        )
        # This rank's heads: what the runner's (unused) KV cache is sized by.
        self.num_kv_heads = heads // self.tp.size
        # RoBERTa's positions start after its padding index (transformers' create_position_ids_from_input_ids).
        roberta = hf_config.get("model_type") in ("xlm-roberta", "roberta")
        self.position_offset = int(hf_config.get("pad_token_id", 1)) + 1 if roberta else 0
        self.word_embeddings = nn.Embedding(int(hf_config["vocab_size"]), hidden, dtype=dtype)
        self.position_embeddings = nn.Embedding(
            int(hf_config["max_position_embeddings"]), hidden, dtype=dtype
        )
        self.token_type_embeddings = nn.Embedding(
            int(hf_config.get("type_vocab_size", 2)), hidden, dtype=dtype
        )
        self.embeddings_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.layers = nn.ModuleList(
            EncoderLayer(hidden, int(hf_config["intermediate_size"]), heads, eps, dtype, self.tp)
            for _ in range(int(hf_config["num_hidden_layers"]))
        )
        # One group, as sluice/kv_cache_groups.py's model_kv_cache_groups gives an encoder.
        self.kv_cache_groups = kv_cache_groups([0] * len(self.layers))
        # A cross-encoder's head (model_spec.CROSS_ENCODER_ARCHITECTURES, one label): tanh(dense) of
        # the first token's state, then its logit.
        # The head stays float under --quantization: one row per request, and the score rests on it.
        self.head_dense = (
            Projection(hidden, hidden, True, dtype, "replicated", quantizable=False)
            if cross_encoder
            else None
        )
        self.head_out = (
            Projection(hidden, 1, True, dtype, "replicated", quantizable=False) if cross_encoder else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        # Type 0 but for a pair's second text, whose ids carry type 1 (pack_token_types).
        token_types = input_ids >> TOKEN_TYPE_SHIFT
        x = (
            self.word_embeddings(input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1))
            + self.position_embeddings(positions + self.position_offset)
            + self.token_type_embeddings(token_types)
        )
        x = self.embeddings_norm(x)
        # One group (its kv_cache_groups): an encoder reads no KV, only where each prompt starts.
        (step,) = metadata
        # Read once for every layer: on CUDA torch's per-sequence attention slices by these on the host.
        starts = step.query_start_loc[: step.num_seqs + 1].cpu()
        for layer in self.layers:
            x = layer(x, starts, self.ops, self.activation, self.attend)
        return x

    def score_logit(self, first_token: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's head: its logit [1] from the first token's final state [hidden]."""
        assert self.head_dense is not None and self.head_out is not None, "not a cross-encoder"
        x = torch.tanh(
            self.ops.linear(first_token.to(self.dtype)[None], self.head_dense.weight, self.head_dense.bias)
        )
        return self.ops.linear(x, self.head_out.weight, self.head_out.bias)[0].float()

    def prepare_linear_weights(self, k_blocks: bool, quantized: QuantizedParts) -> None:
        """Every projection in the form the ops read; quantized: --quantization's parts, by parameter name."""
        for name, module in self.named_modules():
            if isinstance(module, Projection):
                module.prepare(self.ops, k_blocks=k_blocks, quantized=quantized.get(f"{name}.weight"))


# transformers' checkpoint names -> ours, per layer ("encoder.layer.{i}." is the layer's prefix).
# Query, key and value are parts of our fused qkv (QKV_PARTS).
QKV_PARTS = ("query", "key", "value")
_LAYER_NAMES = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attention_out",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "output_norm",
}
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embeddings_norm",
}


def our_name(checkpoint_name: str, cross_encoder: bool) -> str | None:
    """The parameter a checkpoint tensor fills, or None for the tensors an encoder leaves out (an
    embedding model's pooler, position id buffers, a task model's other heads); a cross-encoder's head
    too unless the model is one."""
    name = next(
        (checkpoint_name[len(p) :] for p in _PREFIXES if checkpoint_name.startswith(p)), checkpoint_name
    )
    module, _, leaf = checkpoint_name.rpartition(".")
    if module in _HEAD_NAMES:
        return f"{_HEAD_NAMES[module]}.{leaf}" if cross_encoder else None
    module, _, leaf = name.rpartition(".")
    # Old checkpoints call LayerNorm's parameters gamma and beta.
    leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)
    if module in _EMBEDDING_NAMES:
        return f"{_EMBEDDING_NAMES[module]}.{leaf}"
    if module.startswith("encoder.layer."):
        index, _, rest = module[len("encoder.layer.") :].partition(".")
        if rest in _LAYER_NAMES:
            return f"layers.{index}.{_LAYER_NAMES[rest]}.{leaf}"
    return None
