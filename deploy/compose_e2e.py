"""Requests through the router of a running deploy/compose.yaml, then one replica killed under load.

Checks, with the real `openai` client against http://127.0.0.1:PORT/v1:
- /v1/models lists the model; a chat completion and a streamed one come back whole;
- the router's index of cached blocks fills from the replicas' KV events, which cross containers;
- under load (streams in flight on both replicas), the replica container is killed (SIGKILL):
  - every stream in flight on it when it died ends with an error soon after, never hangs;
  - every other request succeeds: the streams on the other replica, and new requests sent after the kill
    (which reach the router before it has ejected the dead replica, so some are retried);
  - the number of failed streams equals the router's in-flight count for the killed replica at the kill.
Usage: python deploy/compose_e2e.py --port PORT --project NAME --compose-file deploy/compose.yaml
Exit status 0 when every check holds; otherwise the failed check is printed and the status is 1.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from openai import OpenAI

# Forced long streams (min_tokens) keep requests in flight for seconds at the kill.
_STREAM_TOKENS = 256
_LOAD_STREAMS = 8
_AFTER_KILL_REQUESTS = 6
# How long the replicas' KV events may take to reach the router's index.
_EVENTS_WITHIN_S = 15.0
# A stream broken by the dead replica must end within this long of the kill.
_ERROR_WITHIN_S = 20.0
_CLIENT_TIMEOUT_S = 120.0
_IN_FLIGHT_SAMPLE = r'^sluice_router:requests_in_flight\{[^}]*replica="([^"]+)"[^}]*\} (\S+)$'


class CheckFailed(Exception):
    """One of the checks above did not hold."""


@dataclass
class Outcome:
    """What one request saw: its chunks, how it ended, and when."""

    chunks: int = 0
    finished: bool = False
    error: str | None = None
    ended_at: float | None = None
    first_chunk: threading.Event = field(default_factory=threading.Event)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def router_in_flight(base: str) -> dict[str, float]:
    """The router's sluice_router:requests_in_flight gauge, by replica label."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        match.group(1): float(match.group(2)) for match in re.finditer(_IN_FLIGHT_SAMPLE, text, re.MULTILINE)
    }


def kv_events_reach_the_router(base: str, api_key: str) -> None:
    """The router's index holds some replica's blocks: only KV events put them there, so a replica
    socket bound where the router cannot reach it (loopback in another container) fails this."""
    request = urllib.request.Request(
        f"{base}/sluice/kv_index", headers={"Authorization": f"Bearer {api_key}"}
    )
    deadline = time.monotonic() + _EVENTS_WITHIN_S
    while True:
        with urllib.request.urlopen(request, timeout=5) as response:
            index: dict[str, list[str]] = json.loads(response.read())
        held = {replica: len(hashes) for replica, hashes in index.items()}
        if any(held.values()):
            print(
                f"compose_e2e: the router's index holds {held} blocks, from the replicas' KV events",
                flush=True,
            )
            return
        check(
            time.monotonic() < deadline, f"no KV event reached the router in {_EVENTS_WITHIN_S:.0f} s: {held}"
        )
        time.sleep(0.5)


def stream_once(client: OpenAI, model: str, prompt: str, outcome: Outcome, max_tokens: int) -> None:
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            stream=True,
            extra_body={"min_tokens": max_tokens},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                outcome.chunks += 1
                outcome.first_chunk.set()
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                outcome.finished = True
        if not outcome.finished:
            outcome.error = "the stream ended without a finish_reason"
    except Exception as exc:  # noqa: BLE001 - any way a request ends badly is an outcome to check
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.ended_at = time.monotonic()
        outcome.first_chunk.set()


def complete_once(client: OpenAI, model: str, prompt: str, outcome: Outcome) -> None:
    try:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=32
        )
        outcome.finished = reply.choices[0].finish_reason is not None and bool(
            reply.choices[0].message.content
        )
        if not outcome.finished:
            outcome.error = f"an incomplete reply: {reply.choices[0]}"
    except Exception as exc:  # noqa: BLE001
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.ended_at = time.monotonic()


