"""One MoE layer on CUDA: worker/moe_triton.py's grouped GEMMs (the default) against torch_moe (what
--no-fused-moe runs: the same GEMMs expert by expert, picked on the host), and the Triton layer replayed
from a CUDA graph (how FULL graphs run it in a decode step). The layer is issue 29's MoE bench model's
(make_moe_model.py: hidden 1024, 64 experts, top 8, expert intermediate 384), bf16, random weights.

Prints, per token count, the median of --runs timings of --iters calls each, in microseconds per layer
call, and the speedup over torch_moe. Needs a CUDA device.

  python bench/moe_cuda_kernel.py [--tokens 1,16,64,512] [--runs 5] [--iters 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from functools import partial

import torch

from worker.layer_ops import TorchLayerOps
from worker.moe_tensors import MoeTensors, torch_moe

HIDDEN, EXPERTS, TOP_K, INNER = 1024, 64, 8, 384


def bench_moe() -> MoeTensors:
    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * shape[-1] ** -0.5

    gate_up, down = weight(EXPERTS, 2 * INNER, HIDDEN), weight(EXPERTS, HIDDEN, INNER)
    return MoeTensors(
        router=weight(EXPERTS, HIDDEN),
        gate_up=tuple(gate_up),
        down=tuple(down),
        top_k=TOP_K,
        inner=INNER,
        renormalize=True,
        stacked_gate_up=gate_up,
        stacked_down=down,
    )


def median_us(call: Callable[[], object], runs: int, iters: int) -> float:
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="1,16,64,512")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_cuda_kernel: needs a CUDA device")
    from worker.moe_triton import triton_moe

    ops = TorchLayerOps()
    moe = bench_moe()
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; medians of {args.runs} x {args.iters} calls"
    )
    print(
        f"{'tokens':>6} {'torch_moe us':>13} {'triton us':>10} {'graph us':>9} {'speedup':>8} {'graph speedup':>14}"
    )
    for count in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(count, HIDDEN, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(
            triton_moe(x, moe, ops.linear, ops.gated_linear).float(),
            torch_moe(x, moe, ops.linear, ops.gated_linear).float(),
            atol=3e-2,
            rtol=3e-2,
        )
        eager = median_us(partial(torch_moe, x, moe, ops.linear, ops.gated_linear), args.runs, args.iters)
        triton = median_us(partial(triton_moe, x, moe, ops.linear, ops.gated_linear), args.runs, args.iters)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_moe(x, moe, ops.linear, ops.gated_linear)
        replayed = median_us(graph.replay, args.runs, args.iters)
        print(
            f"{count:>6} {eager:>13.1f} {triton:>10.1f} {replayed:>9.1f} {eager / triton:>7.2f}x "
            f"{eager / replayed:>13.2f}x"
        )


if __name__ == "__main__":
    main()
