"""Gemma 2 and Gemma 3 (text, Gemma3ForCausalLM): Llama's projections with Gemma's arithmetic, as a decoder
layer that LlamaForCausalLM runs in place of its own.

What differs from Llama, each as transformers computes it:
- RMSNorm scales by (1 + w), in float32, rounded once to the model dtype (Llama multiplies w by the
  normalised value already rounded); q and k get such a norm per head;
- four norms a layer: the attention's and the MLP's outputs are normalised too (post_attention_layernorm,
  post_feedforward_layernorm) before they join the residual, after the tensor-parallel all-reduce;
- GeGLU: GELU's tanh approximation of the gate, times up;
- queries scaled by query_pre_attn_scalar ** -0.5; the embedding scaled by sqrt(hidden) in the dtype;
- Gemma 2 soft-caps its attention scores (attn_logit_softcapping, in every attention backend) and its
  logits; its sliding layers (every other one) rotate as the global ones;
- Gemma 3 normalises q and k per head; its sliding layers (five in six, sluice/sliding_windows.py)
  rotate with their own base (10,000), the global ones with rope_theta and its scaling
  (sluice/rope_parameters.py, rope_parameters_of_layers).
Its norms and GeGLU run as torch ops on every device; the projections take the device's GEMMs. The C++
model step and CUDA graphs run Llama's layers only, so a Gemma step runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.errors import UnsupportedArchitectureError
from worker.distributed import TensorParallelGroup
from worker.layer_ops import LayerOps
from worker.models.layers import MLP, RMSNorm, SelfAttention
from worker.quantized_weights import QuantizedParts, parts_under

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * scale in float32, rounded once to x's dtype; scale is 1 + w in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """A Gemma norm's weight w, applied as gemma_rms_norm with the scale 1 + w."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, 1.0 + self.weight.float(), self.eps)


@dataclass(slots=True, frozen=True)
class GemmaTensors:
    """What LlamaForCausalLM.forward reads of a layer: its attention's scale and window."""

    scale: float
    sliding_window: int


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        architecture: str,
        dtype: torch.dtype,
        ops: LayerOps,
        tp: TensorParallelGroup,
        sliding_window: int,
    ) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = SelfAttention(cfg, architecture, dtype, tp)
        if self.self_attn.qk_norm:
            self.self_attn.q_norm = GemmaRMSNorm(self.self_attn.head_dim, eps, dtype)
            self.self_attn.k_norm = GemmaRMSNorm(self.self_attn.head_dim, eps, dtype)
        self.mlp = MLP(cfg, cfg["intermediate_size"], dtype, tp)
        if self.mlp.activation != "gelu_pytorch_tanh":
            raise UnsupportedArchitectureError(
                f"{architecture}'s hidden_activation {self.mlp.activation!r} is not supported; its MLP runs "
                "gelu_pytorch_tanh"
            )
        self.ops = ops
        # Gemma 3's sliding layers turn with the local base (LlamaForCausalLM.forward picks their tables).
        self.local_rope = sliding_window > 0 and architecture == "Gemma3ForCausalLM"
        self.tensors = GemmaTensors(self.self_attn.scale, sliding_window)

    def prepare_linear_weights(
        self, fused_gate_up: bool, gemm_k_blocks: bool, quantized: QuantizedParts
    ) -> None:
        attn = self.self_attn
        for name, projection in (("self_attn.qkv_proj", attn.qkv_proj), ("self_attn.o_proj", attn.o_proj)):
            projection.prepare(self.ops, k_blocks=gemm_k_blocks, quantized=quantized.get(f"{name}.weight"))
        self.mlp.prepare(self.ops, fused_gate_up, gemm_k_blocks, parts_under(quantized, "mlp."))

    def attention_input(
        self, delta: torch.Tensor | None, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Adds the previous layer's normalised output into `residual`; returns rotated q, k and v."""
        attn, ops = self.self_attn, self.ops
        if delta is not None:
            residual.add_(delta)
        x = self.input_layernorm(residual)
        qkv = ops.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias).view(
            residual.shape[0], -1, attn.head_dim
        )
        heads, kv_heads = attn.num_heads, attn.num_kv_heads
        q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
        if attn.qk_norm:
            q.copy_(attn.q_norm(q))
            k.copy_(attn.k_norm(k))
        ops.rotary_embedding(qkv[:, : heads + kv_heads], cos, sin)
        return q, k, qkv[:, heads + kv_heads :]

    def attention_output(self, attn: torch.Tensor) -> torch.Tensor:
        o = self.self_attn.o_proj
        return self.ops.linear(attn.view(attn.shape[0], -1), o.weight, o.bias)

    def after_attention(self, delta: torch.Tensor) -> torch.Tensor:
        """The attention's output, all-reduced, normalised before it joins the residual."""
        return self.post_attention_layernorm(delta)

    def feed_forward(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        residual.add_(delta)
        x = self.pre_feedforward_layernorm(residual)
        mlp, ops = self.mlp, self.ops
        gate, up = ops.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, dim=-1)
        return ops.linear(F.gelu(gate, approximate="tanh") * up, mlp.down_proj.weight, mlp.down_proj.bias)

    def after_feed_forward(self, delta: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(delta)
