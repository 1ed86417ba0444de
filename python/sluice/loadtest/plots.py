"""PNGs: one run's latency CDFs and throughput over time; a sweep's throughput-latency curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _token_times(result: dict[str, Any]) -> tuple[list[float], list[float]]:
    """When each successful request's chunks arrived (s since start), and the tokens each carried.

    A request's `usage` count is spread evenly over its chunks, since a chunk may hold several tokens.
    """
    times, weights = [], []
    rows = zip(
        result["start_times"],
        result["ttfts"],
        result["itls"],
        result["output_lens"],
        result["errors"],
        strict=True,
    )
    for start, ttft, itls, tokens, error in rows:
        if error:
            continue
        arrivals = np.cumsum([start + ttft, *itls]).tolist()
        times += arrivals
        weights += [tokens / len(arrivals)] * len(arrivals)
    return times, weights


def plot_run(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    ok = [not e for e in result["errors"]]
    series = {
        "TTFT": [t * 1000 for t, good in zip(result["ttfts"], ok, strict=True) if good],
        "ITL": [i * 1000 for itls, good in zip(result["itls"], ok, strict=True) if good for i in itls],
        "E2EL": [t * 1000 for t, good in zip(result["e2els"], ok, strict=True) if good],
        "TPOT": [
            (e2el - ttft) * 1000 / (n - 1)
            for e2el, ttft, n, good in zip(
                result["e2els"], result["ttfts"], result["output_lens"], ok, strict=True
            )
            if good and n > 1
        ],
    }
    figure, axes = plt.subplots(1, 5, figsize=(22, 4))
    for ax, (name, values) in zip(axes, series.items(), strict=False):
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        if values:
            ordered = np.sort(values)
            ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered))
        ax.grid(alpha=0.3)
    times, weights = _token_times(result)
    ax = axes[4]
    ax.set_title("Output throughput")
    ax.set_xlabel("s since start")
    ax.set_ylabel("tok/s")
    if times:
        width = max(result["duration"] / 50, 0.05)
        counts, edges = np.histogram(times, bins=np.arange(0.0, max(times) + width, width), weights=weights)
        ax.plot(edges[:-1], counts / width)
    ax.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=80)
    plt.close(figure)


def plot_sweep(runs: list[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    throughput = [r["output_throughput"] for r in runs]
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        latency = [r[f"p99_{metric}_ms"] for r in runs]
        ax.plot(throughput, latency, marker="o")
        for r, x, y in zip(runs, throughput, latency, strict=True):
            ax.annotate(f"{r['request_rate']} req/s", (x, y), fontsize=8)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"p99 {metric.upper()} (ms)")
        ax.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=80)
    plt.close(figure)
