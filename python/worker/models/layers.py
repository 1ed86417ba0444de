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
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported; Sluice implements silu")
        self.inner = inner
        self.gate_up_shards = (inner, inner)
        self.gate_up_proj = Projection(hidden, 2 * inner, bias, dtype, "column")
        self.down_proj = Projection(inner, hidden, bias, dtype, "row")

    def prepare(self, ops: LayerOps, fused_gate_up: bool, k_blocks: bool, quantized: QuantizedParts) -> None:
        """Projection.prepare for both weights; quantized: parts by parameter name within this MLP."""
        self.gate_up_proj.prepare(
            ops, gated=fused_gate_up, k_blocks=k_blocks, quantized=quantized.get("gate_up_proj.weight")
        )
        self.down_proj.prepare(ops, k_blocks=k_blocks, quantized=quantized.get("down_proj.weight"))
