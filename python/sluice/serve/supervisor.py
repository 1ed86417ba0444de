"""The supervisor's waiting: until a signal arrives, a child exits, or a timeout passes."""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Sequence
from types import FrameType

from sluice.serve.child import Child


class Supervisor:
    """Runs the children, sleeping until a signal arrives or a child exits."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.signals: list[int] = []
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    def install_signal_handlers(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.signals.append(signum)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        signal.set_wakeup_fd(self._wake_write, warn_on_full_buffer=False)

    def wait(self, timeout: float | None, watch: Sequence[Child]) -> None:
        """Return after `timeout`, on a signal, or once one of `watch` has exited.

        A signal caught since the last wait leaves a byte in the wake-up pipe, and an exited child's
        pidfd stays readable, so neither can slip in unseen before select.
        """
        fds = [self._wake_read] + [c.pidfd for c in watch if c.pidfd is not None]
        # Without pidfds (old kernels), a child's exit is noticed within a second.
        if len(fds) <= len(watch):
            timeout = 1.0 if timeout is None else min(timeout, 1.0)
        select.select(fds, [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_read, 512)

    def retire(self, child: Child) -> None:
        """Stop watching `child`, which has exited and been reaped."""
        assert not child.alive()
        self.children.remove(child)
        child.close()

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        for child in self.children:
            child.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
