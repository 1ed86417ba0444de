"""A burst of concurrent streaming clients against one running `sluice serve` (issue 10, item 5).

Every request must complete or get a clean 429 with Retry-After: no reset, no 5xx, no hang (a
request still open after `timeout_s` is a failure). The RSS of every process of the server is
taken before (after a small warm-up), sampled during, and taken after the burst once the engine is
idle. bench/load_storm.py runs it full-size, tests/e2e/test_load_storm.py short.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import aiohttp

from sluice.loadtest.client import RequestOutcome, RequestSpec, send_request
from sluice.loadtest.datasets import SampleRequest
from sluice.loadtest.options import COMPLETIONS_ENDPOINT
from sluice.stress.process_rss import RssSampler, log_rss, mib, snapshot
from sluice.stress.progress import log, report_progress
from sluice.stress.server_state import served_model, wait_until_idle

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
COMPLETED = "completed"
REFUSED = "429 with Retry-After"
WARMUP_REQUESTS = 8


def classify(outcome: RequestOutcome) -> str:
    """completed, a clean 429, or what went wrong."""
    if outcome.success:
        return COMPLETED
    if outcome.reason == "HTTP 429":
        return REFUSED if (outcome.retry_after or "").strip().isdigit() else "429 without Retry-After"
    return outcome.reason


async def burst(spec: RequestSpec, clients: int, max_tokens: int, timeout_s: float) -> Counter[str]:
    """`clients` streams opened at once, each on its own connection; their outcomes by class."""
    sample = SampleRequest(PROMPT, 0, max_tokens)
    outcomes: Counter[str] = Counter()
    errors: dict[str, str] = {}
    # No connection limit and no reuse: each client is a connection of its own, as 1,000 users are.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    go = asyncio.Event()

    async def one(session: aiohttp.ClientSession) -> None:
        await go.wait()
        outcome = await send_request(session, spec, sample)
        kind = classify(outcome)
        outcomes[kind] += 1
        if kind not in (COMPLETED, REFUSED):
            errors.setdefault(kind, outcome.error)

    def describe() -> str:
        return f"{outcomes.total()}/{clients} done: " + ", ".join(f"{k} {v}" for k, v in outcomes.items())

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(one(session)) for _ in range(clients)]
        progress = asyncio.create_task(report_progress(describe))
        go.set()
        await asyncio.gather(*tasks)
        progress.cancel()
    for kind, error in errors.items():
        log(f"first {kind}: {error}")
    return outcomes


def run_load(base_url: str, root_pid: int, clients: int, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    """The burst against a running server; the figures, with `ok` true when nothing else happened."""
    spec = RequestSpec(base_url, COMPLETIONS_ENDPOINT, served_model(base_url), {}, ignore_eos=True)
    warm = asyncio.run(burst(spec, WARMUP_REQUESTS, max_tokens, timeout_s))
    assert warm[COMPLETED] == WARMUP_REQUESTS, f"the warm-up failed: {dict(warm)}"
    before = snapshot(root_pid)
    log_rss("before", before)
    sampler = RssSampler(root_pid, interval_s=0.5)
    started = time.monotonic()
    with sampler.running():
        outcomes = asyncio.run(burst(spec, clients, max_tokens, timeout_s))
        duration = time.monotonic() - started
        gauges = wait_until_idle(base_url)
    after = snapshot(root_pid)
    log_rss("after", after)
    log_rss("peak", sampler.peak())
    failures = {kind: count for kind, count in outcomes.items() if kind not in (COMPLETED, REFUSED)}
    result = {
        "clients": clients,
        "max_tokens": max_tokens,
        "completed": outcomes[COMPLETED],
        "refused_429": outcomes[REFUSED],
        "failures": failures,
        "burst_seconds": round(duration, 1),
        "gauges_after": gauges,
        "rss_before_mib": mib(before),
        "rss_after_mib": mib(after),
        "rss_peak_mib": mib(sampler.peak()),
        "rss": sampler.to_json(),
        "ok": not failures and outcomes.total() == clients,
    }
    log(
        f"{clients} clients: {result['completed']} completed, {result['refused_429']} refused (429), "
        f"failures {failures or 'none'}, {duration:.0f} s"
    )
    return result
