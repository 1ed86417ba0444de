"""Data parallelism: W4 online (the first 16 W1 prompts, 64 tokens out, all at once) on the 1.1B model
(make_w4_model.py), `sluice serve --data-parallel-size 2` against one replica on all the cores, with
the ceilings that the machine's read bandwidth and matmul speed put on each. Writes
bench/results/issue9/dp.json and dp.png.

  python bench/data_parallel.py [--runs 3] [--lock FILE] [--model DIR] [--max-num-batched-tokens 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from harness import bench_lock, log, w1_prompts
from leg_figures import median_of, paired, plot_panels, save, verdict
from legs import Figures, Leg, main, rounds, timed, wait_all
from routers import sluice_router_binary
from servers import start_sluice
from w3_client import run_w3

# The figure.
DP_RATIO = 1.0


def dp_ceilings(model: Path, batch: int) -> dict[str, float]:
    """What bounds W4's decode on this machine, measured now: read bandwidth and matmul speed with
    all the cores in one process against one core each, and the ceilings they give both setups."""
    import torch

    from limits import linear_gflops, read_bandwidth_gbs, weight_bytes

    config = json.loads((model / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    threads = torch.get_num_threads()
    figures = {"weight_gb": weight_bytes(model) / 1e9, "threads": threads}
    figures["read_gbs_all_cores"] = read_bandwidth_gbs()
    figures["mlp_gflops_all_cores_batch"] = linear_gflops(batch, hidden, inter)
    torch.set_num_threads(1)
    figures["read_gbs_one_core"] = read_bandwidth_gbs()
    figures["mlp_gflops_one_core_half_batch"] = linear_gflops(batch // 2, hidden, inter)
    torch.set_num_threads(threads)
    # Decode streams every weight once per step for the whole batch: batch x bandwidth / bytes.
    figures["bandwidth_ceiling_one_replica_tok_s"] = (
        batch * figures["read_gbs_all_cores"] / figures["weight_gb"]
    )
    # Two replicas stream the weights twice, each half the batch, on one core's bandwidth each at best.
    figures["bandwidth_ceiling_dp2_tok_s"] = (
        2
        * (batch // 2)
        * min(figures["read_gbs_one_core"], figures["read_gbs_all_cores"] / 2)
        / figures["weight_gb"]
    )
    figures["compute_ratio_dp2"] = (
        2 * figures["mlp_gflops_one_core_half_batch"] / figures["mlp_gflops_all_cores_batch"]
    )
    return figures


def dp(args: argparse.Namespace) -> None:
    model = args.model.resolve()
    prompts = w1_prompts()[:16]
    extra = ["--max-num-seqs", str(len(prompts)), "--kv-cache-memory", str(args.kv_cache_memory)]
    if args.max_num_batched_tokens is not None:
        extra += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    legs = []
    with ExitStack() as stack:
        one = start_sluice("one replica, all cores", model, extra, args.log_dir)
        stack.callback(one.stop)
        legs.append(Leg(one.name, one.url, one))
        if sluice_router_binary() is None:
            log("sluice-router is not built: the --data-parallel-size 2 leg is left out")
        else:
            two = start_sluice(
                "data-parallel-size 2", model, [*extra, "--data-parallel-size", "2"], args.log_dir
            )
            stack.callback(two.stop)
            legs.append(Leg(two.name, two.url, two))
        wait_all([leg.counted for leg in legs if leg.counted], args.lock)
        with bench_lock(args.lock, exclusive=False):
            for leg in legs:
                log(f"warming up {leg.name}")
                run_w3(leg.url, prompts, len(prompts), 4)
        with bench_lock(args.lock, exclusive=True):
            log("measuring the machine's limits (both servers idle)")
            ceilings = dp_ceilings(model, len(prompts))

        def client(url: str) -> Figures:
            return dataclasses.asdict(run_w3(url, prompts, len(prompts), args.output_tokens))

        runs = rounds(legs, args, lambda leg, run: timed(leg, client))
    print(
        f"\nW4 online ({len(prompts)} prompts, {args.output_tokens} out, all at once) on {model.name}; "
        f"medians of {args.runs} rounds"
    )
    summary: dict[str, Any] = {"limits": ceilings}
    keys = ("out_tok_s", "ttft_p50_ms", "tpot_p50_ms", "cpu_s_per_1k_tokens")
    print(f"{'leg':28}" + "".join(f"{k:>22}" for k in keys))
    for name, leg_runs in runs.items():
        summary[name] = {k: median_of(leg_runs, k) for k in keys}
        print(f"{name:28}" + "".join(f"{summary[name][k]:22.2f}" for k in keys))
    for key, value in ceilings.items():
        print(f"  {key}: {value:.3f}")
    ceiling_ratio = ceilings["bandwidth_ceiling_dp2_tok_s"] / ceilings["bandwidth_ceiling_one_replica_tok_s"]
    print(
        f"bandwidth ceiling, DP=2 / one replica: {ceiling_ratio:.2f}x; compute, DP=2 / one replica: "
        f"{ceilings['compute_ratio_dp2']:.2f}x"
    )
    bars = {"ceiling (bandwidth)": ceiling_ratio, "ceiling (compute)": ceilings["compute_ratio_dp2"]}
    if len(legs) == 2:
        ratio = paired(runs, legs[1].name, legs[0].name, "out_tok_s", ratio=True)
        summary["dp2 / one replica"] = ratio
        bars = {"measured": ratio} | bars
        print(
            f"W4 throughput, data-parallel-size 2 / one replica: {ratio:.2f}x (target >= {DP_RATIO:g}: "
            f"{verdict(ratio >= DP_RATIO)})"
        )
    save("dp", args, runs, summary)
    plot_panels(
        "dp",
        "W4 online: --data-parallel-size 2 / one replica on all cores",
        [("W4 tok/s ratio, DP=2 / one replica", bars, DP_RATIO)],
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, default=Path.home() / ".cache" / "sluice" / "models" / "w4-llama-1.1b-random"
    )
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB per worker")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="a step's token budget on both legs (default: the engine's; the first rounds used 128)",
    )


if __name__ == "__main__":
    main(__doc__, add_options, dp, routers=False)
