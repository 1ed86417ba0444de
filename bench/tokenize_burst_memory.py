"""The frontend's memory through a burst of large /tokenize requests: its RSS before, at its peak, and
a few seconds after the burst (issue 10: 24 concurrent 4 MB requests took it from 40 MB to 1.2 GB,
and it stayed near 1 GB).

    python bench/tokenize_burst_memory.py --requests 24 --megabytes 4 --runs 3

Compares, in one run, the default with each memory measure turned off: texts encoded whole
(--tokenize-piece-bytes 0) and glibc's adaptive thresholds (SLUICE_MALLOC_ADAPTIVE=1). Prints each
burst as it ends, then the medians. SLUICE_FRONTEND picks the frontend binary.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from servers import start_sluice

PAGE_KIB = 4


def rss_mib(pid: int) -> float:
    """Resident set size from /proc/PID/statm, in MiB."""
    resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return resident_pages * PAGE_KIB / 1024


def frontend_pid(serve_pid: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and b"sluice-frontend" in (entry / "cmdline").read_bytes():
            status = (entry / "status").read_text()
            parent = int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1])
            if parent == serve_pid:
                return int(entry.name)
    raise RuntimeError("no sluice-frontend under sluice serve")


def prompt_text(megabytes: float, seed: int) -> str:
    """Varied words (not one repeated), so the tokenizer does its ordinary work on every byte."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]
    size = int(megabytes * 1024 * 1024)
    parts, length = [], 0
    while length < size:
        word = rng.choice(words)
        parts.append(word)
        length += len(word) + 1
    return " ".join(parts)[:size]


def tokenize(port: int, body: bytes, statuses: list[int]) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/tokenize", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        statuses.append(response.status)
    finally:
        connection.close()


# The configurations compared, each with the frontend arguments and environment it adds: the
# default; texts encoded whole (--tokenize-piece-bytes 0); glibc's adaptive thresholds; and both off.
CONFIGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "default": ([], {}),
    "whole texts": (["--tokenize-piece-bytes", "0"], {}),
    "adaptive malloc": ([], {"SLUICE_MALLOC_ADAPTIVE": "1"}),
    "both off": (["--tokenize-piece-bytes", "0"], {"SLUICE_MALLOC_ADAPTIVE": "1"}),
}


def one_burst(args: argparse.Namespace, frontend_args: list[str], env: dict[str, str]) -> dict:
    """One server, one burst: its statuses and the frontend's RSS before, at the peak and after."""
    log_dir = Path(tempfile.mkdtemp(prefix="sluice-tokenize-burst-"))
    extra = ["--max-body-bytes", str(int(args.megabytes * 1024 * 1024) + 4096), *frontend_args]
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        server = start_sluice("tokenize burst", None, extra, log_dir)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    try:
        server.wait_ready()
        pid = frontend_pid(server.process.pid)
        time.sleep(1.0)
        before = rss_mib(pid)
        bodies = [json.dumps({"prompt": prompt_text(args.megabytes, seed)}).encode() for seed in range(4)]
        statuses: list[int] = []
        threads = [
            threading.Thread(target=tokenize, args=(server.port, bodies[i % len(bodies)], statuses))
            for i in range(args.requests)
        ]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        peak = before
        while any(thread.is_alive() for thread in threads):
            peak = max(peak, rss_mib(pid))
            time.sleep(0.05)
        took = time.monotonic() - started
        time.sleep(args.settle_s)
        after = rss_mib(pid)
    finally:
        server.stop()
    return {
        "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "burst_s": round(took, 1),
        "rss_mib": {"before": round(before, 1), "peak": round(peak, 1), "after": round(after, 1)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--megabytes", type=float, default=4.0)
    parser.add_argument("--settle-s", type=float, default=3.0, help="idle time before the 'after' reading")
    parser.add_argument("--runs", type=int, default=3, help="bursts per configuration (medians are printed)")
    parser.add_argument("--config", action="append", choices=list(CONFIGS), help="compare only these")
    args = parser.parse_args()

    names = args.config or list(CONFIGS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    # Interleaved, so that a machine that changes speed during the run touches every configuration.
    for run in range(args.runs):
        for name in names:
            result = one_burst(args, *CONFIGS[name])
            runs[name].append(result)
            print(f"run {run + 1}/{args.runs} {name}: {json.dumps(result)}", file=sys.stderr, flush=True)
    summary = {
        "requests": args.requests,
        "megabytes": args.megabytes,
        "runs": args.runs,
        "median": {
            name: {
                "burst_s": statistics.median(r["burst_s"] for r in results),
                "rss_mib": {
                    key: statistics.median(r["rss_mib"][key] for r in results)
                    for key in ("before", "peak", "after")
                },
                "all_200": all(r["statuses"] == {"200": args.requests} for r in results),
            }
            for name, results in runs.items()
        },
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
