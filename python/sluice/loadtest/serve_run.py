"""One measured run at one request rate, summarized under vLLM's key names."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

from sluice.loadtest.client import RequestSpec
from sluice.loadtest.datasets import SampleRequest
from sluice.loadtest.metrics import summarize
from sluice.loadtest.runner import RunPlan, run


@dataclass(slots=True)
class ServeSettings:
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    num_warmups: int = 0
    progress: bool = True
    slos: dict[str, float] = field(default_factory=dict)


def measured_run(
    spec: RequestSpec, samples: list[SampleRequest], settings: ServeSettings, rate: float
) -> dict[str, Any]:
    plan = RunPlan(rate, settings.burstiness, settings.max_concurrency, settings.seed, settings.num_warmups)
    plan.progress = settings.progress
    outcomes, timing = asyncio.run(run(spec, samples, plan))
    result = {
        "base_url": spec.base_url,
        "endpoint": spec.endpoint,
        "model_id": spec.model,
        "num_prompts": len(samples),
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": settings.burstiness,
        "max_concurrency": settings.max_concurrency,
    }
    return result | summarize(outcomes, timing, settings.slos)
