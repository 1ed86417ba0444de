"""How often a dead engine core may be restarted, and after what backoff."""

from __future__ import annotations

import collections

from sluice.config import EngineRestartConfig


class RestartBudget:
    """When a dead engine core may be restarted: at most max_restarts times within window_s, each
    restart after a backoff that doubles with every earlier restart still inside the window."""

    def __init__(self, config: EngineRestartConfig) -> None:
        assert config.enabled
        self.config = config
        self.restarts: collections.deque[float] = collections.deque()

    def delay(self, now: float) -> float | None:
        """Count a restart decided at `now` and return how long to wait before it; None when the
        budget is spent."""
        while self.restarts and now - self.restarts[0] > self.config.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.config.max_restarts:
            return None
        backoff = self.config.backoff_s * 2 ** len(self.restarts)
        self.restarts.append(now)
        return min(backoff, self.config.backoff_max_s)
