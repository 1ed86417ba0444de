"""A run's outcomes turned into vLLM-named figures: latency statistics, throughput, goodput, failures."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.loadtest.client import RequestOutcome

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
STATISTICS = ("mean", "median", "p90", "p99", "std")


@dataclass(slots=True)
class RunTiming:
    started_at: float  # perf_counter at the first send
    duration: float  # seconds from the first send to the last request's end
    peak_concurrency: int
    cpu_seconds: float  # the harness's own user + system CPU during the run


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`ttft:MS tpot:MS e2el:MS` (any subset) to {metric: milliseconds}."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput: unknown metric {name!r}; use {', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} is not NAME:MILLISECONDS") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput: {item!r} is negative")
    return slos


def meets_slos(outcome: RequestOutcome, slos: dict[str, float]) -> bool:
    measured = {"ttft": outcome.ttft, "tpot": outcome.tpot, "e2el": outcome.e2el}
    return outcome.success and all(measured[name] * 1000 <= limit for name, limit in slos.items())


def _statistics(prefix: str, values_ms: list[float]) -> dict[str, float]:
    values = np.asarray(values_ms or [0.0], dtype=np.float64)
    return {
        f"mean_{prefix}_ms": float(values.mean()),
        f"median_{prefix}_ms": float(np.median(values)),
        f"p90_{prefix}_ms": float(np.percentile(values, 90)),
        f"p99_{prefix}_ms": float(np.percentile(values, 99)),
        f"std_{prefix}_ms": float(values.std()),
    }


def summarize(outcomes: list[RequestOutcome], timing: RunTiming, slos: dict[str, float]) -> dict[str, Any]:
    done = [o for o in outcomes if o.success]
    duration = max(timing.duration, 1e-9)
    output_tokens = sum(o.output_tokens for o in done)
    input_tokens = sum(o.prompt_len for o in done)
    good = sum(meets_slos(o, slos) for o in done) if slos else len(done)
    result: dict[str, Any] = {
        "duration": timing.duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if slos else None,
        "goodput_slos_ms": slos,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_concurrency_reached": timing.peak_concurrency,
        "failures_by_reason": dict(Counter(o.reason for o in outcomes if not o.success)),
        "requests_without_usage": sum(not o.usage_reported for o in done),
        "harness_cpu_seconds": timing.cpu_seconds,
        "harness_cpu_percent": 100.0 * timing.cpu_seconds / duration,
    }
    result |= _statistics("ttft", [o.ttft * 1000 for o in done])
    result |= _statistics("tpot", [o.tpot * 1000 for o in done if o.output_tokens > 1])
    result |= _statistics("itl", [itl * 1000 for o in done for itl in o.itls])
    result |= _statistics("e2el", [o.e2el * 1000 for o in done])
    result |= {
        "input_lens": [o.prompt_len for o in outcomes],
        "output_lens": [o.output_tokens for o in outcomes],
        "ttfts": [o.ttft for o in outcomes],
        "itls": [o.itls for o in outcomes],
        "e2els": [o.e2el for o in outcomes],
        "start_times": [o.start - timing.started_at for o in outcomes],
        "errors": [o.error for o in outcomes],
    }
    return result
