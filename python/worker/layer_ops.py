"""The ops of a model's layers (a decoder's, an encoder's), picked per device.

On CPU they are Sluice's kernels of the tier this process runs (worker/native_ops.py: the packed GEMM and
fused elementwise kernels, one dispatch each); on CUDA, and on CPU at the "none" tier, they are the torch
compositions below, written in transformers' order of operations.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch
import torch.nn.functional as F

from worker.moe_tensors import MoeTensors, torch_moe
from worker.quantized_weights import QuantizedRows


class LayerOps(Protocol):
    # Whether prepare_quantized_linear_weight keeps weights quantized (the CPU's integer GEMM).
    runs_quantized: bool

    def prepare_quantized_linear_weight(self, parts: list[QuantizedRows], dtype: torch.dtype) -> torch.Tensor:
        """A weight given as quantized row parts (top to bottom), for linear with activations of dtype."""
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias, with weight as prepare_linear_weight returned it."""
        ...

    def linear_float32(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """linear's result in float32 (logits), without rounding to the model dtype first where it can."""
        ...

    def prepare_linear_weight(self, weight: torch.Tensor, k_blocks: bool = True) -> torch.Tensor:
        """A loaded [out, in] weight in the form linear reads fastest (on CPU: bf16 packed for the
        native GEMM); call once per weight, after loading and sharding (load_model skips it where
        KernelConfig.packed_linear is off). k_blocks (KernelConfig.gemm_k_blocks): whether the packed
        GEMM may take K in blocks over this weight; a choice of each packed weight, not of the process."""
        ...

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """silu(gate) * up of linear(x, weight, bias) for an MLP's fused weight [gate; up], with weight
        as prepare_linear_weight or prepare_gated_linear_weight returned it."""
        ...

    def prepare_gated_linear_weight(self, weight: torch.Tensor, k_blocks: bool = True) -> torch.Tensor:
        """An MLP's [gate; up] weight in the form gated_linear reads fastest (on CPU: bf16 packed so
        that the GEMM's epilogue applies the activation; KernelConfig.fused_gate_up); k_blocks as for
        prepare_linear_weight."""
        ...

    def moe(self, x: torch.Tensor, moe: MoeTensors) -> torch.Tensor:
        """A mixture-of-experts feed-forward of x [tokens, hidden] (worker/moe_tensors.py)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta in place; returns rms_norm(residual) * weight."""
        ...

    def rotary_embedding(self, qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
        """Rotate qk [num_tokens, heads, head_dim] in place by cos and sin [num_tokens, rotary_dim] (the
        first rotary_dim dimensions of each head); sin_signed carries rotate_half's sign."""
        ...

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """GELU with erf (not the tanh approximation) of x, which it may overwrite."""
        ...

    def attention_within_sequences(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_seqs: int,
        scale: float,
    ) -> torch.Tensor:
        """An encoder's attention [num_tokens, heads, head_dim] of query, key and value [num_tokens, heads,
        head_dim]: each row to every row of its own sequence (rows query_start_loc[s] ..
        query_start_loc[s + 1]), before and after it."""
        ...

    def qk_norm(
        self, qk: torch.Tensor, q_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
    ) -> None:
        """Qwen3's per-head norms of qk [num_tokens, heads, head_dim] in place: rms_norm over each head,
        times q_weight for its first q_heads heads and k_weight for the rest."""
        ...


def sdpa_within_sequences(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_seqs: int,
    scale: float,
) -> torch.Tensor:
    """LayerOps.attention_within_sequences through torch's SDPA, one sequence at a time."""
    out = torch.empty_like(query)
    for start, end in itertools.pairwise(query_start_loc[: num_seqs + 1].tolist()):
        # [heads, n, head_dim] of one sequence: it attends to all of itself and to nothing else.
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        out[start:end] = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
    return out


class TorchLayerOps:
    runs_quantized = False
    attention_within_sequences = staticmethod(sdpa_within_sequences)
    gelu = staticmethod(F.gelu)

    def prepare_quantized_linear_weight(self, parts: list[QuantizedRows], dtype: torch.dtype) -> torch.Tensor:
        # The loader keeps weights quantized only for ops that run them (runs_quantized), and
        # sluice/config_checks.py refuses --quantization without a CPU kernel tier.
        raise AssertionError(
            "torch's ops have no integer GEMM: quantized weights reach only Sluice's CPU kernels"
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def linear_float32(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias).float()

    # k_blocks schedules the packed CPU GEMM; F.linear has no such choice.
    def prepare_linear_weight(self, weight: torch.Tensor, k_blocks: bool = True) -> torch.Tensor:
        return weight

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
        return F.silu(gate) * up

    def prepare_gated_linear_weight(self, weight: torch.Tensor, k_blocks: bool = True) -> torch.Tensor:
        return weight

    def moe(self, x: torch.Tensor, moe: MoeTensors) -> torch.Tensor:
        if moe.stacked_gate_up is None:
            return torch_moe(x, moe, self.linear, self.gated_linear)
        # Imported on first use: only CUDA stacks experts, and importing Triton's kernels fixes whether
        # they are interpreted (worker/moe_triton.py).
        from worker.moe_triton import triton_moe

        return triton_moe(x, moe, self.linear, self.gated_linear)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        residual.add_(delta)
        return self.rms_norm(residual, weight, eps)

    def rotary_embedding(self, qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
        # The first cos.shape[-1] dimensions of each head: all of them but for a partial rotary.
        turned = qk[..., : cos.shape[-1]]
        rotated = turned.roll(cos.shape[-1] // 2, dims=-1) * sin_signed[:, None]
        turned.copy_(turned * cos[:, None] + rotated)

    def qk_norm(
        self, qk: torch.Tensor, q_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
    ) -> None:
        normed = F.rms_norm(qk, (qk.shape[-1],), None, eps)
        normed[:, :q_heads] *= q_weight
        normed[:, q_heads:] *= k_weight
        qk.copy_(normed)


def layer_ops_for(device: torch.device) -> LayerOps:
    """The CPU kernels of this process's tier, else (CUDA, or the "none" tier) torch's ops."""
    if device.type == "cpu":
        from worker.native_ops import cpu_kernels

        ops = cpu_kernels()
        if ops is not None:
            return ops
    return TorchLayerOps()
