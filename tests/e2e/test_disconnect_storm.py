"""Issue 10, item 6, short: requests whose clients leave at random points (mid-request, before the
first byte, mid-stream, non-streamed) against a real `sluice serve` with prefix caching on; then
nothing runs or waits, KV usage is exactly 0 and the block-pool audit finds every block free.
bench/disconnect_storm.py is the full-size run of sluice/stress/disconnect_storm.py (1,000 streams)."""

from __future__ import annotations

from pathlib import Path

from serve_fixtures import running_server
from sluice.stress import disconnect_storm

STREAMS = 250


def test_a_disconnect_storm_leaves_no_request_and_no_block_behind(tmp_path: Path) -> None:
    # A KV pool of about 1,800 tokens: the storm overfills it, so requests are preempted and resumed
    # while their clients leave.
    args = ["--max-model-len", "512", "--kv-cache-memory", "0.04", "--enable-prefix-caching"]
    with running_server(args, tmp_path / "serve.log") as server:
        result = disconnect_storm.run_disconnects(server.url, STREAMS, concurrency=64, seed=10)
        assert server.process.poll() is None, server.log_tail()
    assert set(result["modes"]) == set(disconnect_storm.MODES), result["modes"]
    assert result["outcomes"] == {
        "left": STREAMS - result["modes"]["complete"],
        "completed": result["modes"]["complete"],
    }
    assert result["gauges_after"] == {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0}
    audit = result["audit"]
    assert audit["consistent"], audit["problems"]
    assert audit["num_held_blocks"] == 0 and audit["num_free_blocks"] == audit["num_blocks"] > 0
    assert audit["num_live_requests"] == 0 and audit["num_holding_requests"] == 0
    # Prefix caching was on, so the audit had cached blocks to check.
    assert audit["num_cached_blocks"] > 0
    assert result["served_after"]
    assert result["preemptions"] > 0
