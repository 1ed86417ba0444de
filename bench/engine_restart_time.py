"""Engine restart time: SIGKILL a `sluice serve` replica's engine core, and time until /health answers
200 again (the restarted engine core loaded and the frontend reconnected). Prints each run and the
median.

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/engine_restart_time.py [--runs 3] [-- SERVE ARGS]

The server is the default model with its default options unless SERVE ARGS say otherwise. Its
restart window is 1 s, so that every run is a first restart (within a 300 s window, each further
restart would wait twice as long as the one before); the time includes that first backoff
(EngineRestartConfig.backoff_s, 0.5 s), since a client sees it too.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from servers import Server, health_status, start_sluice

POLL_S = 0.01
RESTART_TIMEOUT_S = 300.0


def engine_core_pid(server: Server) -> int:
    """The engine core: the child of `sluice serve` that runs engine.engine_core_server."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == server.process.pid and b"engine.engine_core_server" in command:
            found.append(int(entry.name))
    (pid,) = found
    return pid


def wait_for(server: Server, status: int, since: float) -> float:
    """Seconds from `since` until /health answers `status`."""
    while time.monotonic() - since < RESTART_TIMEOUT_S:
        if health_status(server.url) == status:
            return time.monotonic() - since
        if server.process.poll() is not None:
            raise RuntimeError(
                f"sluice serve exited with {server.process.returncode}; log: {server.log_path}"
            )
        time.sleep(POLL_S)
    raise TimeoutError(f"/health never answered {status}; log: {server.log_path}")


def restart_seconds(server: Server) -> float:
    """One kill, timed to /health 200; the engine must first be seen unhealthy."""
    victim = engine_core_pid(server)
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    wait_for(server, 503, killed)
    return wait_for(server, 200, killed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("serve_args", nargs="*", help="extra `sluice serve` options (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-restart-bench-") as log_dir:
        serve_args = ["--engine-restart-window-s", "1", *args.serve_args]
        server = start_sluice("restart", None, serve_args, Path(log_dir))
        try:
            server.wait_ready()
            times = [restart_seconds(server) for _ in range(args.runs)]
        finally:
            server.stop()
    for index, seconds in enumerate(times, 1):
        print(f"run {index}: kill -9 of the engine core to /health 200 in {seconds:.2f} s")
    print(
        f"engine restart time (kill -9 to /health 200): median {statistics.median(times):.2f} s of {len(times)}"
    )


if __name__ == "__main__":
    main()
