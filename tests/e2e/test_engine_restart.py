"""`sluice serve` restarts a dead engine core while its frontend stays up, end to end: real processes,
real HTTP, the `openai` client, and SIGKILL.

A kill ends every request in flight within seconds with an error that says the engine core is
restarting (an SSE stream: an error event, then [DONE]); /health and new requests answer 503 (with
Retry-After) until the new engine core is ready, then service resumes on the same frontend process.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.engine_core_server import SLOW_FIRST_STEP_ENV
from serve_fixtures import Server, alive, cmdline, descendants, running_server
from sluice.config import EngineRestartConfig
from sluice.serve.argv import frontend_argv
from sluice.serve.flags import add_serve_arguments, restart_config_from_args
from sluice.serve.restart_budget import RestartBudget

MODEL = "SmolLM2-135M-Instruct"
SMALL = ["--max-model-len", "512", "--kv-cache-memory", "0.25"]
# What the issue asks of requests in flight when the engine core dies.
FAIL_WITHIN_S = 5.0
BACK_WITHIN_S = 120.0
RESTARTS = "sluice:engine_restarts_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("restart") / "serve.log"
    with running_server(SMALL, log) as running:
        yield running


def test_restarts_back_off_doubling_and_stop_after_the_budget_within_the_window() -> None:
    budget = RestartBudget(
        EngineRestartConfig(max_restarts=3, window_s=100.0, backoff_s=0.5, backoff_max_s=1.5)
    )
    assert [budget.delay(t) for t in (0.0, 1.0, 2.0)] == [0.5, 1.0, 1.5]
    assert budget.delay(3.0) is None
    # The first restart has left the window: one more is allowed, after the backoff of the two left in it.
    assert budget.delay(100.5) == 1.5
    assert budget.delay(100.6) is None


def test_restart_flags_reach_the_config_and_the_children() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    assert restart_config_from_args(args) == EngineRestartConfig()
    assert "--reconnect-engine" in frontend_argv(args, Path("/m"), "m", Path("/s"), "127.0.0.1", 1)
    args = parser.parse_args(
        ["--no-restart-engine", "--max-engine-restarts", "2", "--engine-restart-window-s", "9"]
    )
    assert restart_config_from_args(args) == EngineRestartConfig(enabled=False, max_restarts=2, window_s=9.0)
    assert "--reconnect-engine" not in frontend_argv(args, Path("/m"), "m", Path("/s"), "127.0.0.1", 1)
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine-restart-window-s", "0"])


def frontend_pid(server: Server) -> int:
    (pid,) = [p for p in descendants(server.process.pid) if "sluice-frontend" in cmdline(p)]
    return pid


def long_completion(client: openai.OpenAI, stream: bool) -> Any:
    return client.completions.create(
        model=MODEL, prompt="Count:", max_tokens=400, stream=stream, extra_body={"ignore_eos": True}
    )


def raw_stream_events(server: Server, started: threading.Event) -> list[str]:
    """A streamed completion over plain HTTP: the data of every SSE event, in order."""
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "stream": True, "ignore_eos": True}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        events = []
        for line in response:
            if line.startswith(b"data: "):
                events.append(line[len(b"data: ") :].decode().strip())
                started.set()
        return events
    finally:
        connection.close()


def wait_for_health(server: Server, status: int, within_s: float) -> float:
    """Poll /health until it answers `status`; returns when it did (time.monotonic())."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if server.health() == status:
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"/health never answered {status} within {within_s} s:\n{server.log_tail()}")


def refused_completion(server: Server) -> tuple[int, str | None, Any]:
    """A completion request: its status, Retry-After header and JSON body."""
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.getheader("Retry-After"), json.loads(response.read())
    finally:
        connection.close()


def assert_restarting_error(message: str) -> None:
    assert "restart" in message, message


