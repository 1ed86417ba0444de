"""The resident memory of every process of a `sluice serve` tree, named by role, sampled over time.

Roles come from each process's command line: `serve` (the supervisor), `router`, `frontend`,
`engine_core`, `worker_0`... A process that appears later (a restarted engine core) joins the
samples from its first sighting on; one that exits keeps its samples.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.stress.progress import log

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIB = 1024 * 1024


def _tree(root: int) -> list[int]:
    """`root` and every live process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = [root], [root]
    while frontier:
        frontier = [child for pid in frontier for child in children.get(pid, [])]
        found += frontier
    return found


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def rss_bytes(pid: int) -> int | None:
    """Resident set size of `pid`, or None once it is gone."""
    try:
        return int((Path("/proc") / str(pid) / "statm").read_text().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


def process_roles(root: int) -> dict[str, int]:
    """{role: pid} for the tree under `root` (the `sluice serve` process)."""
    roles: dict[str, int] = {}
    for pid in _tree(root):
        line = _cmdline(pid)
        if "sluice-frontend" in line:
            role = "frontend"
        elif "sluice-router" in line:
            role = "router"
        elif "engine.engine_core_server" in line:
            role = "engine_core"
        elif "worker.worker_process" in line:
            role = "worker"
        elif pid == root:
            role = "serve"
        else:
            # A helper (a resource tracker, a compiler) is not one of the server's processes.
            continue
        # Workers are numbered from 0; a second frontend or engine core (data parallelism) from 1.
        if role == "worker" or role in roles:
            same = sum(1 for name in roles if name == role or name.startswith(role + "_"))
            role = f"{role}_{same}"
        roles[role] = pid
    return roles


def snapshot(root: int) -> dict[str, int]:
    """{role: RSS bytes} now."""
    values = {role: rss_bytes(pid) for role, pid in process_roles(root).items()}
    return {role: value for role, value in values.items() if value is not None}


@dataclass
class RssSampler:
    """Samples every role's RSS every `interval_s` on a thread, until stopped."""

    root: int
    interval_s: float = 1.0
    started: float = field(default_factory=time.monotonic)
    # role -> [(seconds since start, RSS bytes)]
    series: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> dict[str, int]:
        now = time.monotonic() - self.started
        values = snapshot(self.root)
        for role, value in values.items():
            self.series.setdefault(role, []).append((now, value))
        return values

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    @contextlib.contextmanager
    def running(self) -> Iterator[RssSampler]:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
            self.sample()

    def peak(self) -> dict[str, int]:
        return {role: max(value for _, value in points) for role, points in self.series.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "interval_s": self.interval_s,
            "series": {
                role: [[round(t, 2), value] for t, value in points] for role, points in self.series.items()
            },
        }


def mib(values: dict[str, int]) -> dict[str, float]:
    return {role: round(value / MIB, 1) for role, value in values.items()}


def log_rss(label: str, values: dict[str, int]) -> None:
    log(f"RSS {label}: " + ", ".join(f"{role} {value:.1f} MiB" for role, value in mib(values).items()))


def window_median(points: list[tuple[float, int]], start_s: float, end_s: float) -> int | None:
    inside = sorted(value for t, value in points if start_s <= t <= end_s)
    return inside[len(inside) // 2] if inside else None


def rss_growth(sampler: RssSampler, warmup_s: float, window_s: float) -> dict[str, dict[str, float]]:
    """Per role: the median RSS of the window just after warm-up, of the last window, their ratio - 1,
    and the largest sample after warm-up over the first median, minus 1."""
    growth = {}
    for role, points in sampler.series.items():
        end = points[-1][0]
        baseline = window_median(points, warmup_s, warmup_s + window_s)
        final = window_median(points, end - window_s, end)
        if baseline is None or final is None:
            continue
        peak = max(value for t, value in points if t >= warmup_s)
        growth[role] = {
            "after_warmup_mib": round(baseline / MIB, 1),
            "final_mib": round(final / MIB, 1),
            "growth": round(final / baseline - 1, 4),
            "peak_growth": round(peak / baseline - 1, 4),
        }
    return growth


def plot_rss(sampler: RssSampler, warmup_s: float, window_s: float, path: Path, title: str) -> None:
    """A PNG of every role's RSS over time (top, MiB) and of its change from the median of the window
    after warm-up (bottom, %, with the 5% bound), warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (absolute, relative) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    for role, points in sorted(sampler.series.items()):
        times = [t for t, _ in points]
        (line,) = absolute.plot(times, [value / MIB for _, value in points], label=role)
        baseline = window_median(points, warmup_s, warmup_s + window_s)
        if baseline:
            changes = [100 * (value / baseline - 1) for _, value in points]
            relative.plot(times, changes, label=role, color=line.get_color())
    for axes in (absolute, relative):
        axes.axvspan(0, warmup_s, color="0.9")
        axes.grid(True, which="both", alpha=0.3)
    relative.axhline(5.0, color="red", linestyle="--", label="+5% bound")
    absolute.set_yscale("log")
    absolute.set_ylabel("RSS (MiB)")
    absolute.set_title(title + " (warm-up shaded)")
    absolute.legend(loc="best")
    relative.set_ylabel("change from after warm-up (%)")
    relative.set_xlabel("seconds")
    relative.legend(loc="best")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
