"""What every benchmark script here shares: the workloads, the lock, statistics, and child processes.

Standard library only, because the vLLM peer driver imports it too, from vLLM's own venv.
"""

from __future__ import annotations

import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

BENCH_DIR = Path(__file__).resolve().parent
WORKLOADS_DIR = BENCH_DIR / "workloads"
# The lock every engineer's timed runs share (see bench/README.md); an option, never assumed.
LOCK_ENV = "SLUICE_BENCH_LOCK"
# Marks a driver's reply on stdout, where engines also log.
REPLY_PREFIX = "@@bench "
WARMUP_TOKENS = 4
# A function that generates `max_tokens` greedy tokens for each prompt and returns the output lengths.
Generate = Callable[[list[list[int]], int], list[int]]


@dataclass(frozen=True, slots=True)
class Target:
    """Issue 8's figure for one metric, as a ratio of Sluice's value to vLLM's in the same run."""

    metric: str
    ratio: float
    # True: Sluice's value must be at least ratio x vLLM's (throughput); False: at most (times).
    higher_is_better: bool

    def met(self, ratio: float) -> bool:
        return ratio >= self.ratio if self.higher_is_better else ratio <= self.ratio

    def describe(self) -> str:
        return f"{'>=' if self.higher_is_better else '<='} {self.ratio:g}x"


# Each optimisation's off switch, as options of `sluice serve` and sluice_driver.py alike; the
# default Sluice has all of them on.
SWITCHES_OFF = {
    "no async scheduling": ["--no-async-scheduling"],
    "no graph dispatcher": ["--enforce-eager"],
    "in-process executor": ["--executor", "inproc"],
    "late step output": ["--no-early-step-output"],
    "libgomp's spin count": ["--omp-spin-count", "inherit"],
}
# The CPU kernels' off switches: compare_offline.py runs them with --switches, where the offline
# workloads show their gains alone; both benches run them when --switches names them.
KERNEL_SWITCHES_OFF = {
    "no packed linear": ["--no-packed-linear"],
    "no GEMM K blocks": ["--no-gemm-k-blocks"],
    "no fused gate_up": ["--no-fused-gate-up"],
    "no native argmax": ["--no-native-argmax"],
}


def chosen_switches(names: str | None, every: dict[str, list[str]]) -> dict[str, list[str]]:
    """The off switches that --switches names: none (None), `every` ("all"), or a comma-separated
    list of names from SWITCHES_OFF and KERNEL_SWITCHES_OFF."""
    if names is None:
        return {}
    if names == "all":
        return every
    known = {**SWITCHES_OFF, **KERNEL_SWITCHES_OFF}
    chosen = [name.strip() for name in names.split(",")]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise SystemExit(f"unknown switch(es) {unknown}; known: {sorted(known)}")
    return {name: known[name] for name in chosen}


TARGETS = {
    "W1": Target("output tok/s", 1.6, higher_is_better=True),
    "W2": Target("ms per token", 0.65, higher_is_better=False),
    "W3 throughput": Target("output tok/s", 1.3, higher_is_better=True),
    "W3 TTFT p99": Target("TTFT p99", 0.7, higher_is_better=False),
    "W3 TPOT p50": Target("TPOT p50", 0.85, higher_is_better=False),
    "W4": Target("output tok/s", 1.3, higher_is_better=True),
    "W5": Target("ms per token", 0.65, higher_is_better=False),
}
# W5 must also come within 15% of the one-stream read-bandwidth floor.
W5_FLOOR_BOUND = 1.15


@dataclass(frozen=True, slots=True)
class Workload:
    """One offline workload: prompts as token ids, a fixed output length, greedy, ignore_eos."""

    name: str
    prompts: list[list[int]]
    output_tokens: int
    # A single stream is timed per token by the difference method: (T(n) - T(1)) / (n - 1).
    single_stream: bool


def w1_prompts() -> list[list[int]]:
    return json.loads((WORKLOADS_DIR / "w1_prompts.json").read_text())["prompts"]


def w2_prompt() -> list[int]:
    return json.loads((WORKLOADS_DIR / "w2_prompt.json").read_text())["prompt"]


def offline_workload(name: str) -> Workload:
    """W1/W2 run on the default model, W4/W5 on the 1.1B model (bench/README.md)."""
    if name == "W1":
        return Workload(name, w1_prompts(), 128, single_stream=False)
    if name == "W2":
        return Workload(name, [w2_prompt()], 256, single_stream=True)
    if name == "W4":
        return Workload(name, w1_prompts()[:16], 64, single_stream=False)
    if name == "W5":
        return Workload(name, [w2_prompt()], 128, single_stream=True)
    raise ValueError(f"unknown offline workload {name!r}: W1, W2, W4 or W5")


