"""Sluice's packed bf16 linear against torch's F.linear, on the linear shapes of the default and 1.1B models.

For every shape and row count M it prints the median GFLOP/s of both and their ratio; at M=1 also the
weight bytes read per second, against the machine's read bandwidth measured in the same run (a sum over
a 1 GiB tensor). Weights are cycled through enough copies to overflow the last-level cache, so M=1
reads them from memory as a decode step does. "whole-K" is the packed linear with
--no-gemm-k-blocks (each column group read whole), timed in turn with it; "K blocks" is the gain of
taking K in blocks (whole-K time over ours). --busy repeats the table while a competing process keeps
one core busy, to show how each degrades. --quantized times the integer GEMM instead (csrc/cpu/gemm_quant.cpp)
on random weights of each block kind (Q8, Q4 with a minimum, Q4 symmetric: GGUF's Q8_0, Q4_1/Q4_K, Q4_0)
against the packed bf16 linear of the same shape, in turn in one run. Run under the exclusive bench lock:

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/linear_kernel.py
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from sluice.cpu_tiers import CPU_ISA_CHOICES
from worker.native_abi import QUANT_Q4, QUANT_Q4_SYM, QUANT_Q8
from worker.native_ops import NativeOps, use_cpu_isa
from worker.quantized_weights import QuantizedRows

# (name, K, N) of each linear: qkv, o, gate_up, down and the LM head.
SHAPES = {
    "default": [
        ("qkv", 576, 960),
        ("o", 576, 576),
        ("gate_up", 576, 3072),
        ("down", 1536, 576),
        ("lm_head", 576, 49152),
    ],
    "1.1b": [
        ("qkv", 2048, 2560),
        ("o", 2048, 2048),
        ("gate_up", 2048, 11264),
        ("down", 5632, 2048),
        ("lm_head", 2048, 49152),
    ],
}
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048]
# More than the last-level cache (32 MiB here), so that weights come from memory.
COLD_BYTES = 96 << 20
QUANT_KINDS = {"q8": QUANT_Q8, "q4": QUANT_Q4, "q4sym": QUANT_Q4_SYM}


def read_bandwidth(runs: int, huge_pages: bool) -> float:
    """GB/s of a sum over a 1 GiB float32 tensor, the median of `runs`; on 2 MiB pages (as packed weights
    are) or on torch's usual 4 KiB ones (as bench/limits.py measures the read-bandwidth floor)."""
    if huge_pages:
        area = mmap.mmap(-1, 1 << 30)
        area.madvise(mmap.MADV_HUGEPAGE)
        data = torch.frombuffer(area, dtype=torch.float32).fill_(1.0)
    else:
        data = torch.ones(1 << 28, dtype=torch.float32)
    data.sum()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times) / 1e9


def seconds_per_call(fns: list[Callable[[int], object]], calls: int, runs: int) -> list[float]:
    """Per fn, the median over `runs` of the mean time of `calls` calls; fn(i) is the i-th call. Each
    run times every fn in turn, so that a change in the machine's speed falls on all of them alike,
    and the order rotates from run to run, so that none always follows the same one."""
    times: list[list[float]] = [[] for _ in fns]
    for run in range(runs):
        for f in range(len(fns)):
            index = (f + run) % len(fns)
            start = time.perf_counter()
            for i in range(calls):
                fns[index](i)
            times[index].append((time.perf_counter() - start) / calls)
    return [statistics.median(fn_times) for fn_times in times]


