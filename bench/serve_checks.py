"""What the load, disconnect and soak scripts need from bench/ around the drivers of sluice.stress: the
default model's `sluice serve` with bench/servers.py's settings, and the result written as JSON."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import log
from servers import Server, start_sluice


@contextlib.contextmanager
def started_sluice(name: str, extra_args: list[str], log_dir: Path) -> Iterator[Server]:
    """The default model's `sluice serve` (bench/servers.py's settings plus `extra_args`), ready, and
    stopped with everything it started when the block ends."""
    server = start_sluice(name, None, extra_args, log_dir)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {path}")
