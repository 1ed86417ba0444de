"""The throughput cost of structured output: JSON-schema-constrained chat requests against plain ones
that make the same number of tokens, in one run.

Each round sends 16 concurrent requests constrained by tests/support/structured_schemas.py's schemas, then
the same 16 prompts unconstrained, each with max_tokens set to the token count its constrained twin
made and ignore_eos, so that both batches have the same shape and only the constraint differs;
a round's throughput is its completion tokens over its wall time. Servers, one after another:
the default (the bitmask overlaps the forward pass), --no-structured-output-overlap, and
--no-async-scheduling (a constrained request's next mask needs its token in flight, so constrained
requests run without async scheduling: this server shows what that alone costs plain requests).
Prints medians of --repeats rounds and the ratios, and writes them as JSON.

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/structured_output_cost.py [--repeats 3]
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

from harness import log
from servers import Server, start_sluice

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from structured_schemas import SCHEMAS

CONCURRENCY = 16
MAX_TOKENS = 160
RESULTS = Path(__file__).resolve().parent / "results" / "issue11" / "structured_output_cost.json"
SERVERS = {
    "overlap": [],
    "no overlap": ["--no-structured-output-overlap"],
    "no async scheduling": ["--no-async-scheduling"],
}


def post(server: Server, body: dict[str, Any]) -> int:
    """Completion tokens of one chat request."""
    request = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return int(json.load(response)["usage"]["completion_tokens"])


def body(prompt: str, schema: dict[str, Any] | None, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": prompt + " Answer in JSON."}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
    }
    if schema is None:
        out["ignore_eos"] = True
    else:
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    return out


def run_batch(server: Server, bodies: list[dict[str, Any]]) -> tuple[list[int], float]:
    """Each request's completion tokens, and the batch's tokens per second."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        tokens = list(pool.map(lambda b: post(server, b), bodies))
    return tokens, sum(tokens) / (time.perf_counter() - start)


def round_rates(server: Server) -> tuple[float, float]:
    """One round: the constrained batch, then the plain batch of the same lengths."""
    cases = SCHEMAS[:CONCURRENCY]
    lengths, constrained = run_batch(server, [body(p, s, MAX_TOKENS) for p, s in cases])
    matched, plain = run_batch(server, [body(p, None, n) for (p, _), n in zip(cases, lengths, strict=True)])
    assert matched == lengths, (matched, lengths)
    return plain, constrained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="structured-cost-"))
    results: dict[str, dict[str, Any]] = {}
    for name, extra in SERVERS.items():
        server = start_sluice(name, None, extra, log_dir)
        try:
            server.wait_ready()
            round_rates(server)  # warm-up: the grammar tokenizer is built on first use
            rounds = []
            for repeat in range(1, args.repeats + 1):
                rounds.append(round_rates(server))
                log(
                    f"{name} round {repeat}/{args.repeats}: plain {rounds[-1][0]:.1f}, json_schema {rounds[-1][1]:.1f} tok/s"
                )
        finally:
            server.stop()
        plain = statistics.median(r[0] for r in rounds)
        constrained = statistics.median(r[1] for r in rounds)
        results[name] = {"plain_tok_s": plain, "json_schema_tok_s": constrained, "rounds": rounds}
    print(
        f"tok/s, medians of {args.repeats} rounds of {CONCURRENCY} concurrent requests, same lengths both ways"
    )
    print(f"{'server':22} {'plain':>8} {'json_schema':>12} {'constrained/plain':>18}")
    for name, r in results.items():
        ratio = r["json_schema_tok_s"] / r["plain_tok_s"]
        r["constrained_over_plain"] = ratio
        print(f"{name:22} {r['plain_tok_s']:8.1f} {r['json_schema_tok_s']:12.1f} {ratio:18.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
