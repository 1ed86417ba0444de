"""The Llama family (Llama, Qwen2, Qwen3, Mistral) as one model over a paged KV cache.

q/k/v and gate/up are fused into one weight each at load time, so a layer runs few, large
matmuls. Every op mirrors transformers' order of float operations, so float32 outputs are
token-identical to it and bf16 stays as close as rounding allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sluice.errors import UnsupportedArchitectureError
from worker.attention.backend import AttentionBackend, AttentionMetadata
from worker.layer_ops import LayerOps, layer_ops_for
from worker.models.rotary import RotaryEmbedding, inverse_frequencies, rope_parameters_of


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Left uninitialised: the loader overwrites every parameter and checks that it did.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """An RMSNorm's weight and epsilon; the layer ops apply it."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(size, dtype=dtype)
        self.eps = eps


class Projection(nn.Module):
    """A linear layer's weight (and optional bias); callers apply it through LayerOps.linear, skipping hooks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(out_features, in_features, dtype=dtype)
        self.bias = _weight(out_features, dtype=dtype) if bias else None


class SelfAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], architecture: str, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        self.scale = self.head_dim**-0.5
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = attention_bias or architecture == "Qwen2ForCausalLM"
        o_bias = attention_bias and architecture != "Qwen2ForCausalLM"
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_shards = (q_size, kv_size, kv_size)
        self.qkv_proj = Projection(hidden, q_size + 2 * kv_size, qkv_bias, dtype)
        self.o_proj = Projection(q_size, hidden, o_bias, dtype)
        self.qk_norm = architecture == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"], dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"], dtype)


class MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = cfg["hidden_size"], cfg["intermediate_size"]
        bias = bool(cfg.get("mlp_bias", False))
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported; Sluice implements silu")
        self.inner = inner
        self.gate_up_shards = (inner, inner)
        self.gate_up_proj = Projection(hidden, 2 * inner, bias, dtype)
        self.down_proj = Projection(inner, hidden, bias, dtype)


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
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], dtype)
        self.self_attn = SelfAttention(cfg, architecture, dtype)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], dtype)
        self.mlp = MLP(cfg, dtype)
        self.ops = ops
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
            o_bias=attn.o_proj.bias,
            gate_up_weight=mlp.gate_up_proj.weight,
            gate_up_bias=mlp.gate_up_proj.bias,
            down_weight=mlp.down_proj.weight,
            down_bias=mlp.down_proj.bias,
            q_norm=attn.q_norm.weight if attn.qk_norm else None,
            k_norm=attn.k_norm.weight if attn.qk_norm else None,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            scale=attn.scale,
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
            qk = F.rms_norm(qk, (t.head_dim,), None, t.eps)
            qk[:, :heads] *= t.q_norm
            qk[:, heads:] *= t.k_norm
        ops.rotary_embedding(qk, cos, sin)
        return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]

    def attention_output(self, attn: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output [num_tokens, heads, head_dim]."""
        t = self.tensors
        return self.ops.linear(attn.view(attn.shape[0], -1), t.o_weight, t.o_bias)

    def feed_forward(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Adds the attention's `delta` into `residual` (in place); returns the MLP's output."""
        t, ops = self.tensors, self.ops
        x = ops.add_rms_norm(residual, delta, t.post_norm, t.eps)
        gate_up = ops.linear(x, t.gate_up_weight, t.gate_up_bias)
        return ops.linear(ops.silu_and_mul(gate_up), t.down_weight, t.down_bias)


@dataclass(slots=True, frozen=True)
class _LayerTensors:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


def sliding_window_of(hf_config: dict[str, Any], architecture: str) -> int | None:
    """The attention window the model was trained with, or None when it attends to everything."""
    if architecture == "MistralForCausalLM":
        return hf_config.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf_config.get("use_sliding_window"):
        return hf_config.get("sliding_window")
    return None


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        attention: AttentionBackend,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__()
        architecture = (hf_config.get("architectures") or ["LlamaForCausalLM"])[0]
        max_positions = int(hf_config.get("max_position_embeddings", 2048))
        max_model_len = max_model_len or max_positions
        window = sliding_window_of(hf_config, architecture)
        if window is not None and window < max_model_len:
            raise UnsupportedArchitectureError(
                f"{architecture} uses sliding-window attention (window {window}) but max_model_len is "
                f"{max_model_len}; Sluice does not implement sliding windows, so set max_model_len <= {window}"
            )
        hidden, vocab = hf_config["hidden_size"], hf_config["vocab_size"]
        self.architecture = architecture
        self.dtype = dtype
        self.attention = attention
        self.ops = layer_ops_for(torch.get_default_device())
        self.embed_tokens = Projection(hidden, vocab, False, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, architecture, dtype, self.ops)
            for _ in range(hf_config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hidden, hf_config["rms_norm_eps"], dtype)
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        self.lm_head = Projection(hidden, vocab, False, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        head_dim = self.layers[0].self_attn.head_dim
        inv_freq = inverse_frequencies(rope_parameters_of(hf_config), head_dim, max_positions)
        self.rotary = RotaryEmbedding(inv_freq, max(max_positions, max_model_len), dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        stages: Sequence[DenseStages] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [num_tokens, hidden] of a flattened batch; `stages`, one per
        layer, stand in for the layers' own dense stages (the CPU's PIECEWISE path)."""
        residual = F.embedding(input_ids, self.embed_tokens.weight)
        cos, sin = self.rotary.lookup(positions)
        delta = None
        layer_stages = self.layers if stages is None else stages
        for layer, stage, (key_cache, value_cache) in zip(self.layers, layer_stages, kv_caches, strict=True):
            q, k, v = stage.attention_input(delta, residual, cos, sin)
            attn = self.attention.forward(q, k, v, key_cache, value_cache, metadata, layer.tensors.scale)
            delta = stage.feed_forward(stage.attention_output(attn), residual)
        assert delta is not None
        return self.ops.add_rms_norm(residual, delta, self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, vocab] for the rows the runner samples from."""
        return self.ops.linear(hidden_states, self.lm_head.weight, None).float()
