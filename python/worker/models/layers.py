"""The building blocks of a decoder's layers: norms, projections (with how each is split under tensor
parallelism) and the gated MLP that dense layers, experts and shared experts all are."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from sluice.errors import UnsupportedArchitectureError
from worker.distributed import TensorParallelGroup
from worker.layer_ops import LayerOps
from worker.quantized_weights import QuantizedParts, QuantizedRows, covering_parts

# How a projection's checkpoint weight is split over the ranks: whole on each, by output rows
# (the bias too), or by input columns (the bias whole on each, added by rank 0 alone).
Split = Literal["replicated", "column", "row"]


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
    """A linear layer's weight (and optional bias); callers apply it through LayerOps.linear, skipping hooks.

    The features are this rank's: the output rows of a column split, the input columns of a row split.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        split: Split,
        quantizable: bool = True,
    ) -> None:
        super().__init__()
        self.split = split
        # False for a MoE router and its shared expert's gate: a few rows whose rounding would change
        # which experts are chosen, so --quantization leaves them in the model dtype.
        self.quantizable = quantizable
        self.weight = _weight(out_features, in_features, dtype=dtype)
        self.bias = _weight(out_features, dtype=dtype) if bias else None

    def prepare(
        self,
        ops: LayerOps,
        gated: bool = False,
        k_blocks: bool = True,
        quantized: list[tuple[int, QuantizedRows]] | None = None,
    ) -> None:
        """Replaces the loaded weight by the form ops.linear reads fastest (a packed copy on CPU), or
        with `gated`, for an MLP's [gate; up], the form ops.gated_linear reads fastest; k_blocks as
        LayerOps.prepare_linear_weight takes it. With quantized parts (a GGUF file's), the weight is
        packed from them instead, never widened (and never gated: gated_linear then applies the
        activation after the GEMM)."""
        if quantized:
            parts = covering_parts(quantized, self.weight.data)
            prepared = ops.prepare_quantized_linear_weight(parts, self.weight.dtype)
        else:
            prepare = ops.prepare_gated_linear_weight if gated else ops.prepare_linear_weight
            prepared = prepare(self.weight.data, k_blocks)
        self.weight = nn.Parameter(prepared, requires_grad=False)


# An MLP's activation of its gate: SiLU (Llama and most), or GELU's tanh approximation (Gemma).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class MLP(nn.Module):
    """silu(gate x) * (up x), then down: gate and up fused into one column-split projection, down row-split."""

    def __init__(
        self, cfg: dict[str, Any], intermediate_size: int, dtype: torch.dtype, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        assert intermediate_size % tp.size == 0, intermediate_size
        inner = intermediate_size // tp.size
        bias = bool(cfg.get("mlp_bias", False))
        # Gemma names it hidden_activation: GeGLU with tanh's GELU.
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"hidden_act {act!r} is not supported; Sluice implements {', '.join(ACTIVATIONS)}"
            )
        self.activation = act
        self.inner = inner
        self.gate_up_shards = (inner, inner)
        self.gate_up_proj = Projection(hidden, 2 * inner, bias, dtype, "column")
        self.down_proj = Projection(inner, hidden, bias, dtype, "row")

    def prepare(self, ops: LayerOps, fused_gate_up: bool, k_blocks: bool, quantized: QuantizedParts) -> None:
        """Projection.prepare for both weights; quantized: parts by parameter name within this MLP. Only
        SiLU's gate_up is packed gated (the GEMM's epilogue applies SiLU)."""
        gated = fused_gate_up and self.activation == "silu"
        self.gate_up_proj.prepare(
            ops, gated=gated, k_blocks=k_blocks, quantized=quantized.get("gate_up_proj.weight")
        )
        self.down_proj.prepare(ops, k_blocks=k_blocks, quantized=quantized.get("down_proj.weight"))


class SelfAttention(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], architecture: str, dtype: torch.dtype, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        total_heads = cfg["num_attention_heads"]
        total_kv_heads = cfg.get("num_key_value_heads") or total_heads
        # sluice.parallel_validation.check_tensor_parallel rejects other sizes before any process starts.
        assert total_heads % tp.size == 0 and total_kv_heads % tp.size == 0, (total_heads, total_kv_heads)
        # This rank's heads: query heads and the KV heads they share stay together on one rank.
        self.num_heads = total_heads // tp.size
        self.num_kv_heads = total_kv_heads // tp.size
        self.head_dim = cfg.get("head_dim") or hidden // total_heads
        # Gemma scales queries by query_pre_attn_scalar, not by the head's width.
        self.scale = float(cfg.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        attention_bias = bool(cfg.get("attention_bias", False))
        # Qwen2 always has q, k and v biases; Qwen2-MoE's config can turn them off (qkv_bias).
        qwen2 = architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        qkv_bias = attention_bias or (qwen2 and bool(cfg.get("qkv_bias", True)))
        o_bias = attention_bias and not qwen2
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_shards = (q_size, kv_size, kv_size)
        self.qkv_proj = Projection(hidden, q_size + 2 * kv_size, qkv_bias, dtype, "column")
        self.o_proj = Projection(q_size, hidden, o_bias, dtype, "row")
        self.qk_norm = architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"], dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"], dtype)
