"""When each request is sent: offsets in seconds from the start of the run."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps are gamma-distributed with mean 1/rate; shape = burstiness, so burstiness 1 is Poisson.

    A burstiness below 1 makes arrivals burstier (coefficient of variation 1/sqrt(burstiness)),
    above 1 more even. An infinite rate sends everything at once.
    """
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = np.random.default_rng(seed)
    if burstiness == 1.0:
        gaps = rng.exponential(1.0 / rate, size=count)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    # The first request goes at once; the gaps separate the ones after it.
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
