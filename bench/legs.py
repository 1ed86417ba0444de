"""Legs and rounds, shared by the router and data-parallel benchmarks (router_overhead.py, router_w3.py,
cache_aware_routing.py, data_parallel.py); leg_figures.py turns their rounds into figures.

A leg is one way of reaching the servers under test: directly, or through a router. Every timed round
holds the shared lock exclusively and visits the legs in a rotated order.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from harness import LOCK_ENV, bench_lock, log, wait_until_quiet
from routers import (
    VLLM_ROUTER_VENV_ENV,
    sluice_router_binary,
    start_sluice_router,
    start_vllm_router,
    vllm_router_venv,
)
from servers import Server

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SLUICE = str(Path(sys.executable).parent / "sluice")
DIRECT = "direct"
# Figures of one leg in one round; the router's CPU is added when the leg has one.
Figures = dict[str, float]
ROUNDS_HELP = """
Every timed round holds the shared lock exclusively and visits the legs in a rotated order; the
figures are medians of --runs rounds, and ratios are taken within a round. A leg whose router is
not there (sluice-router not built, no vllm-router venv) is left out, and the script says so.
"""


@dataclass
class Leg:
    """One way of reaching the servers under test: a URL, and the process whose CPU is counted."""

    name: str
    url: str
    counted: Server | None


def bench_serve(url: str, options: list[str], seed: int) -> Figures:
    """One `sluice bench serve` run against `url`; its figures under this script's names."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result_file:
        argv = [SLUICE, "bench", "serve", "--base-url", url, "--no-progress", "--seed", str(seed)]
        argv += ["--save-result", result_file.name, *options]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"sluice bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(Path(result_file.name).read_text())
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed: {result['failures_by_reason']}")
    return {
        "ttft_p50_ms": result["median_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        "tpot_p50_ms": result["median_tpot_ms"],
        "out_tok_s": result["output_throughput"],
        "output_tokens": result["total_output_tokens"],
    }


def timed(leg: Leg, client: Callable[[str], Figures]) -> Figures:
    """The client's figures on `leg`, with the counted process's CPU seconds per 1k output tokens."""
    before = leg.counted.cpu_seconds() if leg.counted else 0.0
    figures = client(leg.url)
    if leg.counted is not None:
        figures["cpu_s_per_1k_tokens"] = 1e3 * (leg.counted.cpu_seconds() - before) / figures["output_tokens"]
    return figures


def rounds(
    legs: list[Leg], args: argparse.Namespace, measure: Callable[[Leg, int], Figures]
) -> dict[str, list[Figures]]:
    """--runs rounds, each under the exclusive lock, each visiting every leg (rotated order)."""
    runs: dict[str, list[Figures]] = {leg.name: [] for leg in legs}
    for run in range(args.runs):
        with bench_lock(args.lock, exclusive=True):
            for leg in legs[run % len(legs) :] + legs[: run % len(legs)]:
                log(f"round {run + 1}/{args.runs}: {leg.name}")
                wait_until_quiet()
                runs[leg.name].append(measure(leg, run))
                log(f"  { ({k: round(v, 3) for k, v in runs[leg.name][-1].items()}) }")
    return runs


def wait_all(servers: list[Server], lock: str | None) -> None:
    with bench_lock(lock, exclusive=False):
        for server in servers:
            log(f"waiting for {server.name} ({server.url})")
            server.wait_ready()


def default_model() -> Path:
    from sluice.default_model import prepare_default_model

    return prepare_default_model().resolve()


def router_legs(
    stack: ExitStack, args: argparse.Namespace, replicas: list[str], policies: list[str], model: Path | None
) -> list[Leg]:
    """A leg per router and policy that is available, each router started in front of `replicas`."""
    legs = []
    binary = sluice_router_binary()
    venv = vllm_router_venv(args.vllm_router_venv)
    if binary is None:
        log(
            "sluice-router is not built (no $SLUICE_ROUTER, none beside the interpreter or on PATH): left out"
        )
    if venv is None:
        log(f"no vllm-router venv (--vllm-router-venv or ${VLLM_ROUTER_VENV_ENV}): left out")
    for policy in policies:
        if binary is not None:
            name = f"sluice-router {policy}"
            server = start_sluice_router(name, binary, replicas, policy, model, args.log_dir)
            stack.callback(server.stop)
            legs.append(Leg(name, server.url, server))
        if venv is not None:
            name = f"vllm-router {policy}"
            server = start_vllm_router(name, venv, replicas, policy, args.log_dir)
            stack.callback(server.stop)
            legs.append(Leg(name, server.url, server))
    return legs


def main(
    doc: str | None,
    add_options: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], None],
    routers: bool = True,
) -> None:
    """Parse the options every script takes and `add_options`'s, then `run` with a log folder that
    is removed at the end; SIGTERM unwinds like Ctrl-C, so that every server started is stopped."""
    parser = argparse.ArgumentParser(
        description=f"{doc}{ROUNDS_HELP}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="timed rounds (medians)")
    parser.add_argument(
        "--lock", default=os.environ.get(LOCK_ENV), help="flock file: shared to load, exclusive to time"
    )
    if routers:
        parser.add_argument(
            "--vllm-router-venv", default=None, help=f"vllm-router 0.1.17's venv (or ${VLLM_ROUTER_VENV_ENV})"
        )
    add_options(parser)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix=f"sluice-{Path(sys.argv[0]).stem}-") as log_dir:
        args.log_dir = Path(log_dir)
        run(args)
