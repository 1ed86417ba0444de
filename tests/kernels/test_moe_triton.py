"""worker/moe_triton.py's MoE against torch_moe, the expert-by-expert reference, on random experts.

With CUDA the tests run on the GPU. Without it this module runs itself in a child pytest process with
TRITON_INTERPRET=1 set from the start (as tests/kernels/test_triton_attention.py does, for the same
reason: triton.jit reads the variable when the kernels module is imported).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from triton_interpreter import run_interpreted
from worker.layer_ops import TorchLayerOps
from worker.moe_tensors import MoeTensors, torch_moe

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
RUN_HERE = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
here = pytest.mark.skipif(not RUN_HERE, reason="runs in the TRITON_INTERPRET=1 child process")
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
OPS = TorchLayerOps()


def make_moe(
    num_experts: int,
    hidden: int,
    inner: int,
    top_k: int,
    dtype: torch.dtype,
    renormalize: bool = True,
    shared: bool = False,
    seed: int = 0,
) -> MoeTensors:
    g = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype).to(DEVICE)

    gate_up, down = weight(num_experts, 2 * inner, hidden), weight(num_experts, hidden, inner)
    extra = (
        {
            "shared_gate_up": weight(2 * inner, hidden),
            "shared_down": weight(hidden, inner),
            "shared_gate": weight(1, hidden),
            "shared_inner": inner,
        }
        if shared
        else {}
    )
    return MoeTensors(
        router=weight(num_experts, hidden),
        gate_up=tuple(gate_up),
        down=tuple(down),
        top_k=top_k,
        inner=inner,
        renormalize=renormalize,
        stacked_gate_up=gate_up,
        stacked_down=down,
        **extra,
    )


def tokens(count: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def assert_matches_reference(x: torch.Tensor, moe: MoeTensors) -> None:
    from worker.moe_triton import triton_moe

    got = triton_moe(x, moe, OPS.linear, OPS.gated_linear)
    # torch_moe reads the per-expert views; with stacked weights present OPS.moe would not run it.
    want = torch_moe(x, moe, OPS.linear, OPS.gated_linear)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.isfinite(got).all()
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(RUN_HERE, reason="the kernels run in this process")
def test_moe_kernel_under_interpreter() -> None:
    run_interpreted(__file__)


@here
def test_rows_are_tiled_by_expert_with_padding() -> None:
    from worker.moe_triton import tile_rows_by_expert

    # Rows (token * top_k + choice): 0 -> 3, 1 -> 1, 2 -> 1, 3 -> 0, 4 -> 3, 5 -> 2.
    experts = torch.tensor([[3, 1], [1, 0], [3, 2]], device=DEVICE)
    tiles = tile_rows_by_expert(experts, num_experts=5, block_m=4)
    pad = 6
    assert tiles.sorted_rows.tolist()[:16] == [
        3,
        pad,
        pad,
        pad,
        1,
        2,
        pad,
        pad,
        5,
        pad,
        pad,
        pad,
        0,
        4,
        pad,
        pad,
    ]
    assert tiles.num_padded_rows.tolist() == [16]
    assert tiles.tile_expert.tolist()[:4] == [0, 1, 2, 3]
    # Room for the worst case: each of min(experts, rows) runs padded by block_m - 1.
    assert tiles.sorted_rows.numel() >= 6 + 5 * 3


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 70])
def test_matches_expert_by_expert(dtype: torch.dtype, num_tokens: int) -> None:
    # 70 tokens x 2 choices over 8 experts takes the 64-row tiles; fewer take 16-row ones.
    moe = make_moe(num_experts=8, hidden=48, inner=40, top_k=2, dtype=dtype)
    assert_matches_reference(tokens(num_tokens, 48, dtype), moe)


@here
@pytest.mark.parametrize("renormalize", [True, False])
def test_shared_expert_and_unnormalised_weights(renormalize: bool) -> None:
    moe = make_moe(16, 64, 24, 4, torch.float32, renormalize=renormalize, shared=True)
    assert_matches_reference(tokens(9, 64, torch.float32), moe)


@here
def test_one_expert_per_token_and_every_expert_chosen() -> None:
    moe = make_moe(4, 32, 96, 1, torch.float32)
    assert_matches_reference(tokens(33, 32, torch.float32), moe)
    moe = make_moe(4, 32, 32, 4, torch.float32, seed=3)
    assert_matches_reference(tokens(5, 32, torch.float32), moe)


@here
def test_layer_ops_run_the_kernel_only_for_stacked_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker import moe_triton

    calls: list[int] = []
    kernel = moe_triton.triton_moe

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(moe_triton, "triton_moe", counted)
    moe = make_moe(4, 32, 32, 2, torch.float32)
    x = tokens(3, 32, torch.float32)
    OPS.moe(x, moe)
    OPS.moe(x, dataclasses.replace(moe, stacked_gate_up=None, stacked_down=None))
    assert calls == [1]


@gpu_only
def test_a_cuda_graph_captures_the_routing_and_replays_new_tokens() -> None:
    from worker.moe_triton import triton_moe

    moe = make_moe(8, 64, 32, 2, torch.bfloat16, shared=True)
    static = tokens(6, 64, torch.bfloat16)
    triton_moe(static, moe, OPS.linear, OPS.gated_linear)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe(static, moe, OPS.linear, OPS.gated_linear)
    for seed in (5, 6):
        static.copy_(tokens(6, 64, torch.bfloat16, seed=seed))
        graph.replay()
        want = triton_moe(static, moe, OPS.linear, OPS.gated_linear)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
