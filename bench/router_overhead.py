"""What a router adds in front of a server: the scripted server (fixed TTFT and ITL) at concurrency 16,
streaming, through `sluice bench serve`: direct, through sluice-router, through vllm-router; the TTFT
p50 each router adds and its CPU seconds per 1k streamed tokens. Writes
bench/results/issue9/overhead.json and overhead.png.

  python bench/router_overhead.py [--runs 3] [--vllm-router-venv DIR] [--lock FILE] [--policy cache-aware]
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from typing import Any

from harness import BENCH_DIR, log
from leg_figures import median_of, paired, plot_panels, save, verdict
from legs import DIRECT, Leg, bench_serve, default_model, main, rounds, router_legs, timed, wait_all
from scripted_upstream import URL_PREFIX
from servers import Server, start_server

# The figure.
ADDED_TTFT_BOUND_MS = 1.0


def scripted_upstream(args: argparse.Namespace) -> Server:
    argv = [sys.executable, str(BENCH_DIR / "scripted_upstream.py"), "--ttft", str(args.ttft)]
    argv += ["--itl", str(args.itl)]
    server = start_server("scripted", 0, argv, None, args.log_dir)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in server.log_path.read_text().splitlines():
            if line.startswith(URL_PREFIX):
                server.port = int(line.rsplit(":", 1)[1])
                return server
        if server.process.poll() is not None:
            raise RuntimeError(f"the scripted server exited: {server.log_path.read_text()}")
        time.sleep(0.1)
    raise TimeoutError("the scripted server did not print its URL")


def overhead(args: argparse.Namespace) -> None:
    tokenizer = default_model() / "tokenizer.json"
    options = ["--model", "scripted", "--tokenizer", str(tokenizer), "--dataset", "random", "--ignore-eos"]
    options += ["--random-input-len", "128", "--random-output-len", str(args.output_tokens)]
    options += ["--max-concurrency", str(args.concurrency)]
    warmup = [*options, "--num-prompts", str(args.concurrency)]
    options += ["--num-prompts", str(args.num_prompts)]
    with ExitStack() as stack:
        upstream = scripted_upstream(args)
        stack.callback(upstream.stop)
        wait_all([upstream], args.lock)
        legs = [Leg(DIRECT, upstream.url, None)]
        legs += router_legs(stack, args, [upstream.url], [args.policy], None)
        wait_all([leg.counted for leg in legs if leg.counted], args.lock)
        for leg in legs:
            log(f"warming up {leg.name}")
            bench_serve(leg.url, warmup, 0)
        runs = rounds(legs, args, lambda leg, run: timed(leg, lambda url: bench_serve(url, options, run)))
    print(
        f"\nrouter overhead: scripted server (TTFT {1e3 * args.ttft:g} ms, ITL {1e3 * args.itl:g} ms), "
        f"{args.num_prompts} streamed requests of {args.output_tokens} tokens, concurrency {args.concurrency}, "
        f"policy {args.policy}; medians of {args.runs} rounds"
    )
    summary: dict[str, Any] = {}
    print(f"{'leg':28}{'TTFT p50 ms':>13}{'added ms':>10}{'TPOT p50 ms':>13}{'tok/s':>9}{'CPU s/1k tok':>14}")
    for name, leg_runs in runs.items():
        added = 0.0 if name == DIRECT else paired(runs, name, DIRECT, "ttft_p50_ms", ratio=False)
        cpu = median_of(leg_runs, "cpu_s_per_1k_tokens") if name != DIRECT else float("nan")
        summary[name] = {"ttft_p50_ms": median_of(leg_runs, "ttft_p50_ms"), "added_ttft_p50_ms": added}
        summary[name] |= {"tpot_p50_ms": median_of(leg_runs, "tpot_p50_ms"), "cpu_s_per_1k_tokens": cpu}
        print(
            f"{name:28}{summary[name]['ttft_p50_ms']:13.2f}{added:10.2f}"
            f"{summary[name]['tpot_p50_ms']:13.2f}{median_of(leg_runs, 'out_tok_s'):9.1f}{cpu:14.4f}"
        )
    sluice = next((n for n in summary if n.startswith("sluice-router")), None)
    vllm = next((n for n in summary if n.startswith("vllm-router")), None)
    if sluice:
        added = summary[sluice]["added_ttft_p50_ms"]
        print(
            f"sluice-router added TTFT p50: {added:.2f} ms (target <= {ADDED_TTFT_BOUND_MS:g} ms: "
            f"{verdict(added <= ADDED_TTFT_BOUND_MS)})"
        )
    if sluice and vllm:
        ratio = summary[sluice]["cpu_s_per_1k_tokens"] / summary[vllm]["cpu_s_per_1k_tokens"]
        print(
            f"sluice-router CPU / vllm-router CPU per 1k tokens: {ratio:.2f}x (target <= 1: {verdict(ratio <= 1)})"
        )
    save("overhead", args, runs, summary)
    routed = {n: s for n, s in summary.items() if n != DIRECT}
    plot_panels(
        "overhead",
        f"Router overhead in front of the scripted server, concurrency {args.concurrency} (medians)",
        [
            (
                "added TTFT p50, ms (router - direct)",
                {n: s["added_ttft_p50_ms"] for n, s in routed.items()},
                ADDED_TTFT_BOUND_MS,
            ),
            (
                "router CPU s per 1k streamed tokens",
                {n: s["cpu_s_per_1k_tokens"] for n, s in routed.items()},
                None,
            ),
        ],
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ttft", type=float, default=0.05, help="the scripted server's TTFT, seconds")
    parser.add_argument(
        "--itl", type=float, default=0.02, help="the scripted server's inter-token latency, seconds"
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--policy", default="round-robin", choices=["round-robin", "cache-aware"])


if __name__ == "__main__":
    main(__doc__, add_options, overhead)
