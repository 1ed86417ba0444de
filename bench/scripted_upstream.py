"""tests/support/scripted_openai_server.py as a process of its own, for timing what sits in front of it.

Every streamed request gets its first token after --ttft seconds and the next ones --itl seconds
apart, so whatever a router adds shows against a known baseline. Prints `url: URL` once it
listens, then serves until SIGTERM or SIGINT.

  python bench/scripted_upstream.py [--ttft 0.05] [--itl 0.02]
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from scripted_openai_server import Script, ScriptedServer

URL_PREFIX = "url: "


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ttft", type=float, default=0.05, help="seconds to the first token")
    parser.add_argument("--itl", type=float, default=0.02, help="seconds between tokens")
    args = parser.parse_args()
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    with ScriptedServer(Script(ttft=args.ttft, itl=args.itl)) as server:
        print(URL_PREFIX + server.url, flush=True)
        signal.sigwait(stop)


if __name__ == "__main__":
    main()