def time_all(ops: NativeOps, k: int, n: int, m: int, runs: int) -> tuple[float, float, float]:
    """Seconds per call for x [m, k] and W [n, k]: F.linear, the packed linear, and the packed linear
    with K taken whole (weights packed with k_blocks=False: KernelConfig.gemm_k_blocks off)."""
    copies = max(1, -(-COLD_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    packed = [ops.pack_linear_weight(w) for w in weights]
    packed_whole_k = [ops.pack_linear_weight(w, k_blocks=False) for w in weights]
    x = torch.randn(m, k, dtype=torch.bfloat16)

    def torch_call(i: int) -> object:
        return F.linear(x, weights[i % copies])

    def ours_call(i: int) -> object:
        return ops.linear(x, packed[i % copies], None)

    def whole_k_call(i: int) -> object:
        return ops.linear(x, packed_whole_k[i % copies], None)

    # Enough calls per run for about 50 ms, and at least one pass over the copies.
    (once,) = seconds_per_call([torch_call], 2, 1)
    calls = max(copies, min(2000, int(0.05 / max(once, 1e-7))))
    # F.linear apart: a call right after it runs slower (its threads), whichever of ours it is.
    (theirs,) = seconds_per_call([torch_call], calls, runs)
    seconds_per_call([ours_call, whole_k_call], calls, 1)
    ours, whole_k = seconds_per_call([ours_call, whole_k_call], calls, runs)
    return theirs, ours, whole_k


def print_table(ops: NativeOps, models: list[str], rows: list[int], runs: int, bandwidth: float) -> None:
    print(
        f"{'model':8} {'linear':8} {'K':>5} {'N':>6} {'M':>5} {'torch GF/s':>10} {'ours GF/s':>10} {'ratio':>6}"
        f" {'whole-K GF/s':>12} {'K blocks':>8}"
    )
    for model in models:
        for name, k, n in SHAPES[model]:
            for m in rows:
                theirs, ours, whole_k = time_all(ops, k, n, m, runs)
                flops = 2 * m * n * k
                line = (
                    f"{model:8} {name:8} {k:5} {n:6} {m:5} {flops / theirs / 1e9:10.1f} "
                    f"{flops / ours / 1e9:10.1f} {theirs / ours:6.2f} {flops / whole_k / 1e9:12.1f}"
                    f" {whole_k / ours:8.2f}"
                )
                if m == 1:
                    read = n * k * 2
                    line += (
                        f"   weight read GB/s: torch {read / theirs / 1e9:.1f}, ours {read / ours / 1e9:.1f}"
                        f" ({read / ours / 1e9 / bandwidth:.0%} of {bandwidth:.1f})"
                    )
                print(line, flush=True)


def random_quantized(kind: int, n: int, k: int, rng: np.random.Generator) -> QuantizedRows:
    """Random values and float16 scales of one block kind (quantized_weights.py)."""
    values = rng.integers(0, 256, size=(n, k // 32, 32 if kind == QUANT_Q8 else 16), dtype=np.uint8)
    if kind == QUANT_Q8:
        values = values.view(np.int8).clip(-127, 127).view(np.uint8)
    planes = 2 if kind == QUANT_Q4 else 1
    scales = (rng.random((n, k // 32, planes)) * 0.01).astype(np.float16)
    return QuantizedRows(kind, values, scales, "random")


def cycling_linear(ops: NativeOps, x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[int], object]:
    """Call i multiplies x by weights[i % len(weights)]: the copies overflow the cache in turn."""
    return lambda i: ops.linear(x, weights[i % len(weights)], None)


def print_quantized_table(ops: NativeOps, models: list[str], rows: list[int], runs: int) -> None:
    """GF/s of each block kind's integer GEMM and of the packed bf16 linear, timed in turn per shape and M."""
    rng = np.random.default_rng(0)
    print(f"{'model':8} {'linear':8} {'K':>5} {'N':>6} {'M':>5} {'bf16 GF/s':>10}", end="")
    print("".join(f" {name + ' GF/s':>12} {'x bf16':>6}" for name in QUANT_KINDS))
    for model in models:
        for name, k, n in SHAPES[model]:
            copies = max(1, -(-COLD_BYTES // (n * k * 2)))
            bf16 = [
                ops.pack_linear_weight(torch.randn(n, k, dtype=torch.bfloat16) / k**0.5)
                for _ in range(copies)
            ]
            quantized = [
                [
                    ops.pack_quantized_weight([random_quantized(kind, n, k, rng)], torch.bfloat16)
                    for _ in range(copies)
                ]
                for kind in QUANT_KINDS.values()
            ]
            for m in rows:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                fns = [cycling_linear(ops, x, weights) for weights in (bf16, *quantized)]
                (once,) = seconds_per_call(fns[:1], 2, 1)
                calls = max(copies, min(2000, int(0.05 / max(once, 1e-7))))
                seconds_per_call(fns, calls, 1)
                times = seconds_per_call(fns, calls, runs)
                flops = 2 * m * n * k
                line = f"{model:8} {name:8} {k:5} {n:6} {m:5} {flops / times[0] / 1e9:10.1f}"
                line += "".join(f" {flops / t / 1e9:12.1f} {times[0] / t:6.2f}" for t in times[1:])
                print(line, flush=True)


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """A competing process spinning on the last core."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    with contextlib.suppress(OSError):
        os.sched_setaffinity(proc.pid, {max(os.sched_getaffinity(0))})
    try:
        time.sleep(0.2)
        yield
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES, reverse=True))
    parser.add_argument("--rows", nargs="+", type=int, default=ROWS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="also repeat the table with one core kept busy")
    parser.add_argument(
        "--quantized", action="store_true", help="time the integer GEMM's block kinds against the bf16 linear"
    )
    parser.add_argument("--cpu-isa", default="auto", choices=CPU_ISA_CHOICES, help="the kernels' tier")
    args = parser.parse_args()
    ops = use_cpu_isa(args.cpu_isa)
    if ops is None:
        raise SystemExit("linear_kernel times Sluice's kernels: --cpu-isa none has none")
    torch.manual_seed(0)
    if args.quantized:
        print(f"{ops.tier} kernels, threads {torch.get_num_threads()}; medians of {args.runs} runs, in turn")
        print_quantized_table(ops, args.models, args.rows, args.runs)
        return
    small_pages = read_bandwidth(args.runs, huge_pages=False)
    bandwidth = read_bandwidth(args.runs, huge_pages=True)
    print(
        f"{ops.tier} kernels, threads {torch.get_num_threads()}, read bandwidth (sum over 1 GiB): {bandwidth:.1f} GB/s on 2 MiB pages,"
        f" {small_pages:.1f} GB/s on 4 KiB pages; packed weights live on 2 MiB pages, F.linear's on 4 KiB"
    )
    print_table(ops, args.models, args.rows, args.runs, bandwidth)
    if args.busy:
        print("\nwith a competing process spinning on one core:")
        with busy_core():
            print_table(ops, args.models, args.rows, args.runs, bandwidth)


if __name__ == "__main__":
    main()
