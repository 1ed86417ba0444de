"""The mixture-of-experts kernel (csrc/cpu/moe.cpp) at every tier this CPU runs, against a float64 reference
written here token by token, and against torch_moe over the same weights: routing, renormalisation, the
shared expert, gated and plain gate_up packing, quantized experts, and the arguments it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.moe_tensors import MoeTensors, torch_moe
from worker.native_ops import NativeKernelError
from worker.quantized_weights import quantize_q8

HIDDEN, INNER, SHARED_INNER = 64, 64, 96


def random_experts(num_experts: int, shared: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    weights = {
        # Router rows of norm about 8 against inputs of unit entries: logits far apart.
        "router": randn(num_experts, HIDDEN, scale=1.0),
        "gate_up": randn(num_experts, 2 * INNER, HIDDEN, scale=0.15),
        "down": randn(num_experts, HIDDEN, INNER, scale=0.15),
    }
    if shared:
        weights |= {
            "shared_gate_up": randn(2 * SHARED_INNER, HIDDEN, scale=0.15),
            "shared_down": randn(HIDDEN, SHARED_INNER, scale=0.15),
            "shared_gate": randn(1, HIDDEN, scale=0.3),
        }
    return weights


def reference(
    x: torch.Tensor, w: dict[str, torch.Tensor], top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 MoE of each token on its own, and per token whether its top_k choice is clear: the logit of
    its last chosen expert exceeds the next one's by more than bf16 rounding of logits near 20 could undo."""
    x64 = x.double()
    out = torch.zeros_like(x64)
    clear = torch.zeros(x.shape[0], dtype=torch.bool)
    for t in range(x.shape[0]):
        logits = w["router"].double() @ x64[t]
        p = torch.softmax(logits, dim=0)
        ranked = torch.sort(p, descending=True)
        chosen, probs = ranked.indices[:top_k], ranked.values[:top_k]
        if top_k == p.numel():
            clear[t] = True
        else:
            clear[t] = bool(logits[ranked.indices[top_k - 1]] - logits[ranked.indices[top_k]] > 0.3)
        if renormalize:
            probs = probs / probs.sum()
        for e, weight in zip(chosen.tolist(), probs.tolist(), strict=True):
            gate, up = (w["gate_up"][e].double() @ x64[t]).chunk(2)
            out[t] += weight * (w["down"][e].double() @ (F.silu(gate) * up))
        if "shared_gate" in w:
            gate, up = (w["shared_gate_up"].double() @ x64[t]).chunk(2)
            scale = torch.sigmoid(w["shared_gate"].double() @ x64[t])
            out[t] += scale * (w["shared_down"].double() @ (F.silu(gate) * up))
    return out, clear


def packed_tensors(
    ops, w: dict[str, torch.Tensor], dtype: torch.dtype, top_k: int, renormalize: bool, gated: bool
) -> MoeTensors:
    pack_gate_up = ops.pack_gated_linear_weight if gated else ops.pack_linear_weight
    shared = "shared_gate" in w
    return MoeTensors(
        router=ops.pack_linear_weight(w["router"].to(dtype)),
        gate_up=tuple(pack_gate_up(m.to(dtype)) for m in w["gate_up"]),
        down=tuple(ops.pack_linear_weight(m.to(dtype)) for m in w["down"]),
        top_k=top_k,
        inner=INNER,
        renormalize=renormalize,
        shared_gate_up=pack_gate_up(w["shared_gate_up"].to(dtype)) if shared else None,
        shared_down=ops.pack_linear_weight(w["shared_down"].to(dtype)) if shared else None,
        shared_gate=ops.pack_linear_weight(w["shared_gate"].to(dtype)) if shared else None,
        shared_inner=SHARED_INNER if shared else 0,
    )


# Relative to the output's scale: float32 sums in a different order, or bf16 rounding at every step.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_experts", "top_k", "renormalize", "shared"),
    [(8, 2, True, False), (6, 3, False, True), (4, 4, True, False), (8, 1, False, True)],
)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_moe_matches_a_float64_reference(native, dtype, num_experts, top_k, renormalize, shared, gated, rows):
    w = random_experts(num_experts, shared, seed=rows * 100 + num_experts)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected, clear = reference(x, w, top_k, renormalize)
    got = native.moe(x, packed_tensors(native, w, dtype, top_k, renormalize, gated))
    assert got.dtype == dtype and got.shape == x.shape
    # Most tokens' choices are clear (the test would be empty otherwise); those must match.
    assert clear.float().mean() >= 0.6
    scale = expected.abs().max()
    error = (got.double() - expected).abs()[clear].max()
    assert error <= TOLERANCE[dtype] * scale, (error, scale)


def test_the_kernel_and_torch_moe_agree_on_the_same_packed_weights(native):
    w = random_experts(8, shared=True, seed=7)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    moe = packed_tensors(native, w, torch.float32, top_k=2, renormalize=True, gated=True)
    kernel = native.moe(x, moe)
    # torch_moe over the same packed weights, through the same GEMMs one expert at a time.
    looped = torch_moe(x, moe, native.linear, native.gated_linear)
    torch.testing.assert_close(kernel, looped, rtol=1e-6, atol=1e-6)


def test_quantized_experts_run_through_the_integer_gemm(native):
    w = random_experts(4, shared=False, seed=3)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    quantized = MoeTensors(
        router=native.pack_linear_weight(w["router"]),
        gate_up=tuple(
            native.pack_quantized_weight([quantize_q8(m, "float")], torch.float32) for m in w["gate_up"]
        ),
        down=tuple(native.pack_quantized_weight([quantize_q8(m, "float")], torch.float32) for m in w["down"]),
        top_k=2,
        inner=INNER,
        renormalize=True,
    )
    expected, clear = reference(x, w, 2, True)
    got = native.moe(x, quantized)
    # Q8 weights and activations: about 1% of each product.
    error = (got.double() - expected).abs()[clear].max()
    assert error <= 3e-2 * expected.abs().max()


def test_no_rows_is_no_work(native):
    moe = packed_tensors(native, random_experts(4, False, 0), torch.float32, 2, True, True)
    assert native.moe(torch.empty(0, HIDDEN), moe).shape == (0, HIDDEN)


def test_bad_arguments_are_refused_by_name(native):
    w = random_experts(4, shared=False, seed=0)
    moe = packed_tensors(native, w, torch.float32, 2, True, True)
    with pytest.raises(NativeKernelError, match="top_k must be in"):
        native.moe(torch.randn(2, HIDDEN), MoeTensors(**{**_fields(moe), "top_k": 5}))
    with pytest.raises(NativeKernelError, match="features but the packed weight expects"):
        native.moe(torch.randn(2, HIDDEN + 1), moe)
    with pytest.raises(NativeKernelError, match="shared expert needs"):
        native.moe(torch.randn(2, HIDDEN), MoeTensors(**{**_fields(moe), "shared_gate_up": moe.gate_up[0]}))


def _fields(moe: MoeTensors) -> dict:
    return {name: getattr(moe, name) for name in MoeTensors.__dataclass_fields__}
