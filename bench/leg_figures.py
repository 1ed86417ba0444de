"""The figures of legs.py's rounds: medians, ratios within a round, the target's verdict, and every run
saved to bench/results/issue9/<figure>.json with a PNG of bar panels beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from harness import BENCH_DIR
from legs import Figures

RESULTS_DIR = BENCH_DIR / "results" / "issue9"


def median_of(runs: list[Figures], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def paired(runs: dict[str, list[Figures]], leg: str, base: str, key: str, ratio: bool) -> float:
    """Median over rounds of leg's figure minus (or over) base's in the same round."""
    pairs = zip(runs[leg], runs[base], strict=True)
    return statistics.median(a[key] / b[key] if ratio else a[key] - b[key] for a, b in pairs)


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
