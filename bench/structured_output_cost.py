"""The throughput cost of structured output: plain and JSON-schema-constrained chat requests in one run.

For each server (the bitmask overlap on, then off with --no-structured-output-overlap), rounds
alternate between 16 concurrent plain requests (64 tokens each, ignore_eos) and 16 concurrent
requests constrained by tests/structured_schemas.py's schemas; each round's throughput is its
completion tokens over its wall time. Prints medians of --repeats rounds and the ratios.
Take the lock exclusively: flock -x /tmp/sluice-bench.lock python bench/structured_output_cost.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from servers import Server, start_sluice

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from structured_schemas import SCHEMAS

CONCURRENCY = 16


def post(server: Server, body: dict[str, Any]) -> int:
    """Completion tokens of one chat request."""
    request = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return int(json.load(response)["usage"]["completion_tokens"])


def bodies(structured: bool) -> list[dict[str, Any]]:
    out = []
    for prompt, schema in SCHEMAS[:CONCURRENCY]:
        body: dict[str, Any] = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": prompt + " Answer in JSON."}],
            "temperature": 0.0,
        }
        if structured:
            body["max_tokens"] = 160
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        else:
            body["max_tokens"] = 64
            body["ignore_eos"] = True
        out.append(body)
    return out


def tokens_per_second(server: Server, structured: bool) -> float:
    requests = bodies(structured)
    start = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        tokens = sum(pool.map(lambda body: post(server, body), requests))
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="structured-cost-"))
    for overlap in ("--structured-output-overlap", "--no-structured-output-overlap"):
        server = start_sluice(overlap, None, [overlap], log_dir)
        try:
            server.wait_ready()
            tokens_per_second(server, True)  # warm-up: the grammar tokenizer is built on first use
            rates: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for structured in (False, True):
                    rates[structured].append(tokens_per_second(server, structured))
        finally:
            server.stop()
        plain, constrained = statistics.median(rates[False]), statistics.median(rates[True])
        print(
            f"{overlap}: plain {plain:.1f} tok/s, json_schema {constrained:.1f} tok/s, "
            f"constrained/plain {constrained / plain:.3f} (medians of {args.repeats}; "
            f"plain {[round(r, 1) for r in rates[False]]}, json_schema {[round(r, 1) for r in rates[True]]})"
        )


if __name__ == "__main__":
    main()
