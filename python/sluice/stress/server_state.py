"""What the stress drivers read from a running `sluice serve` after (and while) they press it: the
metrics of /metrics and the engine gauges among them, the block-pool audit, and the served model."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

GAUGES = {
    "running": "sluice:num_requests_running",
    "waiting": "sluice:num_requests_waiting",
    "kv_cache_usage": "sluice:kv_cache_usage_perc",
}
PREEMPTIONS = "sluice:num_preemptions_total"


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def summed_metrics(text: str) -> dict[str, float]:
    """Every metric of a Prometheus text page (/metrics), summed over its label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


def read_metrics(base_url: str) -> dict[str, float]:
    """Every metric of /metrics, summed over its label sets."""
    return summed_metrics(_get(f"{base_url}/metrics").decode())


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


def served_model(base_url: str) -> str:
    """The one model name the server lists."""
    return json.loads(_get(f"{base_url}/v1/models"))["data"][0]["id"]
