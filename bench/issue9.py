"""Issue 9's figures, one subcommand each; every run goes to bench/results/issue9/<figure>.json, a PNG beside it.

  overhead     a router in front of the scripted server (fixed TTFT and ITL), concurrency 16,
               streaming, through `sluice bench serve`: direct, through sluice-router, through
               vllm-router; the TTFT p50 each router adds and its CPU seconds per 1k streamed tokens
  w3           W3 through sluice-router (and vllm-router) in front of one real replica, against direct
  cache-aware  2 replicas of the default model, each on its share of the cores, `sluice bench serve
               --dataset prefix` (8 prefixes of 512 tokens, shuffled): the replicas' prefix-cache hit
               rate and TTFT p50 per router and policy
  dp           W4 online (the first 16 W1 prompts, 64 tokens out, all at once): `sluice serve
               --data-parallel-size 2` against one replica on all the cores, with the ceilings that
               the machine's read bandwidth and matmul speed put on each

Every timed round holds the shared lock exclusively and visits the legs in a rotated order; the
figures are medians of --runs rounds, and ratios are taken within a round. A leg whose router is
not there (sluice-router not built, no vllm-router venv) is left out, and the script says so.

  python bench/issue9.py overhead|w3|cache-aware|dp [--runs 3] [--vllm-router-venv DIR] [--lock FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import BENCH_DIR, LOCK_ENV, bench_lock, log, w1_prompts, wait_until_quiet
from routers import (
    VLLM_ROUTER_VENV_ENV,
    sluice_router_binary,
    start_sluice_router,
    start_vllm_router,
    vllm_router_venv,
)
from scripted_upstream import URL_PREFIX
from servers import Server, start_server, start_sluice
from w3_client import run_w3

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS_DIR = BENCH_DIR / "results" / "issue9"
SLUICE = str(Path(sys.executable).parent / "sluice")
DIRECT = "direct"
# The figures.
ADDED_TTFT_BOUND_MS = 1.0
HIT_RATE_GAIN = 1.8
TTFT_SHARE = 0.6
DP_RATIO = 1.0
PREFIX_METRICS = ("sluice:prefix_cache_hits_total", "sluice:prefix_cache_queries_total")
# Figures of one leg in one round; the router's CPU is added when the leg has one.
Figures = dict[str, float]


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


def median_of(runs: list[Figures], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def paired(runs: dict[str, list[Figures]], leg: str, base: str, key: str, ratio: bool) -> float:
    """Median over rounds of leg's figure minus (or over) base's in the same round."""
    pairs = zip(runs[leg], runs[base], strict=True)
    return statistics.median(a[key] / b[key] if ratio else a[key] - b[key] for a, b in pairs)


def wait_all(servers: list[Server], lock: str | None) -> None:
    with bench_lock(lock, exclusive=False):
        for server in servers:
            log(f"waiting for {server.name} ({server.url})")
            server.wait_ready()


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def save(
    name: str, args: argparse.Namespace, runs: dict[str, list[Figures]], summary: dict[str, Any]
) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    options = {k: v for k, v in vars(args).items() if k != "run"}
    path.write_text(json.dumps({"args": options, "runs": runs, "summary": summary}, indent=1, default=str))
    print(f"\nresults: {path}")
    return path


def plot_panels(name: str, title: str, panels: list[tuple[str, dict[str, float], float | None]]) -> None:
    """One PNG of bar panels: (y label, {bar: value}, a target line or None)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (label, bars, target) in zip(axes[0], panels, strict=True):
        ax.bar(range(len(bars)), list(bars.values()), color="tab:blue")
        for x, value in enumerate(bars.values()):
            ax.text(x, value, f"{value:.3f}" if abs(value) < 10 else f"{value:.0f}", ha="center", va="bottom")
        if target is not None:
            ax.axhline(target, color="black", linestyle="--", linewidth=1, label="target")
            ax.legend()
        ax.set_xticks(range(len(bars)), list(bars), rotation=15, ha="right")
        ax.set_ylabel(label)
    fig.suptitle(title)
    fig.tight_layout()
    path = RESULTS_DIR / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


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


