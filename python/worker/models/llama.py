"""The Llama family (Llama, Qwen2, Qwen3, Mistral, Phi-3, and with experts Qwen2-MoE, Qwen3-MoE and
Mixtral) as one model over a paged KV cache; a MoE layer's feed-forward is models/moe.py's.

q/k/v and gate/up are fused into one weight each at load time, so a layer runs few, large
matmuls. Every op mirrors transformers' order of float operations, so float32 outputs are
token-identical to it and bf16 stays as close as rounding allows.

Under tensor parallelism (Megatron's layout) each rank holds its share of the heads: qkv_proj and
gate_up_proj are split by output rows (column-parallel; a rank's q, k and v shards, or gate and up
shards, stay fused), o_proj and down_proj by input columns (row-parallel). A row-parallel output is a
partial sum: forward() all-reduces it between the stages, and only rank 0 adds its bias. The
embedding and the LM head are split by vocab rows (vocab_parallel.py); norms and rotary are replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from sluice.errors import UnsupportedArchitectureError
from sluice.kv_cache_groups import kv_cache_groups
from sluice.rope_parameters import rope_parameters_of, rope_parameters_of_layers
from sluice.sliding_windows import sliding_windows
from worker.attention.backend import AttentionBackend, AttentionMetadata
from worker.distributed import TensorParallelGroup, tensor_parallel_group
from worker.layer_ops import LayerOps, layer_ops_for
from worker.models.gemma import (
    GEMMA_ARCHITECTURES,
    GemmaDecoderLayer,
    GemmaRMSNorm,
)
from worker.models.layers import MLP, RMSNorm, SelfAttention
from worker.models.moe import SparseMoe, is_sparse_layer
from worker.models.rotary import RotaryEmbedding, rotary_frequencies
from worker.models.vocab_parallel import VocabParallelEmbedding
from worker.moe_tensors import MoeTensors, torch_moe
from worker.quantized_weights import QuantizedParts, parts_under


class DenseStages(Protocol):
    """A layer's three dense stages (DecoderLayer's methods, or the C++ ones of worker.cpu_model_step)."""

    def attention_input(
        self, delta: torch.Tensor | None, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def attention_output(self, attn: torch.Tensor) -> torch.Tensor: ...

    def feed_forward(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor: ...


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        architecture: str,
        dtype: torch.dtype,
        ops: LayerOps,
        tp: TensorParallelGroup,
        sparse: bool,
        fused_moe: bool,
        sliding_window: int,
    ) -> None:
        super().__init__()
        # KernelConfig.fused_moe: the ops' one-call MoE, or torch_moe over the ops' GEMMs.
        self.fused_moe = fused_moe
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], dtype)
        self.self_attn = SelfAttention(cfg, architecture, dtype, tp)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], dtype)
        self.mlp: MLP | SparseMoe = (
            SparseMoe(cfg, architecture, dtype, tp)
            if sparse
            else MLP(cfg, cfg["intermediate_size"], dtype, tp)
        )
        if isinstance(self.mlp, MLP) and self.mlp.activation != "silu":
            raise UnsupportedArchitectureError(
                f"{architecture}'s hidden_act {self.mlp.activation!r} is not supported; its MLP runs silu"
            )
        self.ops = ops
        # Llama's layers rotate with the model's one table.
        self.local_rope = False
        # The ranks' row-parallel partial sums are added up afterwards: one of them adds the bias.
        adds_row_bias = tp.rank == 0
        # nn.Module attribute lookups cost microseconds each; the per-token path reads plain slots.
        # The loader fills these parameters in place, so the references stay valid.
        attn, mlp = self.self_attn, self.mlp
        self.tensors = _LayerTensors(
            input_norm=self.input_layernorm.weight,
            post_norm=self.post_attention_layernorm.weight,
            eps=self.input_layernorm.eps,
            qkv_weight=attn.qkv_proj.weight,
            qkv_bias=attn.qkv_proj.bias,
            o_weight=attn.o_proj.weight,
            o_bias=attn.o_proj.bias if adds_row_bias else None,
            gate_up_weight=None if sparse else mlp.gate_up_proj.weight,
            gate_up_bias=None if sparse else mlp.gate_up_proj.bias,
            down_weight=None if sparse else mlp.down_proj.weight,
            down_bias=mlp.down_proj.bias if adds_row_bias and not sparse else None,
            moe=mlp.tensors() if sparse else None,
            q_norm=attn.q_norm.weight if attn.qk_norm else None,
            k_norm=attn.k_norm.weight if attn.qk_norm else None,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            scale=attn.scale,
            sliding_window=sliding_window,
        )

    def prepare_linear_weights(
        self, fused_gate_up: bool, gemm_k_blocks: bool, quantized: QuantizedParts
    ) -> None:
        """quantized: this layer's parts, by parameter name within the layer."""
        attn, mlp = self.self_attn, self.mlp
        for name, projection in (("self_attn.qkv_proj", attn.qkv_proj), ("self_attn.o_proj", attn.o_proj)):
            projection.prepare(self.ops, k_blocks=gemm_k_blocks, quantized=quantized.get(f"{name}.weight"))
        mlp.prepare(self.ops, fused_gate_up, gemm_k_blocks, parts_under(quantized, "mlp."))
        dense = isinstance(mlp, MLP)
        self.tensors = dataclasses.replace(
            self.tensors,
            qkv_weight=attn.qkv_proj.weight,
            o_weight=attn.o_proj.weight,
            gate_up_weight=mlp.gate_up_proj.weight if dense else None,
            down_weight=mlp.down_proj.weight if dense else None,
            moe=None if dense else mlp.tensors(),
        )

    # A layer runs as three dense stages with attention between the first two. The stages are the
    # units that the graph dispatcher's PIECEWISE mode replays; attention runs eagerly between them.

    def attention_input(
        self, delta: torch.Tensor | None, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Adds the previous layer's output `delta` into `residual` (in place); returns rotated q, k and v."""
        t, ops = self.tensors, self.ops
        num_tokens = residual.shape[0]
        heads, kv_heads = t.num_heads, t.num_kv_heads
        if delta is None:
            x = ops.rms_norm(residual, t.input_norm, t.eps)
        else:
            x = ops.add_rms_norm(residual, delta, t.input_norm, t.eps)
        qkv = ops.linear(x, t.qkv_weight, t.qkv_bias).view(num_tokens, -1, t.head_dim)
        qk = qkv[:, : heads + kv_heads]
        if t.q_norm is not None:
            ops.qk_norm(qk, heads, t.q_norm, t.k_norm, t.eps)
        ops.rotary_embedding(qk, cos, sin)
        return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]

    def attention_output(self, attn: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output [num_tokens, heads, head_dim]; a partial sum under TP."""
        t = self.tensors
        return self.ops.linear(attn.view(attn.shape[0], -1), t.o_weight, t.o_bias)

    def feed_forward(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Adds the attention's `delta` into `residual` (in place); returns the MLP's output (a partial sum under TP)."""
        t, ops = self.tensors, self.ops
        x = ops.add_rms_norm(residual, delta, t.post_norm, t.eps)
        if t.moe is not None:
            return ops.moe(x, t.moe) if self.fused_moe else torch_moe(x, t.moe, ops.linear, ops.gated_linear)
        assert t.gate_up_weight is not None and t.down_weight is not None
        activation = ops.gated_linear(x, t.gate_up_weight, t.gate_up_bias)
        return ops.linear(activation, t.down_weight, t.down_bias)

    # Gemma normalises each stage's all-reduced output (GemmaDecoderLayer); Llama adds it as it is.

    def after_attention(self, delta: torch.Tensor) -> torch.Tensor:
        return delta

    def after_feed_forward(self, delta: torch.Tensor) -> torch.Tensor:
        return delta


@dataclass(slots=True, frozen=True)
class _LayerTensors:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    # A dense layer's MLP, or a MoE layer's experts (then the MLP's are None).
    gate_up_weight: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor | None
    down_bias: torch.Tensor | None
    moe: MoeTensors | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    # The last keys a query sees (attention backends' window), or 0 for the whole context.
    sliding_window: int


# Families whose attention turns only the first partial_rotary_factor of each head (Phi-4-mini's 0.75).
PARTIAL_ROTARY_ARCHITECTURES = ("Phi3ForCausalLM",)

# Config fields of other families (Gemma's soft-capping and query scaling, Granite's multipliers) that a
# Llama-shaped model would silently ignore: a config that sets one is refused instead. Gemma implements
# its query scaling and its soft-capping.
_UNIMPLEMENTED_FIELDS = (
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "embedding_multiplier",
    "logits_scaling",
    "residual_multiplier",
    "attention_multiplier",
)
_GEMMA_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        attention: AttentionBackend,
        max_model_len: int | None = None,
        tp: TensorParallelGroup | None = None,
        fused_moe: bool = True,
        hybrid_kv_cache: bool = True,
    ) -> None:
        super().__init__()
        tp = tp or tensor_parallel_group()
        self.fused_moe = fused_moe
        architecture = (hf_config.get("architectures") or ["LlamaForCausalLM"])[0]
        max_positions = int(hf_config.get("max_position_embeddings", 2048))
        max_model_len = max_model_len or max_positions
        gemma = architecture in GEMMA_ARCHITECTURES
        for field in _UNIMPLEMENTED_FIELDS:
            if hf_config.get(field) is not None and not (gemma and field in _GEMMA_FIELDS):
                raise UnsupportedArchitectureError(
                    f"{architecture}'s config sets {field} = {hf_config[field]!r}, which changes the maths and "
                    "which Sluice does not implement for this family"
                )
        windows = sliding_windows(hf_config, architecture, max_model_len)
        # Which block table each layer reads (CacheConfig.hybrid_kv_cache): forward's metadata is one a group.
        self.kv_cache_groups = kv_cache_groups(windows, hybrid_kv_cache)
        hidden, vocab = hf_config["hidden_size"], hf_config["vocab_size"]
        self.architecture = architecture
        self.dtype = dtype
        self.attention = attention
        self.tp = tp
        self.ops = layer_ops_for(torch.get_default_device())
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, dtype, tp)
        self.gemma = gemma
        # Gemma scales its embedding by sqrt(hidden), rounded to the dtype as transformers rounds it.
        self.embed_scale = torch.tensor(hidden**0.5, dtype=dtype) if gemma else None
        # Gemma 2 caps its logits and its attention scores (Gemma 3's released configs set neither).
        self.final_logit_softcapping = hf_config.get("final_logit_softcapping") if gemma else None
        self.attn_logit_softcapping = float(hf_config.get("attn_logit_softcapping") or 0.0) if gemma else 0.0
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(hf_config, architecture, dtype, self.ops, tp, windows[i])
            if gemma
            else DecoderLayer(
                hf_config,
                architecture,
                dtype,
                self.ops,
                tp,
                is_sparse_layer(hf_config, architecture, i),
                fused_moe,
                windows[i],
            )
            for i in range(hf_config["num_hidden_layers"])
        )
        self.norm = (GemmaRMSNorm if gemma else RMSNorm)(hidden, hf_config["rms_norm_eps"], dtype)
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        self.lm_head = (
            self.embed_tokens
            if self.tie_word_embeddings
            else VocabParallelEmbedding(vocab, hidden, dtype, tp)
        )
        # This rank's share of the KV cache's shape: [num_blocks, block_size, num_kv_heads, head_dim].
        self.num_kv_heads = self.layers[0].self_attn.num_kv_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        # The frequencies for the context served (dynamic and longrope depend on it); the table covers
        # max_position_embeddings at least, and the dimensions that turn (all, or a partial rotary's).
        gemma3 = architecture == "Gemma3ForCausalLM"
        rope = (
            rope_parameters_of_layers(hf_config, "full_attention")
            if gemma3
            else rope_parameters_of(hf_config)
        )
        if rope.partial_rotary_factor != 1.0 and architecture not in PARTIAL_ROTARY_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{architecture}'s config sets partial_rotary_factor {rope.partial_rotary_factor}, which "
                "transformers turns only for Phi-3's layers; Sluice does the same"
            )
        inv_freq, attention_factor = rotary_frequencies(rope, rope.rotary_dim(self.head_dim), max_model_len)
        self.rotary = RotaryEmbedding(inv_freq, max(max_positions, max_model_len), dtype, attention_factor)
        # Gemma 3's sliding layers turn with their own base (GemmaDecoderLayer.local_rope).
        self.local_rotary: RotaryEmbedding | None = None
        if gemma3:
            local = rope_parameters_of_layers(hf_config, "sliding_attention")
            local_freq, local_factor = rotary_frequencies(local, self.head_dim, max_model_len)
            self.local_rotary = RotaryEmbedding(
                local_freq, max(max_positions, max_model_len), dtype, local_factor
            )

    @property
    def has_experts(self) -> bool:
        return any(isinstance(layer.mlp, SparseMoe) for layer in self.layers)

    @property
    def runs_llama_layers(self) -> bool:
        """Whether every layer is Llama's DecoderLayer, which the C++ model step and CUDA graphs run (Gemma's
        run eagerly)."""
        return not self.gemma

    def prepare_linear_weights(
        self, fused_gate_up: bool = True, gemm_k_blocks: bool = True, quantized: QuantizedParts | None = None
    ) -> None:
        """Puts every linear weight in the form self.ops.linear reads fastest; once, after loading (and
        sharding). The embedding stays as loaded for F.embedding, so a tied LM head gets its own copy.
        fused_gate_up (KernelConfig.fused_gate_up) packs each MLP's gate_up so that its GEMM applies
        the activation in its epilogue; gemm_k_blocks (KernelConfig.gemm_k_blocks) lets the packed GEMM
        take K in blocks over these weights. quantized: the GGUF weights kept quantized (model_loader),
        by parameter name, from which those weights are packed instead."""
        quantized = quantized or {}
        for index, layer in enumerate(self.layers):
            layer.prepare_linear_weights(
                fused_gate_up, gemm_k_blocks, parts_under(quantized, f"layers.{index}.")
            )
        self.lm_head.prepare(self.ops, gemm_k_blocks, quantized.get("lm_head.weight"))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: Sequence[AttentionMetadata],
        stages: Sequence[DenseStages] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [num_tokens, hidden] of a flattened batch; `metadata`, one per KV
        cache group; `stages`, one per layer, stand in for the layers' own dense stages (the CPU's
        PIECEWISE path)."""
        assert len(metadata) == self.kv_cache_groups.num_groups
        residual = self.embed_tokens.embed(input_ids)
        if self.embed_scale is not None:
            residual.mul_(self.embed_scale)
        # Per layer, its rotary tables: the model's, or (Gemma's sliding layers) the local ones.
        tables = {False: self.rotary.lookup(positions)}
        if self.local_rotary is not None:
            tables[True] = self.local_rotary.lookup(positions)
        delta = None
        all_reduce = self.tp.all_reduce
        layer_stages = self.layers if stages is None else stages
        layer_group = self.kv_cache_groups.layer_group
        for layer, stage, (key_cache, value_cache), group in zip(
            self.layers, layer_stages, kv_caches, layer_group, strict=True
        ):
            q, k, v = stage.attention_input(delta, residual, *tables[layer.local_rope])
            t = layer.tensors
            attn = self.attention.forward(
                q,
                k,
                v,
                key_cache,
                value_cache,
                metadata[group],
                t.scale,
                t.sliding_window,
                self.attn_logit_softcapping,
            )
            delta = layer.after_attention(all_reduce(stage.attention_output(attn)))
            delta = layer.after_feed_forward(all_reduce(stage.feed_forward(delta, residual)))
        assert delta is not None
        if self.gemma:
            residual.add_(delta)
            return self.norm(residual)
        return self.ops.add_rms_norm(residual, delta, self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, vocab] for the rows the runner samples from; the whole vocab on every rank."""
        logits = self.lm_head.logits(hidden_states, self.ops)
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits
