"""`sluice bench sweep`: the same requests at each rate of a list, one result per rate."""

from __future__ import annotations

import math
import sys
from typing import Any

from sluice.loadtest.client import RequestSpec
from sluice.loadtest.datasets import SampleRequest
from sluice.loadtest.serve_run import ServeSettings, measured_run


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--request-rates: {text!r} is not a comma-separated list of numbers and inf"
        ) from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise ValueError(f"--request-rates: {text!r} needs positive rates (or inf)")
    return rates


def sweep(
    spec: RequestSpec, samples: list[SampleRequest], settings: ServeSettings, rates: list[float]
) -> list[dict[str, Any]]:
    runs = []
    for rate in rates:
        print(f"request rate {rate} req/s", file=sys.stderr)
        runs.append(measured_run(spec, samples, settings, rate))
    return runs
