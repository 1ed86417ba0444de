"""The mixture-of-experts feed-forward of Qwen2-MoE, Qwen3-MoE and Mixtral, and which layers have one.

A router (`gate`, replicated on every rank) scores the experts; each token runs its top_k experts, MLPs
like a dense layer's, and sums their outputs weighted by the router's probabilities (worker/moe_tensors.py
says how, csrc/cpu/moe.cpp runs it). Qwen2-MoE adds a shared expert that every token runs, scaled by a
sigmoid gate. The modules are named as the checkpoints name their tensors (Mixtral's are renamed at load),
so the loader fills them as it fills a dense layer, q/k/v and gate/up fusion included.

Tensor parallelism splits every expert's intermediate size over the ranks (column-parallel gate_up,
row-parallel down), as a dense MLP is split: each rank holds a slice of every expert and computes every
token's partial sums, which the layer's all-reduce adds up. Expert parallelism (whole experts per rank,
tokens sent to the rank of their expert by an all-to-all) would read fewer, larger weights per rank; it
needs a token exchange that this design's all-reduce-only group does not have.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sluice.errors import UnsupportedArchitectureError
from worker.distributed import TensorParallelGroup
from worker.layer_ops import LayerOps
from worker.models.layers import MLP, Projection
from worker.moe_tensors import MoeTensors
from worker.quantized_weights import QuantizedParts, parts_under

MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


def num_experts(cfg: dict[str, Any]) -> int:
    """The experts per MoE layer: Mixtral's num_local_experts, Qwen's num_experts (which transformers 5
    writes as num_local_experts too)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def is_sparse_layer(cfg: dict[str, Any], architecture: str, index: int) -> bool:
    """Whether layer `index` has experts: every Mixtral layer; a Qwen MoE layer unless mlp_only_layers
    names it, every decoder_sparse_step-th one."""
    if architecture == "MixtralForCausalLM":
        return True
    if architecture not in MOE_ARCHITECTURES or num_experts(cfg) == 0:
        return False
    step = int(cfg.get("decoder_sparse_step") or 1)
    return index not in (cfg.get("mlp_only_layers") or []) and (index + 1) % step == 0


class SparseMoe(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], architecture: str, dtype: torch.dtype, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        mixtral = architecture == "MixtralForCausalLM"
        self.top_k = int(cfg["num_experts_per_tok"])
        # Mixtral always divides the chosen probabilities by their sum; Qwen where norm_topk_prob says.
        self.renormalize = mixtral or bool(cfg.get("norm_topk_prob", False))
        intermediate = int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"])
        count = num_experts(cfg)
        self.gate = Projection(hidden, count, False, dtype, "replicated", quantizable=False)
        self.experts = nn.ModuleList(MLP(cfg, intermediate, dtype, tp) for _ in range(count))
        self.inner = self.experts[0].inner
        if self.experts[0].activation != "silu":
            # The MoE kernel and torch_moe gate with SiLU, as these families do.
            raise UnsupportedArchitectureError(
                f"{architecture}'s hidden_act {self.experts[0].activation!r} is not supported; its experts run silu"
            )
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        self.shared_expert = MLP(cfg, shared, dtype, tp) if shared else None
        self.shared_expert_gate = (
            Projection(hidden, 1, False, dtype, "replicated", quantizable=False) if shared else None
        )
        # _stack_experts' tensors, by projection name; empty until prepare stacks them (CUDA).
        self.stacked: dict[str, torch.Tensor] = {}

    def prepare(self, ops: LayerOps, fused_gate_up: bool, k_blocks: bool, quantized: QuantizedParts) -> None:
        """Every weight in the form the ops read (Projection.prepare); quantized: parts by name within."""
        self.gate.prepare(ops, k_blocks=k_blocks)
        for index, expert in enumerate(self.experts):
            expert.prepare(ops, fused_gate_up, k_blocks, parts_under(quantized, f"experts.{index}."))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            self.shared_expert.prepare(ops, fused_gate_up, k_blocks, parts_under(quantized, "shared_expert."))
            self.shared_expert_gate.prepare(ops, k_blocks=k_blocks)
        if self.gate.weight.device.type == "cuda":
            self._stack_experts()

    def _stack_experts(self) -> None:
        """Every expert's weights in one tensor per kind, the experts' own weights becoming views of it,
        for the grouped GEMMs of worker/moe_triton.py (unpacked on CUDA, so stacking is a copy)."""
        for kind in ("gate_up_proj", "down_proj"):
            stacked = torch.stack([getattr(expert, kind).weight.data for expert in self.experts])
            for index, expert in enumerate(self.experts):
                getattr(expert, kind).weight = nn.Parameter(stacked[index], requires_grad=False)
            self.stacked[kind] = stacked

    def tensors(self) -> MoeTensors:
        shared, shared_gate = self.shared_expert, self.shared_expert_gate
        return MoeTensors(
            router=self.gate.weight,
            gate_up=tuple(expert.gate_up_proj.weight for expert in self.experts),
            down=tuple(expert.down_proj.weight for expert in self.experts),
            top_k=self.top_k,
            inner=self.inner,
            renormalize=self.renormalize,
            shared_gate_up=None if shared is None else shared.gate_up_proj.weight,
            shared_down=None if shared is None else shared.down_proj.weight,
            shared_gate=None if shared_gate is None else shared_gate.weight,
            shared_inner=0 if shared is None else shared.inner,
            stacked_gate_up=self.stacked.get("gate_up_proj"),
            stacked_down=self.stacked.get("down_proj"),
        )
