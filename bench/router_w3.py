"""W3 through a router: the 64 W1 prompts at concurrency 16 against one `sluice serve` replica of the
default model, direct and through sluice-router (and vllm-router); tok/s, TTFT and TPOT as ratios to
direct in the same round, and each router's CPU seconds per 1k tokens. Writes
bench/results/issue9/w3.json and w3.png.

  python bench/router_w3.py [--runs 3] [--vllm-router-venv DIR] [--lock FILE] [--policy round-robin]
"""

from __future__ import annotations

import argparse
import dataclasses
from contextlib import ExitStack
from typing import Any

from harness import bench_lock, log, w1_prompts
from leg_figures import median_of, paired, plot_panels, save
from legs import DIRECT, Figures, Leg, default_model, main, rounds, router_legs, timed, wait_all
from servers import start_sluice
from w3_client import run_w3


def w3(args: argparse.Namespace) -> None:
    model = default_model()
    prompts = w1_prompts()
    with ExitStack() as stack:
        replica = start_sluice("replica", model, ["--max-num-seqs", str(args.concurrency)], args.log_dir)
        stack.callback(replica.stop)
        # Routers start once their replicas answer: vllm-router's start-up wait can hang on a
        # replica that is still loading.
        wait_all([replica], args.lock)
        legs = [Leg(DIRECT, replica.url, None)]
        legs += router_legs(stack, args, [replica.url], [args.policy], model)
        wait_all([leg.counted for leg in legs if leg.counted], args.lock)
        with bench_lock(args.lock, exclusive=False):
            for leg in legs:
                log(f"warming up {leg.name}")
                run_w3(leg.url, prompts[: args.concurrency], args.concurrency, 8)

        def client(url: str) -> Figures:
            return dataclasses.asdict(run_w3(url, prompts, args.concurrency, args.output_tokens))

        runs = rounds(legs, args, lambda leg, run: timed(leg, client))
    print(
        f"\nW3 ({len(prompts)} prompts, concurrency {args.concurrency}, {args.output_tokens} tokens) in front of "
        f"one replica; medians of {args.runs} rounds; ratios to direct in the same round"
    )
    summary: dict[str, Any] = {}
    keys = ("out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
    print(f"{'leg':28}" + "".join(f"{k:>13}" for k in keys) + f"{'CPU s/1k tok':>14}")
    for name, leg_runs in runs.items():
        row = {k: median_of(leg_runs, k) for k in keys}
        if name != DIRECT:
            row |= {f"{k} / direct": paired(runs, name, DIRECT, k, ratio=True) for k in keys}
            row["cpu_s_per_1k_tokens"] = median_of(leg_runs, "cpu_s_per_1k_tokens")
        summary[name] = row
        cpu = row.get("cpu_s_per_1k_tokens", float("nan"))
        print(f"{name:28}" + "".join(f"{row[k]:13.2f}" for k in keys) + f"{cpu:14.4f}")
    for name, row in summary.items():
        if name != DIRECT:
            print(f"{name} / direct: " + ", ".join(f"{k} {row[f'{k} / direct']:.3f}x" for k in keys))
    save("w3", args, runs, summary)
    routed = {n: s for n, s in summary.items() if n != DIRECT}
    plot_panels(
        "w3",
        "W3 through a router in front of one replica (medians; ratio to direct, same round)",
        [
            ("output tok/s, router / direct", {n: s["out_tok_s / direct"] for n, s in routed.items()}, 1.0),
            ("TTFT p50, router / direct", {n: s["ttft_p50_ms / direct"] for n, s in routed.items()}, 1.0),
            ("router CPU s per 1k tokens", {n: s["cpu_s_per_1k_tokens"] for n, s in routed.items()}, None),
        ],
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--policy", default="cache-aware", choices=["round-robin", "cache-aware"])


if __name__ == "__main__":
    main(__doc__, add_options, w3)
