"""Time from `docker run` of the CPU image to /health 200 (issue 26's target: 20 s or less), and to the
state Docker's own HEALTHCHECK reports healthy. Each run starts a fresh container of the image (the
default model, its default options), so nothing a previous start made is reused. Prints each run and the
medians.

    python bench/container_start.py [--image sluice:cpu] [--runs 3] [-- DOCKER RUN ARGS]

Needs a Docker daemon that answers and the image built (deploy/check builds it: `docker build -f
deploy/Dockerfile -t sluice:cpu .`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from harness import log
from servers import free_port, health_status

POLL_S = 0.05
START_TIMEOUT_S = 300.0


def docker_health(container: str) -> str:
    inspected = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Health.Status}} {{.State.Running}}", container],
        check=False,
        capture_output=True,
        text=True,
    )
    return inspected.stdout.strip()


def one_start(image: str, run_args: list[str]) -> tuple[float, float]:
    """Seconds from `docker run` to /health 200, and to Docker's `healthy`."""
    port = free_port()
    started = time.monotonic()
    container = subprocess.run(
        ["docker", "run", "-d", "--rm", "-p", f"127.0.0.1:{port}:8000", *run_args, image],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        to_health = to_healthy = None
        while to_healthy is None:
            elapsed = time.monotonic() - started
            if elapsed > START_TIMEOUT_S:
                raise TimeoutError(f"not healthy after {START_TIMEOUT_S:.0f} s: {docker_health(container)}")
            if to_health is None and health_status(f"http://127.0.0.1:{port}") == 200:
                to_health = elapsed
            state = docker_health(container)
            if state.endswith("false"):
                logs = subprocess.run(
                    ["docker", "logs", container], check=False, capture_output=True, text=True
                )
                raise RuntimeError(f"the container exited:\n{logs.stdout[-2000:]}{logs.stderr[-2000:]}")
            if to_health is not None and state.startswith("healthy"):
                to_healthy = elapsed
            time.sleep(POLL_S)
        return to_health, to_healthy
    finally:
        subprocess.run(["docker", "stop", "-t", "10", container], check=False, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image", default="sluice:cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("run_args", nargs="*", help="extra `docker run` options (after --)")
    args = parser.parse_args()
    health, healthy = [], []
    for run in range(args.runs):
        to_health, to_healthy = one_start(args.image, args.run_args)
        health.append(to_health)
        healthy.append(to_healthy)
        log(
            f"run {run + 1}/{args.runs}: /health 200 after {to_health:.2f} s, Docker healthy after {to_healthy:.2f} s"
        )
    print(
        f"{args.image}: docker run to /health 200: median {statistics.median(health):.2f} s "
        f"(runs {', '.join(f'{t:.2f}' for t in health)}); to Docker's healthy: median "
        f"{statistics.median(healthy):.2f} s, of {args.runs} runs"
    )


if __name__ == "__main__":
    main()
