"""What the load, disconnect and soak scripts check on a running `sluice serve` after (and while) they
press it: the engine gauges of /metrics, the block-pool audit, and a progress line every few seconds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harness import log
from servers import Server, start_sluice

GAUGES = {
    "running": "sluice:num_requests_running",
    "waiting": "sluice:num_requests_waiting",
    "kv_cache_usage": "sluice:kv_cache_usage_perc",
}
PREEMPTIONS = "sluice:num_preemptions_total"
PROGRESS_INTERVAL_S = 5.0


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def read_metrics(base_url: str) -> dict[str, float]:
    """Every metric of /metrics, summed over its label sets."""
    values: dict[str, float] = {}
    for line in _get(f"{base_url}/metrics").decode().splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


def engine_gauges(base_url: str) -> dict[str, float]:
    """Requests running and waiting in the engine core, and its KV cache usage, from /metrics."""
    values = read_metrics(base_url)
    return {key: values[name] for key, name in GAUGES.items()}


def wait_until_idle(base_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """The gauges once nothing runs or waits and no KV block is used, or as they are at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = engine_gauges(base_url)
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


def block_pool_audit(base_url: str) -> dict[str, Any]:
    """The engine core's audit of its KV block pool (GET /sluice/block_pool_audit)."""
    return json.loads(_get(f"{base_url}/sluice/block_pool_audit"))


async def report_progress(describe: Callable[[], str], interval_s: float = PROGRESS_INTERVAL_S) -> None:
    """Log `describe()` every `interval_s` until cancelled, so a long run shows it is alive."""
    started = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        log(f"[{time.monotonic() - started:6.0f} s] {describe()}")


def served_model(base_url: str) -> str:
    """The one model name the server lists."""
    return json.loads(_get(f"{base_url}/v1/models"))["data"][0]["id"]


@contextlib.contextmanager
def started_sluice(name: str, extra_args: list[str], log_dir: Path) -> Iterator[Server]:
    """The default model's `sluice serve` (bench/servers.py's settings plus `extra_args`), ready, and
    stopped with everything it started when the block ends."""
    server = start_sluice(name, None, extra_args, log_dir)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {path}")
