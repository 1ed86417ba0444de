"""The scripted OpenAI-compatible server does what its Script says, with timing a load tester can trust."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from scripted_openai_server import Script, ScriptedServer, generated_text

# Shared CI machines (2 cores) add scheduling jitter; a few ms is still far below the script's gaps.
TOLERANCE_S = 0.015


def _connect(server: ScriptedServer) -> http.client.HTTPConnection:
    parts = urlsplit(server.url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)


def _post(server: ScriptedServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    conn = _connect(server)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _stream(
    server: ScriptedServer, path: str, body: dict[str, Any]
) -> tuple[float, list[tuple[float, bytes]], http.client.HTTPResponse]:
    """Send a streamed request; returns the send time and each `data:` line with the time it was read."""
    conn = _connect(server)
    sent = time.monotonic()
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    events = []
    # HTTPResponse.readline decodes chunked encoding and returns as soon as a line is complete, so each
    # timestamp is when that event reached the client.
    while line := response.readline():
        if line.startswith(b"data: "):
            events.append((time.monotonic(), line[len(b"data: ") :].rstrip(b"\n")))
    conn.close()
    return sent, events, response


def test_streamed_completion_timing_text_and_usage() -> None:
    script = Script(ttft=0.1, itl=0.03, output_tokens=99)
    with ScriptedServer(script) as server:
        body = {"model": "m", "prompt": "hello world", "max_tokens": 6}
        sent, events, response = _stream(
            server, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
        )
        assert response.status == 200
        assert response.getheader("Content-Type") == "text/event-stream"
        assert response.getheader("Transfer-Encoding") == "chunked"

    assert events[-1][1] == b"[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    tokens, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in tokens) == generated_text(6) == "abcdef"
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 5 + ["length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17}

    times = [t for t, _ in events[: len(tokens)]]
    # The client's clock started a little before the server's, so the first token may only be late.
    assert script.ttft <= times[0] - sent <= script.ttft + TOLERANCE_S
    for i, (earlier, later) in enumerate(itertools.pairwise(times)):
        assert later - earlier == pytest.approx(script.itl, abs=TOLERANCE_S), f"gap after token {i}"
    # Tokens follow the schedule start + ttft + i*itl, so the error does not accumulate.
    assert times[-1] - times[0] == pytest.approx(5 * script.itl, abs=TOLERANCE_S)
    assert len(server.arrivals) == 1 and sent <= server.arrivals[0] <= times[0]


def test_streamed_chat_role_delta_and_usage_only_when_asked() -> None:
    with ScriptedServer(Script(ttft=0.01, itl=0.0, output_tokens=3)) as server:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        _, events, _ = _stream(server, "/v1/chat/completions", {"model": "m", "messages": messages})
        _, with_usage, _ = _stream(
            server,
            "/v1/chat/completions",
            {"messages": messages, "max_completion_tokens": 2, "stream_options": {"include_usage": True}},
        )

    chunks = [json.loads(data) for _, data in events[:-1]]
    assert events[-1][1] == b"[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "abc"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    last = json.loads(with_usage[-2][1])
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == len("be brief") + len("hi")
    assert last["usage"]["completion_tokens"] == 2


def test_non_streamed_responses() -> None:
    script = Script(ttft=0.05, itl=0.01, output_tokens=30)
    with ScriptedServer(script) as server:
        start = time.monotonic()
        status, completion = _post(server, "/v1/completions", {"prompt": [5, 6, 7], "ignore_eos": True})
        elapsed = time.monotonic() - start
        status_chat, chat = _post(
            server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
        )

    assert status == status_chat == 200
    assert completion["choices"][0]["text"] == generated_text(30)
    assert completion["choices"][0]["text"][26:] == "abcd"  # the alphabet wraps around
    assert completion["usage"] == {"prompt_tokens": 3, "completion_tokens": 30, "total_tokens": 33}
    # The whole answer comes when the last token would have been streamed.
    assert script.ttft + 29 * script.itl <= elapsed <= script.ttft + 29 * script.itl + 0.05
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": generated_text(30)}
    assert chat["usage"]["prompt_tokens"] == 1


def test_usage_can_be_left_out() -> None:
    with ScriptedServer(Script(ttft=0.0, itl=0.0, report_usage=False)) as server:
        _, body = _post(server, "/v1/completions", {"prompt": "p"})
        _, events, _ = _stream(
            server, "/v1/completions", {"prompt": "p", "stream_options": {"include_usage": True}}
        )
    assert "usage" not in body
    assert all(json.loads(data)["choices"] for _, data in events[:-1])


def test_fail_every_answers_500_with_an_openai_error() -> None:
    with ScriptedServer(Script(ttft=0.0, itl=0.0, output_tokens=2, fail_every=2)) as server:
        results = [_post(server, "/v1/completions", {"prompt": "p"}) for _ in range(4)]
        assert len(server.arrivals) == 4
        assert server.in_flight == 0

    assert [status for status, _ in results] == [200, 500, 200, 500]
    error = results[1][1]["error"]
    assert error["code"] == 500 and error["type"] and "request 2" in error["message"]


def test_malformed_every_streams_a_bad_data_line_then_ends() -> None:
    with ScriptedServer(Script(ttft=0.0, itl=0.0, malformed_every=2)) as server:
        _, good, _ = _stream(server, "/v1/completions", {"prompt": "p", "max_tokens": 3})
        _, bad, response = _stream(server, "/v1/completions", {"prompt": "p", "max_tokens": 3})

    assert len(good) == 4 and good[-1][1] == b"[DONE]"
    assert response.status == 200
    assert len(bad) == 2, "one good token, one malformed line, and no [DONE]"
    assert json.loads(bad[0][1])["choices"][0]["text"] == "a"
    with pytest.raises(json.JSONDecodeError):
        json.loads(bad[1][1])


def test_tokenize_detokenize_round_trip_and_models() -> None:
    text = "Sluice ⚡ x\n"
    with ScriptedServer(Script()) as server:
        _, tokenized = _post(server, "/tokenize", {"prompt": text})
        _, detokenized = _post(server, "/detokenize", {"tokens": tokenized["tokens"]})
        status, bad = _post(server, "/detokenize", {"tokens": [-1]})
        conn = _connect(server)
        conn.request("GET", "/v1/models")
        models = json.loads(conn.getresponse().read())
        conn.request("GET", "/health")
        health = conn.getresponse()
        health.read()
        conn.close()
        assert server.arrivals == [], "only generation requests are counted"
    assert health.status == 200

    assert tokenized == {"tokens": [ord(c) for c in text], "count": len(text), "max_model_len": 4096}
    assert detokenized == {"prompt": text}
    assert status == 400 and "error" in bad
    assert [m["id"] for m in models["data"]] == ["scripted"]


def test_max_in_flight_counts_concurrent_requests() -> None:
    workers = 6
    # Each request waits a second for its first token, so the six overlap even when a loaded machine delays
    # one thread's connection: with 0.3 s, one of them arrived after another had finished in a full run.
    with ScriptedServer(Script(ttft=1.0, itl=0.0, output_tokens=1)) as server:
        barrier = threading.Barrier(workers)
        statuses: list[int] = []

        def one_request() -> None:
            barrier.wait()
            statuses.append(_post(server, "/v1/completions", {"prompt": "p"})[0])

        threads = [threading.Thread(target=one_request) for _ in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # One after another never overlap, so they cannot raise the peak nor count as concurrent.
        for _ in range(3):
            _post(server, "/v1/completions", {"prompt": "p", "max_tokens": 0})
        assert statuses == [200] * workers
        assert server.max_in_flight == workers
        assert server.in_flight == 0
        assert len(server.arrivals) == workers + 3
        assert server.arrivals == sorted(server.arrivals)


def test_sequential_requests_on_one_connection_do_not_overlap() -> None:
    # A client that reuses a keep-alive connection must never be counted as two requests in flight.
    with ScriptedServer(Script(ttft=0.0, itl=0.0, output_tokens=2)) as server:
        conn = _connect(server)
        for _ in range(20):
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "p", "stream": True}))
            assert conn.getresponse().read().endswith(b"data: [DONE]\n\n")
        conn.close()
        assert server.max_in_flight == 1 and len(server.arrivals) == 20


def test_client_disconnect_and_close_release_everything() -> None:
    server = ScriptedServer(Script(ttft=0.0, itl=0.05, output_tokens=100))
    conn = _connect(server)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "p", "stream": True}))
    response = conn.getresponse()
    response.readline()
    conn.close()  # hang up mid-stream: the server must stop counting the request as in flight
    deadline = time.monotonic() + 2
    while server.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.in_flight == 0

    # close() returns promptly even with a stream still being served, and the port stops answering.
    idle = _connect(server)
    idle.request("POST", "/v1/completions", json.dumps({"prompt": "p", "stream": True}))
    idle.getresponse().readline()
    start = time.monotonic()
    server.close()
    assert time.monotonic() - start < 1
    with pytest.raises(OSError):
        _post(server, "/v1/completions", {"prompt": "p"})
    server.close()  # idempotent
