"""A run: requests sent on their arrival schedule, at most max_concurrency in flight, all timed."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from sluice.loadtest.arrivals import arrival_offsets
from sluice.loadtest.client import RequestOutcome, RequestSpec, send_request
from sluice.loadtest.datasets import SampleRequest
from sluice.loadtest.metrics import RunTiming

# vLLM's harness allows a request six hours; a long run should not die of a client-side timeout.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass(slots=True)
class RunPlan:
    request_rate: float
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    num_warmups: int = 0
    progress: bool = True


class _InFlight:
    """Counts requests between send and end; remembers the most at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            yield
        finally:
            self.now -= 1


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _session(max_concurrency: int | None) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, ttl_dns_cache=300, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT)


async def _warm_up(
    session: aiohttp.ClientSession, spec: RequestSpec, samples: list[SampleRequest], plan: RunPlan
) -> None:
    limit = asyncio.Semaphore(plan.max_concurrency or plan.num_warmups)

    async def one(sample: SampleRequest) -> RequestOutcome:
        async with limit:
            return await send_request(session, spec, sample)

    warm = [samples[i % len(samples)] for i in range(plan.num_warmups)]
    outcomes = await asyncio.gather(*(one(s) for s in warm))
    failed = [o for o in outcomes if not o.success]
    if failed:
        print(
            f"warning: {len(failed)} of {len(outcomes)} warm-up requests failed: {failed[0].error}",
            file=sys.stderr,
        )


async def run(
    spec: RequestSpec, samples: list[SampleRequest], plan: RunPlan
) -> tuple[list[RequestOutcome], RunTiming]:
    offsets = arrival_offsets(len(samples), plan.request_rate, plan.burstiness, plan.seed)
    limit = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    in_flight = _InFlight()
    failures: Counter[str] = Counter()
    bar = tqdm(total=len(samples), disable=not plan.progress, file=sys.stderr, unit="req", dynamic_ncols=True)

    async def one(sample: SampleRequest) -> RequestOutcome:
        async with limit if limit is not None else contextlib.nullcontext():
            with in_flight.one():
                outcome = await send_request(session, spec, sample)
        if not outcome.success:
            failures[outcome.reason] += 1
            bar.set_postfix(failed=failures.total(), refresh=False)
        bar.update(1)
        return outcome

    async with _session(plan.max_concurrency) as session:
        if plan.num_warmups:
            await _warm_up(session, spec, samples, plan)
        cpu_before = _cpu_seconds()
        started_at = time.perf_counter()
        tasks: list[asyncio.Task[RequestOutcome]] = []
        for sample, offset in zip(samples, offsets, strict=True):
            delay = started_at + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(sample)))
        outcomes = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - started_at
        cpu = _cpu_seconds() - cpu_before
    bar.close()
    return outcomes, RunTiming(started_at, duration, in_flight.peak, cpu)