def sluice_serve_takes(option: str) -> bool:
    """Whether this tree's `sluice serve` has `option` (the KV-events port arrives with its own branch)."""
    done = subprocess.run([SLUICE, "serve", "--help"], capture_output=True, text=True, check=True)
    return option in done.stdout


def prefix_cache_counts(replicas: list[Server]) -> tuple[float, float]:
    """Prefix-cache hits and queries, summed over the replicas' /metrics."""
    totals = dict.fromkeys(PREFIX_METRICS, 0.0)
    for replica in replicas:
        with urllib.request.urlopen(f"{replica.url}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if name.split("{", 1)[0] in totals:
                    totals[name.split("{", 1)[0]] += float(value.split()[0])
    return totals[PREFIX_METRICS[0]], totals[PREFIX_METRICS[1]]


def cache_aware(args: argparse.Namespace) -> None:
    from servers import free_port
    from sluice.cpu_binding import cores_per_replica, usable_cores

    model = default_model()
    options = [
        "--tokenizer",
        str(model / "tokenizer.json"),
        "--dataset",
        "prefix",
        "--shuffle",
        "--ignore-eos",
    ]
    options += ["--prefix-len", str(args.prefix_len), "--num-prefixes", str(args.num_prefixes)]
    options += ["--random-input-len", str(args.suffix_len), "--random-output-len", str(args.output_tokens)]
    options += ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency)]
    events = sluice_serve_takes("--kv-events-port")
    if not events:
        log(
            "this sluice serve has no --kv-events-port: sluice-router's cache-aware policy runs on its prefix tree"
        )
    with ExitStack() as stack:
        replicas = []
        for index, cores in enumerate(cores_per_replica(usable_cores(), 2)):
            extra = ["--enable-prefix-caching", "--num-kv-blocks", str(args.num_kv_blocks)]
            extra += ["--max-num-seqs", str(args.concurrency)]
            extra += ["--kv-events-port", str(free_port())] if events else []
            replica = start_sluice(f"replica {index}", model, extra, args.log_dir, cores)
            stack.callback(replica.stop)
            replicas.append(replica)
        wait_all(replicas, args.lock)
        legs = router_legs(stack, args, [r.url for r in replicas], ["cache-aware", "round-robin"], model)
        if not legs:
            raise SystemExit("no router to compare: build sluice-router or give --vllm-router-venv")
        wait_all([leg.counted for leg in legs if leg.counted], args.lock)

        def measure(leg: Leg, run: int) -> Figures:
            # Fresh prefixes for every leg of every round: no leg finds another's in the caches.
            seed = 1000 * (run + 1) + [leg.name for leg in legs].index(leg.name)
            hits, queries = prefix_cache_counts(replicas)
            figures = timed(leg, lambda url: bench_serve(url, options, seed))
            new_hits, new_queries = prefix_cache_counts(replicas)
            return figures | {"hit_rate": (new_hits - hits) / max(new_queries - queries, 1.0)}

        runs = rounds(legs, args, measure)
    print(
        f"\ncache-aware routing: 2 replicas ({args.num_kv_blocks} KV blocks each), {args.num_prompts} requests, "
        f"{args.num_prefixes} prefixes of {args.prefix_len} tokens + {args.suffix_len}, {args.output_tokens} out, "
        f"concurrency {args.concurrency}, shuffled; medians of {args.runs} rounds"
    )
    summary = {
        name: {
            k: median_of(leg_runs, k) for k in ("hit_rate", "ttft_p50_ms", "out_tok_s", "cpu_s_per_1k_tokens")
        }
        for name, leg_runs in runs.items()
    }
    print(f"{'leg':28}{'hit rate':>10}{'TTFT p50 ms':>13}{'tok/s':>9}")
    for name, row in summary.items():
        print(f"{name:28}{row['hit_rate']:10.3f}{row['ttft_p50_ms']:13.1f}{row['out_tok_s']:9.1f}")
    for router in ("sluice-router", "vllm-router"):
        aware, robin = f"{router} cache-aware", f"{router} round-robin"
        if aware in runs:
            gain = paired(runs, aware, robin, "hit_rate", ratio=True)
            share = paired(runs, aware, robin, "ttft_p50_ms", ratio=True)
            summary[aware] |= {"hit_rate / round-robin": gain, "ttft_p50 / round-robin": share}
            print(
                f"{router}: cache-aware / round-robin: hit rate {gain:.2f}x (target >= {HIT_RATE_GAIN:g}: "
                f"{verdict(gain >= HIT_RATE_GAIN)}), TTFT p50 {share:.2f}x (target <= {TTFT_SHARE:g}: "
                f"{verdict(share <= TTFT_SHARE)})"
            )
    if "sluice-router cache-aware" in runs and "vllm-router cache-aware" in runs:
        hit = paired(runs, "sluice-router cache-aware", "vllm-router cache-aware", "hit_rate", ratio=True)
        ttft = paired(runs, "sluice-router cache-aware", "vllm-router cache-aware", "ttft_p50_ms", ratio=True)
        print(
            f"sluice-router / vllm-router, both cache-aware: hit rate {hit:.2f}x (target >= 1: {verdict(hit >= 1)}), "
            f"TTFT p50 {ttft:.2f}x (target <= 1: {verdict(ttft <= 1)})"
        )
    save("cache_aware", args, runs, summary)
    plot_panels(
        "cache_aware",
        f"{args.num_prefixes} x {args.prefix_len}-token prefixes over 2 replicas (medians)",
        [
            ("prefix-cache hit rate", {n: s["hit_rate"] for n, s in summary.items()}, None),
            ("TTFT p50, ms", {n: s["ttft_p50_ms"] for n, s in summary.items()}, None),
        ],
    )


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="timed rounds (medians)")
    parser.add_argument(
        "--lock", default=os.environ.get(LOCK_ENV), help="flock file: shared to load, exclusive to time"
    )
    parser.add_argument(
        "--vllm-router-venv", default=None, help=f"vllm-router 0.1.17's venv (or ${VLLM_ROUTER_VENV_ENV})"
    )
    figures = parser.add_subparsers(dest="figure", required=True)

    over = figures.add_parser("overhead", help="routers in front of the scripted server")
    over.add_argument("--ttft", type=float, default=0.05, help="the scripted server's TTFT, seconds")
    over.add_argument(
        "--itl", type=float, default=0.02, help="the scripted server's inter-token latency, seconds"
    )
    over.add_argument("--concurrency", type=int, default=16)
    over.add_argument("--num-prompts", type=int, default=128)
    over.add_argument("--output-tokens", type=int, default=64)
    over.add_argument("--policy", default="round-robin", choices=["round-robin", "cache-aware"])
    over.set_defaults(run=overhead)

    online = figures.add_parser("w3", help="W3 through a router in front of one replica")
    online.add_argument("--concurrency", type=int, default=16)
    online.add_argument("--output-tokens", type=int, default=128)
    online.add_argument("--policy", default="cache-aware", choices=["round-robin", "cache-aware"])
    online.set_defaults(run=w3)

    aware = figures.add_parser("cache-aware", help="routing policies over 2 replicas, the prefix dataset")
    aware.add_argument("--num-prefixes", type=int, default=8)
    aware.add_argument("--prefix-len", type=int, default=512)
    aware.add_argument("--suffix-len", type=int, default=64)
    aware.add_argument("--output-tokens", type=int, default=16)
    aware.add_argument("--num-prompts", type=int, default=128)
    aware.add_argument("--concurrency", type=int, default=8)
    aware.add_argument(
        "--num-kv-blocks",
        type=int,
        default=176,
        help="each replica's KV blocks: about 5 of the 8 prefixes fit, so where a prefix goes matters",
    )
    aware.set_defaults(run=cache_aware)

    data_parallel = figures.add_parser("dp", help="W4 online: --data-parallel-size 2 against one replica")
    data_parallel.add_argument(
        "--model", type=Path, default=Path.home() / ".cache" / "sluice" / "models" / "w4-llama-1.1b-random"
    )
    data_parallel.add_argument("--output-tokens", type=int, default=64)
    data_parallel.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB per worker")
    data_parallel.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="a step's token budget on both legs (default: the engine's; the first rounds used 128)",
    )
    data_parallel.set_defaults(run=dp)

    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so that every server started is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="sluice-issue9-") as log_dir:
        args.log_dir = Path(log_dir)
        args.run(args)


if __name__ == "__main__":
    main()
