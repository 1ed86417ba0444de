"""One supervised child process: started in its own process group, its output passed on, stopped."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

_TAIL_LINES = 30
_PR_SET_PDEATHSIG = 1
# How long a child gets after SIGTERM before SIGKILL when it is stopped on the way out (the frontend's
# drain on a signal is not capped).
STOP_TIMEOUT_S = 15.0


def _die_with_parent(cores: Sequence[int] | None) -> None:
    """In the child, before exec: its own process group, SIGTERM when `sluice serve` dies, and its
    cores (None: this process's)."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if cores is not None:
        os.sched_setaffinity(0, cores)


@dataclass
class Child:
    """A supervised process whose output is passed to our stderr, its last lines kept."""

    name: str
    process: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))
    pidfd: int | None = None
    forwarder: threading.Thread | None = None

    @classmethod
    def start(
        cls, name: str, argv: Sequence[str], env: dict[str, str], cores: Sequence[int] | None = None
    ) -> Child:
        process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Only setpgid, prctl and sched_setaffinity run in the child before exec: no lock another
            # thread could hold.
            preexec_fn=functools.partial(_die_with_parent, cores),  # noqa: PLW1509
        )
        child = cls(name, process)
        with contextlib.suppress(OSError, AttributeError):
            child.pidfd = os.pidfd_open(process.pid)
        return child

    def forward_output(self) -> None:
        self.forwarder = threading.Thread(target=self._forward, name=f"{self.name} output", daemon=True)
        self.forwarder.start()

    def _forward(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode(errors="replace")
            self.tail.append(line)
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(line)
                sys.stderr.flush()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float | None) -> int:
        """SIGTERM, wait `timeout` seconds (None: forever), then SIGKILL; returns the exit status."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                print(
                    f"sluice serve: the {self.name} did not stop in {timeout:.0f} s: killing it",
                    file=sys.stderr,
                )
                self.kill()
        return self.process.wait()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def describe_exit(self) -> str:
        status = self.process.wait()
        if self.forwarder is not None:
            self.forwarder.join(timeout=1.0)
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        tail = "".join(self.tail).rstrip()
        return f"the {self.name} {how}" + (f"; its last output:\n{tail}" if tail else "")

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
