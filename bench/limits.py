"""This machine's limits, measured now: read bandwidth, the one-stream decode floor, bf16 matmul GFLOP/s,
and the fp32 FMA roofline of a kernel tier.

One decode stream reads every weight once per token, so weight bytes / read bandwidth is the
fastest a single stream can go (W2, W5). Matmul throughput at the models' own shapes bounds the
batched workloads (W1, W4); at a tier whose GEMM accumulates in fp32 by FMA (every tier but
avx512bf16's bf16 pairs), the FMA peak of that tier's vectors on every thread (bench/probes/
fma_peak.c, built with the tier's own flags) is the roofline. Bandwidth here has varied 23-49 GB/s
within an hour: run this right before the benchmark it bounds, and compare only figures from the
same session.

  python bench/limits.py [--model DIR ...] [--fma-tier TIER] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from harness import BENCH_DIR, log
from sluice import cpu_tiers

GIB = 1 << 30
PREFILL_LM_HEAD_ROWS = 64


def read_bandwidth_gbs(repeats: int = 7) -> float:
    """Best of `repeats` sums over a 1 GiB fp32 tensor, far beyond any cache: bytes read per second."""
    data = torch.ones(GIB // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best / 1e9


def fma_peak_gflops(tier: str) -> float:
    """fp32 FMA GFLOP/s on torch's threads with the vectors of `tier` (bench/probes/fma_peak.c)."""
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "fma_peak"
        flags = list(cpu_tiers.tier_named(tier).cflags)
        source = BENCH_DIR / "probes" / "fma_peak.c"
        subprocess.run(
            ["cc", "-O3", "-ffp-contract=fast", "-fopenmp", *flags, str(source), "-o", str(probe)], check=True
        )
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        done = subprocess.run([str(probe)], check=True, capture_output=True, text=True, env=env)
    return float(done.stdout.split()[-1])


def weight_bytes(model_dir: Path) -> int:
    """Bytes of every tensor in the folder's safetensors files, read from their headers."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        tensors = [entry for key, entry in header.items() if key != "__metadata__"]
        total += sum(entry["data_offsets"][1] - entry["data_offsets"][0] for entry in tensors)
    return total


def linear_shapes(config: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(name, K, N) of each kind of linear in a Llama-shaped decoder layer, and the LM head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    return [
        ("qkv", hidden, qkv),
        ("o", config["num_attention_heads"] * head_dim, hidden),
        ("gate_up", hidden, 2 * inter),
        ("down", inter, hidden),
        ("lm_head", hidden, config["vocab_size"]),
    ]


def linear_gflops(m: int, k: int, n: int, budget_s: float = 0.3) -> float:
    """bf16 F.linear at (M, K) x (N, K)^T: the median of repeats filling `budget_s`, after warm-up."""
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    for _ in range(2):
        F.linear(x, w)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / statistics.median(times) / 1e9


def measure(model_dirs: list[Path], batch_sizes: list[int], fma_tier: str | None = None) -> dict[str, Any]:
    log("measuring read bandwidth")
    bandwidth = read_bandwidth_gbs()
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "read_gbs": bandwidth, "models": {}}
    if fma_tier is not None:
        log(f"measuring the fp32 FMA peak at the {fma_tier} tier")
        result["fma_tier"] = fma_tier
        result["fma_peak_gflops"] = fma_peak_gflops(fma_tier)
    for model_dir in model_dirs:
        if batch_sizes:
            log(f"measuring matmuls at {model_dir.name}'s shapes")
        config = json.loads((model_dir / "config.json").read_text())
        size = weight_bytes(model_dir)
        gflops = {
            f"{name} M={m} K={k} N={n}": linear_gflops(m, k, n)
            for m in batch_sizes
            for name, k, n in linear_shapes(config)
            # A prefill runs the LM head on each sequence's last token only, never on M=2048 rows.
            if not (name == "lm_head" and m > PREFILL_LM_HEAD_ROWS)
        }
        result["models"][str(model_dir)] = {
            "weight_bytes": size,
            "decode_floor_ms": size / (bandwidth * 1e9) * 1e3,
            "linear_gflops": gflops,
        }
    return result


def default_model_dirs() -> list[Path]:
    from make_w4_model import default_w4_dir
    from sluice.default_model import prepare_default_model

    dirs = [prepare_default_model()]
    return dirs + [default_w4_dir()] if default_w4_dir().is_dir() else dirs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, action="append", help="model folder (default: the default and W4)"
    )
    parser.add_argument(
        "--batch", type=int, action="append", help="M of the matmuls (default: 1, 16, 64, 2048)"
    )
    parser.add_argument("--no-matmul", action="store_true", help="read bandwidth and floors only")
    parser.add_argument(
        "--fma-tier",
        choices=[t.name for t in cpu_tiers.TIERS],
        help="also the fp32 FMA peak at this kernel tier",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    batch_sizes = [] if args.no_matmul else (args.batch or [1, 16, 64, 2048])
    result = measure(args.model or default_model_dirs(), batch_sizes, args.fma_tier)
    print(f"threads: {result['threads']}")
    print(f"read bandwidth: {result['read_gbs']:.1f} GB/s (best of 7 sums over 1 GiB)")
    if args.fma_tier:
        print(f"fp32 FMA peak at the {args.fma_tier} tier: {result['fma_peak_gflops']:.1f} GFLOP/s")
    for model_dir, figures in result["models"].items():
        print(f"{Path(model_dir).name}: {figures['weight_bytes'] / 1e6:.0f} MB of weights")
        print(f"  one-stream decode floor: {figures['decode_floor_ms']:.2f} ms/token")
        for shape, gflops in figures["linear_gflops"].items():
            print(f"  bf16 linear {shape}: {gflops:.0f} GFLOP/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