def time_workload(generate: Generate, workload: Workload) -> dict[str, float]:
    """Output tok/s of a batch; ms per token of a single stream, by (T(n) - T(1)) / (n - 1)."""

    def seconds(max_tokens: int) -> float:
        start = time.perf_counter()
        lengths = generate(workload.prompts, max_tokens)
        elapsed = time.perf_counter() - start
        assert lengths == [max_tokens] * len(workload.prompts), f"asked {max_tokens} tokens, got {lengths}"
        return elapsed

    n = workload.output_tokens
    if workload.single_stream:
        first = seconds(1)
        return {"ms_per_token": 1e3 * (seconds(n) - first) / (n - 1), "first_token_ms": 1e3 * first}
    return {"tok_s": len(workload.prompts) * n / seconds(n)}


def run_command(generate: Generate, command: dict[str, Any]) -> dict[str, float]:
    """A driver's answer to one command: {"workload": name} times it, adding "warmup" only warms it.

    A warm-up runs every prompt of the workload for a few tokens, so the batch shapes it will meet
    (and anything compiled or captured for them) are ready before the first timed run.
    """
    workload = offline_workload(command["workload"])
    if command.get("warmup"):
        generate(workload.prompts, WARMUP_TOKENS)
        return {}
    return time_workload(generate, workload)


def make_output_folders(*paths: Path | None) -> None:
    """Creates the folders of the result files named, before a long run rather than at its end."""
    for path in paths:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: the steadiness figure the issue sets a 5% bound on."""
    return (max(values) - min(values)) / statistics.median(values)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@contextmanager
def bench_lock(path: str | None, exclusive: bool) -> Iterator[None]:
    """Hold the shared benchmark lock: exclusive while timing, shared while loading; no path, no lock."""
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (everything but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def busy_share(window_s: float) -> float:
    """The share of all cores that was busy over the next `window_s` seconds."""
    before = machine_busy_seconds()
    time.sleep(window_s)
    return (machine_busy_seconds() - before) / (window_s * (os.cpu_count() or 1))


# A leg starts once the machine's busy share stays below QUIET_SHARE for QUIET_WINDOWS windows in a row.
QUIET_SHARE = 0.1
QUIET_WINDOW_S = 0.1
QUIET_WINDOWS = 3
QUIET_TIMEOUT_S = 15.0


def wait_until_quiet() -> None:
    """Wait until the cores are idle, at most QUIET_TIMEOUT_S.

    vLLM's CPU engine keeps one core busy for about a second after its last request has been
    answered. Without this wait, the leg timed right after it ran its first prefill on one core."""
    deadline = time.monotonic() + QUIET_TIMEOUT_S
    quiet = 0
    while quiet < QUIET_WINDOWS and time.monotonic() < deadline:
        quiet = quiet + 1 if busy_share(QUIET_WINDOW_S) < QUIET_SHARE else 0
    if quiet < QUIET_WINDOWS:
        log(f"the machine was still busy after {QUIET_TIMEOUT_S:.0f} s; timing anyway")


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and all its live descendants."""
    ticks = 0
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    todo = [pid]
    while todo:
        current = todo.pop()
        if current in stats:
            # utime and stime are stat fields 14 and 15; fields[0] here is field 3.
            ticks += int(stats[current][11]) + int(stats[current][12])
        todo.extend(children.get(current, []))
    return ticks / os.sysconf("SC_CLK_TCK")


class JsonLineChild:
    """A long-lived child that answers one reply line on stdout for each JSON command line on stdin."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.process = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1
        )

    def _stdout(self) -> TextIO:
        assert self.process.stdout is not None
        return self.process.stdout

    def read_reply(self) -> dict[str, Any]:
        """The next reply; other stdout lines (an engine's logging) go to stderr."""
        for line in self._stdout():
            if line.startswith(REPLY_PREFIX):
                return json.loads(line[len(REPLY_PREFIX) :])
            log(f"[{self.name}] {line.rstrip()}")
        raise RuntimeError(f"{self.name} exited with {self.process.wait()} before replying")

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.read_reply()

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def serve_json_lines(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The child's side of JsonLineChild: call handle(command) per stdin line and print its reply."""
    print(REPLY_PREFIX + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(REPLY_PREFIX + json.dumps(handle(json.loads(line))), flush=True)
