"""One PNG: each metric's ratio of Sluice to a peer (same run) as a bar, the issue's target as a tick."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness import Target


@dataclass(frozen=True, slots=True)
class RatioBar:
    label: str
    ratio: float
    target: Target | None


def plot_ratios(bars: list[RatioBar], path: Path, title: str, peer: str = "vLLM") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.55 * len(bars) + 1.5))
    rows = range(len(bars))
    colors = [
        "tab:gray" if b.target is None else "tab:green" if b.target.met(b.ratio) else "tab:red" for b in bars
    ]
    ax.barh(rows, [b.ratio for b in bars], color=colors)
    for row, bar in zip(rows, bars):
        ax.text(bar.ratio, row, f" {bar.ratio:.2f}x", va="center")
        if bar.target is not None:
            ax.plot([bar.target.ratio] * 2, [row - 0.4, row + 0.4], color="black", linewidth=2)
    ax.axvline(1.0, color="tab:blue", linestyle=":", linewidth=1)
    labels = [b.label if b.target is None else f"{b.label}\n(target {b.target.describe()})" for b in bars]
    ax.set_yticks(list(rows), labels)
    ax.invert_yaxis()
    ax.set_xlabel(f"Sluice / {peer}; black tick: the target (green: met, red: not met)")
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
