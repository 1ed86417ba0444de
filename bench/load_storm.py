"""Issue 10, item 5, full-size: a burst of concurrent streaming clients against one `sluice serve`
of the default model. Exits 1 unless every request completed or got a clean 429 with Retry-After.
The driver, and what it checks and measures (the RSS of every process, before, during and after):
sluice/stress/load_storm.py. tests/e2e/test_load_storm.py runs a short version.

    python bench/load_storm.py --clients 1000 --json bench/results/issue10/load.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from harness import bench_lock
from serve_checks import started_sluice, write_json
from sluice.stress.load_storm import run_load


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="a request open longer has hung")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more `sluice serve` argument")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--lock", default=None, help="the shared benchmark lock, held shared (not a timing)")
    args = parser.parse_args()
    with (
        bench_lock(args.lock, exclusive=False),
        tempfile.TemporaryDirectory() as log_dir,
        started_sluice("load", args.serve_arg, Path(log_dir)) as server,
    ):
        result = run_load(server.url, server.process.pid, args.clients, args.max_tokens, args.timeout_s)
    write_json(args.json, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
