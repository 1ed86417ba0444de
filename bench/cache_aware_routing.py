"""Cache-aware routing: 2 replicas of the default model, each on its share of the cores, `sluice bench
serve --dataset prefix` (8 prefixes of 512 tokens, shuffled), through sluice-router and vllm-router,
each cache-aware and round-robin: the replicas' prefix-cache hit rate and TTFT p50 per router and
policy. Writes bench/results/issue9/cache_aware.json and cache_aware.png.

  python bench/cache_aware_routing.py [--runs 3] [--vllm-router-venv DIR] [--lock FILE] [--num-prompts 128]
"""

from __future__ import annotations

import argparse
import subprocess
import urllib.request
from contextlib import ExitStack

from harness import log
from leg_figures import median_of, paired, plot_panels, save, verdict
from legs import SLUICE, Figures, Leg, bench_serve, default_model, main, rounds, router_legs, timed, wait_all
from servers import Server, start_sluice

# The figures.
HIT_RATE_GAIN = 1.8
TTFT_SHARE = 0.6
PREFIX_METRICS = ("sluice:prefix_cache_hits_total", "sluice:prefix_cache_queries_total")


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


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=176,
        help="each replica's KV blocks: about 5 of the 8 prefixes fit, so where a prefix goes matters",
    )


if __name__ == "__main__":
    main(__doc__, add_options, cache_aware)
