"""What a long stress run says while it runs: lines on stderr, and a progress line every few seconds."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

PROGRESS_INTERVAL_S = 5.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def report_progress(describe: Callable[[], str], interval_s: float = PROGRESS_INTERVAL_S) -> None:
    """Log `describe()` every `interval_s` until cancelled, so a long run shows it is alive."""
    started = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        log(f"[{time.monotonic() - started:6.0f} s] {describe()}")
