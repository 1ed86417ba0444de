"""Cache-aware routing end to end: two real `sluice serve` replicas publishing KV events, a real
`sluice-router` in front of them, and the real `openai` client.

- On 8 distinct 512-token prefixes, cache-aware routing gives a higher prefix-cache hit rate (read
  from the replicas' /metrics) than round-robin; the test prints both rates.
- After a run with evictions, the router's KV index (`GET /sluice/kv_index`) equals the block
  hashes each engine reports holding (`GET /sluice/kv_cache`).

The router binary is the one `pip install` built (sluice.binaries; $SLUICE_ROUTER overrides it).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai

from engine.block_pool import hash_block_tokens
from serve_fixtures import Server, free_port, running_server
from sluice.binaries import ROUTER, rust_binary

PREFIX_TOKENS = 512
NUM_PREFIXES = 8
REQUESTS_PER_PREFIX = 4
BLOCK_SIZE = 16
# The eviction run's pool: a 512-token prefix is 32 blocks, so each replica holds about two.
SMALL_POOL_BLOCKS = 80


def _get_json(port: int, path: str) -> tuple[int, object]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw.decode(errors="replace")


@contextlib.contextmanager
def running_router(replicas: list[Server], policy: str, model: Path, log: Path) -> Iterator[int]:
    """`sluice-router` on a free port in front of `replicas` until the block ends."""
    port = free_port()
    argv = [str(rust_binary(ROUTER)), "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    argv += ["--model", str(model)]
    for replica in replicas:
        argv += ["--replica", replica.url]
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"the router exited {process.returncode}:\n{log.read_text()}"
            with contextlib.suppress(OSError):
                if _get_json(port, "/health")[0] == 200:
                    break
            assert time.monotonic() < deadline, f"the router never became healthy:\n{log.read_text()}"
            time.sleep(0.2)
        yield port
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        if process.poll() is None:
            process.kill()
            process.wait()


@contextlib.contextmanager
def two_replicas(folder: Path, extra: list[str]) -> Iterator[list[Server]]:
    args = ["--max-model-len", "1024", *extra]
    with contextlib.ExitStack() as stack:
        replicas = [
            stack.enter_context(
                running_server([*args, "--kv-events-port", str(free_port())], folder / f"replica{i}.log")
            )
            for i in range(2)
        ]
        yield replicas


def _prefixes(seed: int) -> list[list[int]]:
    """Distinct 512-token prefixes of ordinary vocabulary ids (no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(PREFIX_TOKENS)] for _ in range(NUM_PREFIXES)]


def _workload(seed: int) -> list[list[int]]:
    """Each prefix asked for REQUESTS_PER_PREFIX times with its own short tail, in a shuffled order
    (so that round-robin does not send a prefix to the same replica by accident)."""
    rng = random.Random(seed + 1)
    prompts = [
        prefix + [rng.randrange(1000, 40000) for _ in range(8)]
        for prefix in _prefixes(seed)
        for _ in range(REQUESTS_PER_PREFIX)
    ]
    rng.shuffle(prompts)
    return prompts


def _prefix_cache_counts(replicas: list[Server]) -> tuple[float, float]:
    hits = queries = 0.0
    for replica in replicas:
        metrics = replica.metrics()
        hits += metrics["sluice:prefix_cache_hits_total"]
        queries += metrics["sluice:prefix_cache_queries_total"]
    return hits, queries


def _run(router_port: int, model_name: str, prompts: list[list[int]]) -> None:
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{router_port}/v1", api_key="none", max_retries=0, timeout=300
    ) as client:
        for prompt in prompts:
            done = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0.0)
            assert done.choices[0].finish_reason == "length"


def _hit_rate(replicas: list[Server], router_port: int, model_name: str, prompts: list[list[int]]) -> float:
    hits_before, queries_before = _prefix_cache_counts(replicas)
    _run(router_port, model_name, prompts)
    hits, queries = _prefix_cache_counts(replicas)
    assert queries > queries_before
    return (hits - hits_before) / (queries - queries_before)


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(
    tmp_path: Path, default_model_path: Path
) -> None:
    with two_replicas(tmp_path, ["--kv-cache-memory", "0.5"]) as replicas:
        # Each policy gets prefixes of its own, so that neither profits from the other's run.
        with running_router(replicas, "round-robin", default_model_path, tmp_path / "rr.log") as port:
            round_robin = _hit_rate(replicas, port, default_model_path.name, _workload(seed=1))
        with running_router(replicas, "cache-aware", default_model_path, tmp_path / "ca.log") as port:
            cache_aware = _hit_rate(replicas, port, default_model_path.name, _workload(seed=2))
    print(f"\nprefix-cache hit rate: cache-aware {cache_aware:.3f}, round-robin {round_robin:.3f}")
    assert cache_aware > round_robin, f"cache-aware {cache_aware:.3f} <= round-robin {round_robin:.3f}"


def _block_hashes(tokens: list[int]) -> list[str]:
    hashes, parent = [], None
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash_block_tokens(parent, tokens[start : start + BLOCK_SIZE])
        hashes.append(parent.hex())
    return hashes


def test_the_router_index_equals_what_the_engines_hold_after_evictions(
    tmp_path: Path, default_model_path: Path
) -> None:
    prompts = _workload(seed=3)
    sent = {h for prompt in prompts for h in _block_hashes(prompt)}
    # More distinct blocks than both pools together hold: the run must evict.
    assert len(sent) > 2 * SMALL_POOL_BLOCKS
    with contextlib.ExitStack() as stack:
        replicas = stack.enter_context(two_replicas(tmp_path, ["--num-kv-blocks", str(SMALL_POOL_BLOCKS)]))
        port = stack.enter_context(
            running_router(replicas, "cache-aware", default_model_path, tmp_path / "ca.log")
        )
        _run(port, default_model_path.name, prompts)
        held: dict[str, list[str]] = {}
        for replica in replicas:
            status, snapshot = _get_json(replica.port, "/sluice/kv_cache")
            assert status == 200, snapshot
            assert isinstance(snapshot, dict)
            held[replica.url] = snapshot["block_hashes"]
            assert 0 < len(held[replica.url]) <= SMALL_POOL_BLOCKS
        # The last step's events may still be on their way: the index catches up within moments.
        deadline = time.monotonic() + 10
        while True:
            status, index = _get_json(port, "/sluice/kv_index")
            assert status == 200, index
            if index == held or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert index == held
