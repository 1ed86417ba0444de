"""What a mixture-of-experts feed-forward's ops read (worker/models/moe.py builds it), and its torch form.

The CPU kernels run it in one call (csrc/cpu/moe.cpp), and CUDA in two Triton launches over stacked
weights (worker/moe_triton.py). torch_moe is the same computation in torch ops, for the "none" tier,
weights left unpacked and --no-fused-moe: it loops over the experts that were chosen, so it reads each
chosen expert once per step but synchronises with the device per expert, and a CUDA graph cannot capture
it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class MoeTensors:
    """A MoE layer's weights in the form the ops read them (prepared as linear weights); under tensor
    parallelism each expert's and the shared expert's are this rank's shards of their intermediate size."""

    # [num_experts, hidden]: the router's logits.
    router: torch.Tensor
    # Per expert: [gate; up] (gated_linear's weight) and down.
    gate_up: tuple[torch.Tensor, ...]
    down: tuple[torch.Tensor, ...]
    top_k: int
    # Each expert's intermediate size on this rank.
    inner: int
    # norm_topk_prob: the chosen experts' probabilities are divided by their sum.
    renormalize: bool
    # Qwen2-MoE's shared expert, which every token runs, and its [1, hidden] gate; None elsewhere.
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    shared_inner: int = 0
    # On CUDA (SparseMoe.prepare): every expert's gate_up [experts, 2 * inner, hidden] and down
    # [experts, hidden, inner] in one tensor each, of which gate_up and down are views; for triton_moe.
    stacked_gate_up: torch.Tensor | None = None
    stacked_down: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)


def route(x: torch.Tensor, t: MoeTensors, linear: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts [tokens, top_k] and their weights (float32): a float32 softmax over the
    router's logits, renormalised over the chosen where t.renormalize says."""
    probabilities = torch.softmax(linear(x, t.router, None), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probabilities, t.top_k, dim=-1)
    if t.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def shared_expert(
    x: torch.Tensor, t: MoeTensors, linear: Linear, gated_linear: Linear
) -> torch.Tensor | None:
    """Qwen2-MoE's shared expert's output times sigmoid of its gate, in float32; None without one."""
    if t.shared_gate_up is None:
        return None
    assert t.shared_down is not None and t.shared_gate is not None
    shared = linear(gated_linear(x, t.shared_gate_up, None), t.shared_down, None)
    return torch.sigmoid(linear(x, t.shared_gate, None).float()) * shared.float()


def torch_moe(x: torch.Tensor, t: MoeTensors, linear: Linear, gated_linear: Linear) -> torch.Tensor:
    """The MoE feed-forward of x [tokens, hidden] as csrc/cpu/moe.cpp computes it: route's experts and
    weights, the experts' outputs weighted and summed in float32 in ascending expert order, then the
    shared expert's."""
    weights, experts = route(x, t, linear)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(experts).tolist():
        token, choice = torch.where(experts == expert)
        y = linear(gated_linear(x[token], t.gate_up[expert], None), t.down[expert], None)
        out.index_add_(0, token, y.float() * weights[token, choice, None])
    shared = shared_expert(x, t, linear, gated_linear)
    if shared is not None:
        out += shared
    return out.to(x.dtype)