def kill_mid_requests_and_recover(server: Server, victim: int) -> None:
    """SIGKILL `victim` while a streamed (openai), a raw SSE and a non-streamed request run; check
    each ends with the restart error in time, the 503s while restarting, and the recovery."""
    frontend = frontend_pid(server)
    restarts = server.metrics()[RESTARTS]
    results: dict[str, Any] = {}
    raw_started = threading.Event()

    def non_streamed(client: openai.OpenAI) -> None:
        try:
            results["plain"] = long_completion(client, stream=False)
        except openai.APIStatusError as exc:
            results["plain"] = exc
        results["plain_at"] = time.monotonic()

    def raw() -> None:
        results["raw"] = raw_stream_events(server, raw_started)
        results["raw_at"] = time.monotonic()

    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        stream = long_completion(client, stream=True)
        next(iter(stream))
        threads = [threading.Thread(target=non_streamed, args=(client,)), threading.Thread(target=raw)]
        for thread in threads:
            thread.start()
        assert raw_started.wait(30)
        # The non-streamed request is in the engine by now: it was sent before the raw stream's first event.
        time.sleep(0.2)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(openai.APIError) as failure:
            for _ in stream:
                pass
        assert time.monotonic() - killed_at < FAIL_WITHIN_S
        # An error event, not a dropped connection.
        assert not isinstance(failure.value, openai.APIConnectionError), failure.value
        assert_restarting_error(str(failure.value))
        for thread in threads:
            thread.join(FAIL_WITHIN_S)
            assert not thread.is_alive()

    plain = results["plain"]
    assert isinstance(plain, openai.APIStatusError), plain
    assert plain.status_code in (500, 503), plain
    assert isinstance(plain.body, dict) and {"message", "type", "param", "code"} <= set(plain.body), (
        plain.body
    )
    assert_restarting_error(plain.body["message"])
    assert results["plain_at"] - killed_at < FAIL_WITHIN_S

    events = results["raw"]
    assert results["raw_at"] - killed_at < FAIL_WITHIN_S
    assert events[-1] == "[DONE]", events[-3:]
    assert_restarting_error(json.loads(events[-2])["error"]["message"])

    # The engine core is still down (or loading): unhealthy, and new requests are turned away.
    wait_for_health(server, 503, FAIL_WITHIN_S)
    status, retry_after, body = refused_completion(server)
    assert status == 503 and retry_after is not None, (status, body)
    assert body["error"]["code"] == "engine_unavailable", body
    assert_restarting_error(body["error"]["message"])

    wait_for_health(server, 200, BACK_WITHIN_S)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        after = client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=4, extra_body={"ignore_eos": True}
        )
    assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 4
    assert frontend_pid(server) == frontend
    assert server.metrics()[RESTARTS] == restarts + 1
    assert server.process.poll() is None


def test_killed_engine_core_fails_requests_then_is_restarted(server: Server) -> None:
    assert server.metrics()[RESTARTS] == 0
    kill_mid_requests_and_recover(server, server.engine_pid())


def test_killed_worker_fails_requests_then_its_engine_core_is_restarted(server: Server) -> None:
    [worker] = server.worker_pids()
    kill_mid_requests_and_recover(server, worker)


def test_gives_up_after_max_engine_restarts_within_the_window(tmp_path: Path) -> None:
    args = [*SMALL, "--max-engine-restarts", "1", "--engine-restart-window-s", "300"]
    with running_server(args, tmp_path / "serve.log") as server:
        children = descendants(server.process.pid)
        first = server.engine_pid()
        os.kill(first, signal.SIGKILL)
        # The second death comes before its successor is even ready: a crash loop.
        deadline = time.monotonic() + 30
        second = None
        while second is None and time.monotonic() < deadline:
            found = [p for p in descendants(server.process.pid) if "engine.engine_core_server" in cmdline(p)]
            second = next((p for p in found if p != first), None)
            time.sleep(0.02)
        assert second is not None, server.log_tail()
        os.kill(second, signal.SIGKILL)
        assert server.process.wait(30) == 3
        assert "giving up" in server.log_tail()
        assert not [pid for pid in [*children, second] if alive(pid)]


def test_a_long_engine_step_is_not_mistaken_for_a_dead_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step longer than the silence the frontend used to allow (15 s): the request completes and
    /health stays 200 throughout."""
    step_s = 16.0
    monkeypatch.setenv(SLOW_FIRST_STEP_ENV, str(step_s))
    with running_server(SMALL, tmp_path / "serve.log") as server:
        healths: list[int] = []
        completed: list[Any] = []
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
            started = time.monotonic()
            call = threading.Thread(
                target=lambda: completed.append(
                    client.completions.create(
                        model=MODEL, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True}
                    )
                )
            )
            call.start()
            while call.is_alive():
                healths.append(server.health())
                call.join(1.0)
        assert time.monotonic() - started >= step_s
        assert completed and completed[0].usage.completion_tokens == 2, server.log_tail()
        assert set(healths) == {200}
        assert server.metrics()[RESTARTS] == 0


def test_a_hung_engine_core_is_ended_by_its_watchdog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process executor has no step timeout of its own: a step that hangs in the engine core
    process (here a 120 s sleep) is ended by the watchdog at twice --step-timeout-s; the request in
    flight gets an error, and without restarts `sluice serve` exits with status 3."""
    monkeypatch.setenv(SLOW_FIRST_STEP_ENV, "120")
    args = [*SMALL, "--executor", "inproc", "--step-timeout-s", "1", "--no-restart-engine"]
    with running_server(args, tmp_path / "serve.log") as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as failed:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            waited = time.monotonic() - started
        assert failed.value.status_code in (500, 503), failed.value
        assert 1.5 <= waited <= 2 + FAIL_WITHIN_S, waited
        assert server.process.wait(30) == 3
        # faulthandler's dump names where the engine core was stuck.
        assert "Timeout" in server.log_tail(200) and "_step" in server.log_tail(200), server.log_tail()
