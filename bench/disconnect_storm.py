"""Issue 10, item 6, full-size: a storm of requests whose clients disconnect at random points (mid
request, before the first byte, mid stream, non-streamed; half by FIN, half by RST) against one
`sluice serve` of the default model, then the books. Exits 1 unless the engine ended idle (nothing
running or waiting, KV cache usage exactly 0) with every block free in a consistent block-pool audit.
The driver, and how each client leaves: sluice/stress/disconnect_storm.py.
tests/e2e/test_disconnect_storm.py runs a short version.

    python bench/disconnect_storm.py --streams 1000 --json bench/results/issue10/disconnects.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from harness import bench_lock
from serve_checks import started_sluice, write_json
from sluice.stress.disconnect_storm import run_disconnects


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=128, help="requests open at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], help="one more `sluice serve` argument")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--lock", default=None, help="the shared benchmark lock, held shared (not a timing)")
    args = parser.parse_args()
    # Prefix caching on, so that the audit also checks the cached-block map.
    serve_args = ["--enable-prefix-caching", *args.serve_arg]
    with (
        bench_lock(args.lock, exclusive=False),
        tempfile.TemporaryDirectory() as log_dir,
        started_sluice("disconnects", serve_args, Path(log_dir)) as server,
    ):
        result = run_disconnects(server.url, args.streams, args.concurrency, args.seed)
    write_json(args.json, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
