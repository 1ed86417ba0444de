"""A storm of requests whose clients disconnect at random points, then the books (issue 10, item 6).

Each request picks one way to leave, on a raw socket so that the point is exact:
  mid_request        headers and part of the body sent, then gone;
  before_first_byte  the whole request sent, gone before reading a byte of the answer;
  mid_stream         a stream read for k events (k random, 0 included), then gone;
  non_streamed       a non-streamed request, gone after a random wait;
  complete           read to the end: the control, which must succeed.
Half the leavers close (FIN), half reset (RST). Endpoints, n and lengths vary. Afterwards the engine
must be idle: nothing running or waiting, KV cache usage exactly 0 (from /metrics), and the engine
core's block-pool audit must find every block free and the pool's books consistent.
bench/disconnect_storm.py runs it full-size, tests/e2e/test_disconnect_storm.py short.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sluice.loadtest.options import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT
from sluice.stress.progress import log, report_progress
from sluice.stress.server_state import (
    PREEMPTIONS,
    block_pool_audit,
    read_metrics,
    served_model,
    wait_until_idle,
)

MODES = ("mid_request", "before_first_byte", "mid_stream", "non_streamed", "complete")
# mid_stream gets the largest share: it is where a request is deepest in the engine when its client goes.
MODE_WEIGHTS = (1, 2, 4, 2, 1)
PROMPTS = (
    "Tell me about the history of the printing press.",
    "List ten animals that live in the ocean and describe each one.",
    "Explain how a bicycle stays upright.",
)


@dataclass(frozen=True, slots=True)
class Leaver:
    """One request of the storm and how its client leaves."""

    mode: str
    endpoint: str
    body: dict[str, Any]
    # mid_stream: SSE events read before leaving; mid_request: the share of the body sent.
    events: int
    body_share: float
    # non_streamed and before_first_byte: seconds waited before leaving.
    wait_s: float
    reset: bool


def plan_storm(count: int, model: str, seed: int) -> list[Leaver]:
    rng = random.Random(seed)
    leavers = []
    for _ in range(count):
        mode = rng.choices(MODES, MODE_WEIGHTS)[0]
        endpoint = rng.choice((COMPLETIONS_ENDPOINT, CHAT_ENDPOINT))
        max_tokens = rng.randint(4, 48)
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": rng.choice((0.0, 0.8)),
            "n": rng.choice((1, 1, 1, 2)),
            "ignore_eos": True,
            "stream": mode != "non_streamed" and rng.random() < 0.8,
        }
        if endpoint == CHAT_ENDPOINT:
            body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        else:
            body["prompt"] = rng.choice(PROMPTS)
        if mode == "mid_stream":
            body["stream"] = True
        leavers.append(
            Leaver(
                mode,
                endpoint,
                body,
                events=rng.randint(0, max_tokens),
                body_share=rng.random(),
                wait_s=rng.uniform(0.0, 0.05) if mode == "before_first_byte" else rng.uniform(0.0, 3.0),
                reset=rng.random() < 0.5,
            )
        )
    return leavers


def http_post(path: str, body: dict[str, Any]) -> tuple[bytes, bytes]:
    """The head and the body of an HTTP/1.1 POST that closes its connection after the answer."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode(), data


def _leave(writer: asyncio.StreamWriter, reset: bool) -> None:
    if reset:
        # SO_LINGER with a zero timeout turns close() into a reset.
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def _read_events(reader: asyncio.StreamReader, events: int, timeout_s: float) -> bytes:
    """What the server sent until `events` SSE events (or the end) arrived."""
    received = b""
    while received.count(b"\n\n") < events:
        piece = await asyncio.wait_for(reader.read(65536), timeout_s)
        if not piece:
            break
        received += piece
    return received


