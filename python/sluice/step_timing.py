"""Where a step's time goes: wall time per phase of the step loop, summed, when SLUICE_STEP_TIMING=1.

The engine core times scheduling, folding outputs back, and waiting for the workers; a worker times
input preparation, the forward pass, sampling, and sending its output. Each process prints its
totals as one JSON line on stderr when it exits (bench/step_breakdown.py reads them). Off, a
phase costs one attribute test. On a GPU the phases are host time, not device time.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections import defaultdict

ENABLED = os.environ.get("SLUICE_STEP_TIMING") == "1"
REPORT_PREFIX = "sluice step timing: "


class PhaseTimes:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.enabled = ENABLED
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.steps = 0
        self.reported = False
        if self.enabled:
            atexit.register(self.report)

    def start(self) -> float:
        return time.perf_counter() if self.enabled else 0.0

    def lap(self, phase: str, since: float) -> float:
        """Add the time since `since` to `phase`; returns now, the start of the next phase."""
        if not self.enabled:
            return 0.0
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now

    def count_step(self) -> None:
        self.steps += 1

    def report(self) -> None:
        """Print the totals once; a process that leaves with os._exit (a worker) calls this itself."""
        if not self.enabled or self.reported:
            return
        self.reported = True
        totals = {phase: round(seconds, 6) for phase, seconds in self.seconds.items()}
        line = json.dumps({"owner": self.owner, "pid": os.getpid(), "steps": self.steps, "seconds": totals})
        print(REPORT_PREFIX + line, file=sys.stderr, flush=True)
