"""Issue 10, item 5, short: a burst of streaming clients, more than the waiting queue holds, against a
real `sluice serve`; each completes or gets a clean 429 with Retry-After, and memory stays bounded.
bench/load_storm.py is the full-size run of sluice/stress/load_storm.py (1,000 clients)."""

from __future__ import annotations

from pathlib import Path

from serve_fixtures import running_server
from sluice.stress import load_storm

CLIENTS = 200
QUEUE_LIMIT = 48
MIB = 1024 * 1024
# "Bounded": during and after the burst, no process holds more than half again its resident memory
# before it (plus 64 MiB for allocator arenas that the first big batch creates).
MAX_GROWTH_RATIO = 1.5
MAX_GROWTH_SLACK_MIB = 64


def test_a_burst_completes_or_gets_clean_429s_and_memory_stays_bounded(tmp_path: Path) -> None:
    args = ["--max-model-len", "512", "--kv-cache-memory", "0.5"]
    args += ["--max-waiting-requests", str(QUEUE_LIMIT)]
    with running_server(args, tmp_path / "serve.log") as server:
        result = load_storm.run_load(server.url, server.process.pid, CLIENTS, max_tokens=8, timeout_s=120)
        assert server.process.poll() is None, server.log_tail()
    assert result["failures"] == {}, result["failures"]
    assert result["completed"] + result["refused_429"] == CLIENTS
    # The queue takes QUEUE_LIMIT at once; the burst is far larger, so both outcomes must occur.
    assert result["completed"] >= QUEUE_LIMIT and result["refused_429"] > 0, result
    assert result["gauges_after"] == {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0}
    assert {"serve", "frontend", "engine_core", "worker_0"} <= result["rss_before_mib"].keys()
    for role, before in result["rss_before_mib"].items():
        bound = before * MAX_GROWTH_RATIO + MAX_GROWTH_SLACK_MIB
        assert result["rss_peak_mib"][role] <= bound, (role, before, result["rss_peak_mib"][role])
        assert result["rss_after_mib"][role] <= bound, (role, before, result["rss_after_mib"][role])
