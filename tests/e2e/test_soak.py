"""Issue 10, item 7, short: 60 s of mixed traffic (both endpoints, streamed and not, sampling
parameters, logprobs, n > 1, stop strings, client aborts, invalid requests) against a real
`sluice serve`: no error that is not the client's, no process growing by 5% after warm-up, the
engine idle with a clean block pool afterwards, and the RSS curve drawn.
bench/soak.py is the full-size run of sluice/stress/soak.py (10 minutes)."""

from __future__ import annotations

from pathlib import Path

from serve_fixtures import running_server
from sluice.stress import soak

DURATION_S = 60.0


def test_a_short_soak_has_only_client_errors_and_flat_memory(tmp_path: Path) -> None:
    args = ["--max-model-len", "512", "--kv-cache-memory", "0.5", "--enable-prefix-caching"]
    png = tmp_path / "soak_rss.png"
    with running_server(args, tmp_path / "serve.log") as server:
        result = soak.run_soak(server.url, server.process.pid, DURATION_S, concurrency=12, seed=7, png=png)
        assert server.process.poll() is None, server.log_tail()
    assert result["server_errors"] == {}, result["first_errors"]
    outcomes = result["outcomes"]
    # Every kind of request happened, and most completed.
    assert outcomes[soak.OK] > 50 and outcomes[soak.ABORTED] > 0 and outcomes[soak.REFUSED_AS_INVALID] > 0
    assert {"serve", "frontend", "engine_core", "worker_0"} <= result["rss_growth"].keys()
    for role, growth in result["rss_growth"].items():
        assert growth["growth"] < soak.MAX_RSS_GROWTH, (role, growth)
    assert result["gauges_after"] == {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0}
    assert result["audit"]["consistent"], result["audit"]["problems"]
    assert png.stat().st_size > 10_000 and png.read_bytes().startswith(b"\x89PNG")
    assert result["ok"]