def basic_requests(client: OpenAI) -> str:
    models = [m.id for m in client.models.list().data]
    check(len(models) >= 1, f"/v1/models through the router lists no model: {models}")
    model = models[0]
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=24
    )
    check(bool(reply.choices[0].message.content), f"an empty chat completion: {reply}")
    streamed = Outcome()
    stream_once(client, model, "Count to ten.", streamed, max_tokens=16)
    check(streamed.finished and streamed.chunks > 0, f"a streamed chat completion failed: {streamed}")
    print(f"compose_e2e: {model}: models, a completion and a stream through the router", flush=True)
    return model


def kill_replica_under_load(client: OpenAI, model: str, base: str, compose: list[str], victim: str) -> None:
    loads = [Outcome() for _ in range(_LOAD_STREAMS)]
    threads = [
        threading.Thread(
            target=stream_once,
            args=(
                client,
                model,
                f"Tell story number {i} about a river, in detail.",
                loads[i],
                _STREAM_TOKENS,
            ),
        )
        for i in range(_LOAD_STREAMS)
    ]
    for thread in threads:
        thread.start()
    for outcome in loads:
        check(outcome.first_chunk.wait(_CLIENT_TIMEOUT_S), "a stream under load never started")
    check(all(o.error is None for o in loads), f"a stream failed before the kill: {[o.error for o in loads]}")
    in_flight = router_in_flight(base)
    on_victim = sum(v for k, v in in_flight.items() if f"//{victim}:" in k)
    check(on_victim >= 1, f"no stream in flight on {victim} to kill under load: {in_flight}")
    subprocess.run([*compose, "kill", "-s", "SIGKILL", victim], check=True, capture_output=True)
    killed_at = time.monotonic()
    print(f"compose_e2e: killed {victim} with {on_victim:.0f} of {_LOAD_STREAMS} streams on it", flush=True)

    after = [Outcome() for _ in range(_AFTER_KILL_REQUESTS)]
    for i, outcome in enumerate(after):
        target = complete_once if i % 2 == 0 else stream_once
        extra = () if i % 2 == 0 else (32,)
        threads.append(
            threading.Thread(target=target, args=(client, model, f"Say hello number {i}.", outcome, *extra))
        )
        threads[-1].start()
    for thread in threads:
        thread.join(_CLIENT_TIMEOUT_S)
        check(not thread.is_alive(), f"a request still hangs {_CLIENT_TIMEOUT_S:.0f} s after the kill")

    failed = [o for o in loads if o.error is not None]
    for outcome in failed:
        check(outcome.chunks > 0, f"a stream failed before it started: {outcome.error}")
        assert outcome.ended_at is not None
        late = outcome.ended_at - killed_at
        check(late < _ERROR_WITHIN_S, f"a broken stream took {late:.1f} s to end: {outcome.error}")
    check(
        len(failed) == on_victim,
        f"{len(failed)} streams failed, but {on_victim:.0f} were on {victim}: {[o.error for o in failed]}",
    )
    after_errors = [o.error for o in after if not o.finished]
    check(not after_errors, f"requests sent after the kill failed: {after_errors}")
    print(
        f"compose_e2e: {len(failed)} broken streams ended with an error within {_ERROR_WITHIN_S:.0f} s, "
        f"{_LOAD_STREAMS - len(failed)} others and {_AFTER_KILL_REQUESTS} requests after the kill succeeded",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--project", required=True)
    parser.add_argument("--compose-file", required=True)
    parser.add_argument("--compose", default="docker-compose", help="the compose command")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--victim", default="replica-1", help="the replica service to kill")
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    compose = [*args.compose.split(), "-p", args.project, "-f", args.compose_file]
    client = OpenAI(base_url=f"{base}/v1", api_key=args.api_key, timeout=_CLIENT_TIMEOUT_S, max_retries=0)
    try:
        model = basic_requests(client)
        kv_events_reach_the_router(base, args.api_key)
        kill_replica_under_load(client, model, base, compose, args.victim)
    except CheckFailed as failure:
        print(f"compose_e2e: FAILED: {failure}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
