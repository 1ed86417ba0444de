"""Issue 10, item 7, full-size: a bounded soak of mixed traffic against one `sluice serve` of the
default model, with its RSS curve. Exits 1 unless every error was the client's, no process grew by 5%
or more after warm-up, and the engine ended idle with a clean block pool. The driver, and the traffic
it sends: sluice/stress/soak.py. tests/e2e/test_soak.py runs a short version.

    python bench/soak.py --duration-s 600 --json bench/results/issue10/soak.json \
        --png bench/results/issue10/soak_rss.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from harness import bench_lock
from serve_checks import started_sluice, write_json
from sluice.stress.soak import run_soak


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], help="one more `sluice serve` argument")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None, help="the RSS curve of every process")
    parser.add_argument("--lock", default=None, help="the shared benchmark lock, held shared (not a timing)")
    args = parser.parse_args()
    serve_args = ["--enable-prefix-caching", *args.serve_arg]
    with (
        bench_lock(args.lock, exclusive=False),
        tempfile.TemporaryDirectory() as log_dir,
        started_sluice("soak", serve_args, Path(log_dir)) as server,
    ):
        result = run_soak(
            server.url, server.process.pid, args.duration_s, args.concurrency, args.seed, args.png
        )
    write_json(args.json, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