async def run_leaver(host: str, port: int, leaver: Leaver, timeout_s: float) -> str:
    """Send one request and leave as planned; the outcome ("left", or for a control what it got)."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        return f"cannot connect: {type(exc).__name__}"
    head, data = http_post(leaver.endpoint, leaver.body)
    try:
        if leaver.mode == "mid_request":
            writer.write(head + data[: int(len(data) * leaver.body_share)])
            await writer.drain()
        elif leaver.mode == "complete":
            writer.write(head + data)
            await writer.drain()
            answer = await _read_events(reader, sys.maxsize, timeout_s)
            ok = answer.startswith(b"HTTP/1.1 200") and (b"[DONE]" in answer or not leaver.body["stream"])
            return "completed" if ok else f"control failed: {answer[:300]!r}"
        else:
            writer.write(head + data)
            await writer.drain()
            if leaver.mode == "mid_stream":
                await _read_events(reader, leaver.events, timeout_s)
            else:
                await asyncio.sleep(leaver.wait_s)
    except TimeoutError:
        return "hang"
    except ConnectionError as exc:
        return f"connection error: {type(exc).__name__}"
    finally:
        _leave(writer, leaver.reset and leaver.mode != "complete")
    return "left"


async def storm(base_url: str, leavers: list[Leaver], concurrency: int, timeout_s: float) -> Counter[str]:
    host, port = base_url.removeprefix("http://").split(":")
    limit = asyncio.Semaphore(concurrency)
    outcomes: Counter[str] = Counter()

    async def one(leaver: Leaver) -> None:
        async with limit:
            outcomes[await run_leaver(host, int(port), leaver, timeout_s)] += 1

    def describe() -> str:
        return f"{outcomes.total()}/{len(leavers)} done: " + ", ".join(
            f"{k} {v}" for k, v in outcomes.items()
        )

    progress = asyncio.create_task(report_progress(describe))
    await asyncio.gather(*(one(leaver) for leaver in leavers))
    progress.cancel()
    return outcomes


def run_disconnects(
    base_url: str, streams: int, concurrency: int, seed: int, timeout_s: float = 300.0
) -> dict[str, Any]:
    """The storm against a running server, then its gauges and audit; `ok` when all is clean."""
    model = served_model(base_url)
    leavers = plan_storm(streams, model, seed)
    started = time.monotonic()
    outcomes = asyncio.run(storm(base_url, leavers, concurrency, timeout_s))
    duration = time.monotonic() - started
    gauges = wait_until_idle(base_url)
    audit = block_pool_audit(base_url)
    preemptions = read_metrics(base_url)[PREEMPTIONS]
    # The server still serves after the storm.
    after = asyncio.run(storm(base_url, [_control(model)], 1, 60))
    result = {
        "streams": streams,
        "concurrency": concurrency,
        "seed": seed,
        "modes": dict(Counter(leaver.mode for leaver in leavers)),
        "resets": sum(leaver.reset for leaver in leavers if leaver.mode != "complete"),
        "outcomes": dict(outcomes),
        "storm_seconds": round(duration, 1),
        "gauges_after": gauges,
        # Preempted requests are aborted too when their clients leave: a small KV pool makes some.
        "preemptions": preemptions,
        "audit": audit,
        "served_after": after["completed"] == 1,
    }
    unexpected = {k: v for k, v in outcomes.items() if k not in ("left", "completed")}
    result["ok"] = (
        not unexpected and not any(gauges.values()) and audit["consistent"] and audit["num_held_blocks"] == 0
    ) and result["served_after"]
    log(
        f"{streams} streams in {duration:.0f} s: {dict(outcomes)}; after: running {gauges['running']:g}, "
        f"waiting {gauges['waiting']:g}, KV usage {gauges['kv_cache_usage']:g}; audit: "
        f"{'consistent' if audit['consistent'] else audit['problems']}, {audit['num_free_blocks']}/"
        f"{audit['num_blocks']} blocks free, {audit['num_cached_blocks']} cached; {preemptions:g} preemptions"
    )
    return result


def _control(model: str) -> Leaver:
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 8, "stream": True}
    return Leaver("complete", COMPLETIONS_ENDPOINT, body, 0, 1.0, 0.0, reset=False)
