"""`sluice router` in front of two real `sluice serve` replicas of the default model, driven by the
real `openai` client: how each policy spreads requests, retries before the first byte, errors after
it, ejection and readmission, the API key, and what the router answers when no replica can."""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

import router_fixtures
from router_fixtures import client_of
from serve_fixtures import SLUICE, Server, cmdline, descendants, free_port, running_server

API_KEY = "sk-router-test"
MODEL = "SmolLM2-135M-Instruct"
REPLICA_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "0.25", "--exit-grace-seconds", "1"]
SUCCESS = "sluice:request_success_total"


@dataclass
class Fleet:
    """Two replicas that a test may kill and start again on the same port."""

    log_dir: Path
    ports: list[int]
    servers: list[Server | None] = field(default_factory=lambda: [None, None])
    stacks: list[contextlib.ExitStack] = field(
        default_factory=lambda: [contextlib.ExitStack(), contextlib.ExitStack()]
    )

    def start(self, index: int) -> Server:
        assert self.servers[index] is None
        log = self.log_dir / f"replica{index}-{time.monotonic_ns()}.log"
        # Each replica's stored responses in its own file, which outlives a restart.
        store = ["--responses-store", str(self.log_dir / f"responses{index}.sqlite3")]
        server = self.stacks[index].enter_context(
            running_server([*REPLICA_ARGS, *store], log, api_key=API_KEY, port=self.ports[index])
        )
        self.servers[index] = server
        return server

    def kill(self, index: int) -> None:
        self.replica(index).kill_all()
        self.stacks[index].close()
        self.servers[index] = None

    def replica(self, index: int) -> Server:
        server = self.servers[index]
        assert server is not None, f"replica {index} is not running"
        return server

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    @property
    def replica_flags(self) -> list[str]:
        return [f"--replica={url}" for url in self.urls]

    def served(self, index: int) -> float:
        """Requests replica `index` has finished, from its own /metrics."""
        return self.replica(index).metrics().get(SUCCESS, 0.0)

    def served_since(self, before: list[float], total: int) -> list[float]:
        """Each replica's finished requests since `before`, once they add up to `total` (a replica
        may count a request a moment after its answer went out)."""

        def counts() -> list[float]:
            return [self.served(i) - before[i] for i in range(2)]

        wait_for(lambda: sum(counts()) >= total, 10, f"{total} requests counted by the replicas")
        return counts()

    def close(self) -> None:
        for stack in self.stacks:
            stack.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("replicas"), [free_port(), free_port()])
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(fleet.start, [0, 1]))
        yield fleet
    finally:
        fleet.close()


# Every router of these tests takes the fleet's key.
running_router = functools.partial(router_fixtures.running_router, api_key=API_KEY)


def complete(client: openai.OpenAI, max_tokens: int = 2, **extra: Any) -> str:
    done = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=max_tokens, **extra)
    return done.choices[0].text


def long_stream(client: openai.OpenAI, max_tokens: int) -> Any:
    """A stream that has produced its first chunk."""
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    return stream


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_models_are_aggregated_and_the_api_key_is_checked_first(fleet: Fleet, tmp_path: Path) -> None:
    with running_router(["--policy", "round-robin", *fleet.replica_flags], tmp_path / "r.log") as router:
        assert [m.id for m in client_of(router).models.list().data] == [MODEL]
        for key in ("wrong-key", None):
            status, _, body = router.call("POST", "/v1/completions", b"not json", key=key)
            assert status == 401, body
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            complete(client_of(router, key="wrong-key"))
        # The replicas require the key too: the router passes it on.
        assert complete(client_of(router))
        assert router.counter("requests_total") == 1


def test_every_router_route_but_health_and_the_playground_needs_one_key_and_errors_are_openai_shaped(
    fleet: Fleet, tmp_path: Path
) -> None:
    with running_router(["--policy", "round-robin", *fleet.replica_flags], tmp_path / "r.log") as router:
        assert router.call("GET", "/health", key=None)[0] == 200
        status, _, body = router.call("GET", "/", key=None)
        assert status == 200 and b"<title>Sluice playground</title>" in body, body
        for path in ("/metrics", "/sluice/kv_index", "/v1/models", "/no/such/route"):
            status, _, body = router.call("GET", path, key=None)
            assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (path, body)
        for method, path, expected in (("GET", "/no/such/route", 404), ("GET", "/v1/completions", 405)):
            status, _, body = router.call(method, path)
            error = json.loads(body)["error"]
            assert status == expected and set(error) == {"message", "type", "param", "code"}, (path, body)
        status, _, body = router.call("GET", "/v1/models", headers={"X-Big": "v" * 100_000})
        assert status == 431 and json.loads(body)["error"]["code"] == "request_header_fields_too_large", body
        for pair in ([API_KEY, "wrong"], ["wrong", API_KEY]):
            connection = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
            try:
                connection.putrequest("GET", "/v1/models")
                for key in pair:
                    connection.putheader("Authorization", f"Bearer {key}")
                connection.endheaders()
                response = connection.getresponse()
                assert response.status == 400, response.read()
                assert json.loads(response.read())["error"]["code"] == "duplicate_authorization"
            finally:
                connection.close()


def test_other_api_paths_pass_through_to_a_replica(fleet: Fleet, tmp_path: Path) -> None:
    # Other /v1 paths, and the pooling routes vLLM serves outside /v1; a generative replica refuses
    # each with its runner's 400, which the router passes back.
    paths = ("/v1/embeddings", "/score", "/rerank", "/v1/rerank", "/v2/rerank")
    with running_router(["--policy", "round-robin", *fleet.replica_flags], tmp_path / "r.log") as router:
        for path in paths:
            direct = fleet.replica(0).request("POST", path, {"model": MODEL})
            status, _, body = router.call("POST", path, json.dumps({"model": MODEL}).encode())
            assert status == direct.status == 400, (path, body)
            assert json.loads(body) == direct.body, path
        assert router.counter("requests_total") == len(paths)


def test_anthropics_client_reaches_a_replica_with_its_x_api_key(fleet: Fleet, tmp_path: Path) -> None:
    # The router takes the key from x-api-key, sends the replica its own Authorization, and answers
    # its own refusals on Anthropic's routes in Anthropic's shape. It answers a browser's preflight
    # from an allowed origin itself, before the key.
    origin = "https://app.example.com"
    flags = ["--policy", "round-robin", "--allowed-origins", origin, *fleet.replica_flags]
    with running_router(flags, tmp_path / "r.log") as router:
        preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        status, headers, _ = router.call("OPTIONS", "/v1/messages", key=None, headers=preflight)
        assert status == 200 and headers.get("access-control-allow-origin") == origin, headers
        with anthropic.Anthropic(base_url=router.url, api_key=API_KEY, max_retries=0, timeout=60) as client:
            message = client.messages.create(
                model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
            )
            assert message.type == "message" and message.usage.output_tokens >= 1
            counted = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
            assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
        with (
            anthropic.Anthropic(base_url=router.url, api_key="wrong", max_retries=0) as wrong,
            pytest.raises(anthropic.AuthenticationError) as raised,
        ):
            wrong.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
        assert raised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        assert router.counter("requests_total") == 2


def test_replicas_are_discovered_through_dns(fleet: Fleet, tmp_path: Path) -> None:
    # localhost may also resolve to ::1, where nothing listens: that one fails its checks and is
    # ejected, and requests go to the address that answers.
    args = [
        "--policy",
        "round-robin",
        f"--discover-dns=localhost:{fleet.ports[0]}",
        "--health-interval-s",
        "0.3",
    ]
    with running_router(args, tmp_path / "r.log") as router:
        client = client_of(router)
        before = [fleet.served(0), fleet.served(1)]
        for _ in range(3):
            assert complete(client)
        assert fleet.served_since(before, 3) == [3, 0]
        assert router.counter("requests_total", replica=fleet.urls[0]) == 3


def test_bad_json_is_a_400_that_no_replica_sees(fleet: Fleet, tmp_path: Path) -> None:
    with running_router(["--policy", "round-robin", *fleet.replica_flags], tmp_path / "r.log") as router:
        for body in (b"{not json", b"[1, 2]"):
            status, _, answer = router.call("POST", "/v1/chat/completions", body)
            assert status == 400, answer
            error = json.loads(answer)["error"]
            assert error["type"] == "invalid_request_error", error
            assert set(error) == {"message", "type", "param", "code"}
        assert router.counter("requests_total") == 0


def test_round_robin_alternates_between_the_replicas(fleet: Fleet, tmp_path: Path) -> None:
    with running_router(["--policy", "round-robin", *fleet.replica_flags], tmp_path / "r.log") as router:
        client = client_of(router)
        before = [fleet.served(0), fleet.served(1)]
        for _ in range(6):
            complete(client)
        assert fleet.served_since(before, 6) == [3, 3]
        assert router.counter("routing_decisions_total", reason="round_robin") == 6


def test_a_responses_follow_up_reaches_the_replica_that_stored_its_conversation(
    fleet: Fleet, tmp_path: Path
) -> None:
    # Round-robin alone would send every other follow-up to the replica that does not hold the
    # conversation, which answers 404: the router reads the holder's tag from the response id.
    def holders(response_id: str) -> list[int]:
        path = f"/v1/responses/{response_id}"
        return [i for i in range(2) if fleet.replica(i).request("GET", path).status == 200]

    greedy: dict[str, Any] = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    with running_router(["--policy", "round-robin", *fleet.replica_flags], tmp_path / "r.log") as router:
        client = client_of(router)
        first = client.responses.create(input="Hi", **greedy)
        (holder,) = holders(first.id)
        latest = first
        for _ in range(4):
            latest = client.responses.create(previous_response_id=latest.id, input="More.", **greedy)
            assert holders(latest.id) == [holder]
        with client.responses.stream(previous_response_id=latest.id, input="Go on.", **greedy) as stream:
            # Four tokens cut the answer: it ends with response.incomplete, not .completed.
            last = list(stream)[-1]
        assert last.type == "response.incomplete"
        assert holders(last.response.id) == [holder]
        assert client.responses.retrieve(latest.id).id == latest.id
        # Its input items too: round-robin alone would send one of two reads to the other replica.
        for _ in range(2):
            (item,) = client.responses.input_items.list(latest.id).data
            assert item.content[0].text == "More."  # type: ignore[union-attr]
        client.responses.delete(first.id)
        assert holders(first.id) == []
    # Behind a router without that replica, the conversation is gone with it: a 404 naming the id.
    alone = [f"--replica={fleet.urls[1 - holder]}"]
    with running_router(["--policy", "round-robin", *alone], tmp_path / "r2.log") as router:
        with pytest.raises(openai.NotFoundError) as raised:
            client_of(router).responses.create(previous_response_id=latest.id, input="x", **greedy)
        error = raised.value.body
        assert isinstance(error, dict) and latest.id in error["message"]
        assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
        for path in (f"/v1/responses/{latest.id}", f"/v1/responses/{latest.id}/input_items"):
            status, _, body = router.call("GET", path)
            assert status == 404 and json.loads(body)["error"]["code"] == "response_not_found"


@pytest.mark.parametrize("policy", ["least-outstanding", "power-of-two"])
def test_load_aware_policies_avoid_the_busy_replica(fleet: Fleet, tmp_path: Path, policy: str) -> None:
    with running_router(["--policy", policy, *fleet.replica_flags], tmp_path / "r.log") as router:
        client = client_of(router)
        # A long stream, read no further than its first chunk, keeps one replica busy.
        busy = long_stream(client, max_tokens=400)
        in_flight = router.in_flight()
        (busy_replica,) = [replica for replica, n in in_flight.items() if n == 1]
        (idle_replica,) = [replica for replica, n in in_flight.items() if n == 0]
        for _ in range(4):
            complete(client)
        assert router.counter("requests_total", replica=idle_replica) == 4
        assert router.counter("requests_total", replica=busy_replica) == 1
        assert router.counter("routing_decisions_total", reason=policy.replace("-", "_")) == 5
        busy.close()


def test_a_client_leaving_mid_stream_aborts_the_replicas_request(fleet: Fleet, tmp_path: Path) -> None:
    with running_router(["--policy", "round-robin", *fleet.replica_flags], tmp_path / "r.log") as router:
        stream = long_stream(client_of(router), max_tokens=450)
        (replica,) = [fleet.urls.index(url) for url, n in router.in_flight().items() if n == 1]
        metrics = fleet.replica(replica).metrics()
        assert metrics["sluice:num_requests_running"] == 1
        generated_before = metrics["sluice:generation_tokens_total"]
        stream.close()
        # 450 tokens take the model several seconds; an abort ends the request at once.
        wait_for(
            lambda: fleet.replica(replica).metrics()["sluice:num_requests_running"] == 0,
            2,
            "the replica to abort the request",
        )
        wait_for(lambda: sum(router.in_flight().values()) == 0, 2, "the router to drop the request")
        generated = fleet.replica(replica).metrics()["sluice:generation_tokens_total"] - generated_before
        assert generated < 450, "the request ran to its end"


def test_consistent_hash_keeps_each_session_on_one_replica(fleet: Fleet, tmp_path: Path) -> None:
    with running_router(["--policy", "consistent-hash", *fleet.replica_flags], tmp_path / "r.log") as router:
        client = client_of(router)

        def replica_of(send: Callable[[], object]) -> int:
            before = [fleet.served(0), fleet.served(1)]
            send()
            (index,) = [i for i, n in enumerate(fleet.served_since(before, 1)) if n == 1]
            return index

        homes = {}
        for session in range(12):
            key = f"session-{session}"
            by_header = [
                replica_of(lambda k=key: complete(client, extra_headers={"x-session-id": k}))
                for _ in range(2)
            ]
            # With no session header, the body's `user` is the key: the same text, the same replica.
            by_user = replica_of(lambda k=key: complete(client, user=k))
            assert by_header == [by_user, by_user], key
            homes[key] = by_user
        assert set(homes.values()) == {0, 1}, "12 sessions all hashed to one replica"
        assert router.counter("routing_decisions_total", reason="consistent_hash") == 36
        complete(client)
        assert router.counter("routing_decisions_total", reason="no_session_key") == 1


def test_no_replica_up_is_a_503_with_retry_after(tmp_path: Path) -> None:
    closed = [f"--replica=http://127.0.0.1:{free_port()}" for _ in range(2)]
    health = ["--health-interval-s", "1", "--health-failures", "2"]
    with running_router([*closed, *health], tmp_path / "r.log", wait_healthy=False) as router:
        # Both refuse connections: tried, retried, then a 503 in OpenAI's shape.
        status, headers, body = router.call("POST", "/v1/completions", b'{"model": "m", "prompt": "hi"}')
        assert status == 503, body
        assert int(headers["retry-after"]) >= 1
        error = json.loads(body)["error"]
        assert error["type"] == "server_error" and "connect" in error["message"].lower(), error
        wait_for(lambda: router.call("GET", "/health")[0] == 503, 10, "the router's /health to turn 503")
        # Once both are ejected, the router answers at once without trying them.
        attempts = router.counter("requests_total")
        with pytest.raises(openai.InternalServerError) as raised:
            complete(client_of(router))
        assert raised.value.status_code == 503
        assert int(raised.value.response.headers["retry-after"]) >= 1
        assert router.counter("requests_total") == attempts
        assert router.counter("ejections_total") >= 2


def test_a_half_sent_body_gets_a_408_in_openai_shape(tmp_path: Path) -> None:
    closed = f"--replica=http://127.0.0.1:{free_port()}"
    with running_router(
        [closed, "--body-read-timeout-s", "1"], tmp_path / "r.log", wait_healthy=False
    ) as router:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        started = time.monotonic()
        received = b""
        with socket.create_connection(("127.0.0.1", router.port)) as sock:
            sock.sendall(head.encode() + b'{"model": "')
            sock.settimeout(10)
            with contextlib.suppress(TimeoutError):
                while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    received += chunk
        took = time.monotonic() - started
        assert received.startswith(b"HTTP/1.1 408"), received
        assert took < 5, took
        error = json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_timeout"


class _GarbageHandler(BaseHTTPRequestHandler):
    """Answers every request with 200 and a body that is neither JSON nor SSE; counts the POSTs."""

    posts = 0

    def _junk(self) -> None:
        if self.command == "POST":
            type(self).posts += 1
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b"<html>I am not a Sluice replica</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = _junk
    do_POST = _junk

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def garbage_server() -> Iterator[str]:
    _GarbageHandler.posts = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GarbageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_replica_answering_garbage_is_ejected_and_its_requests_retried(
    fleet: Fleet, tmp_path: Path
) -> None:
    with garbage_server() as junk:
        args = ["--policy", "round-robin", f"--replica={fleet.urls[0]}", f"--replica={junk}"]
        args += ["--breaker-failures", "2", "--breaker-cooldown-s", "600"]
        with running_router(args, tmp_path / "r.log") as router:
            client = client_of(router)
            for stream in (False, True) * 3:
                if stream:
                    chunks = list(
                        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True)
                    )
                    assert chunks[-1].choices[0].finish_reason == "length"
                else:
                    assert complete(client)
            # Its answers to JSON and to a stream were garbage: two failures opened its breaker, and
            # the real replica answered everything.
            assert _GarbageHandler.posts == 2
            assert router.counter("ejections_total", replica=junk) == 1
            assert router.counter("errors_total", replica=junk) == 2
            assert router.counter("retries_total", replica=junk) == 2


def test_a_killed_replica_loses_no_unstarted_request_and_is_readmitted(fleet: Fleet, tmp_path: Path) -> None:
    try:
        _kill_and_restart_replica_1(fleet, tmp_path)
    finally:
        # The module's later tests need both replicas, whatever happened here.
        if fleet.servers[1] is None:
            fleet.start(1)


def _kill_and_restart_replica_1(fleet: Fleet, tmp_path: Path) -> None:
    # Ejection takes 1 to 1.5 s here, so that requests sent just after the kill meet the dead replica.
    health = ["--health-interval-s", "0.5", "--health-failures", "3", "--health-successes", "2"]
    args = ["--policy", "round-robin", *fleet.replica_flags, *health, "--breaker-cooldown-s", "1"]
    with running_router(args, tmp_path / "r.log") as router:
        client = client_of(router)
        # Read before the streams start: on a loaded machine the survivor's two may end early.
        survivor_before = fleet.served(0)
        streams = [long_stream(client, max_tokens=300) for _ in range(4)]
        victim = fleet.urls[1]
        # Its frontend first: were its engine core first, the frontend would end the streams itself.
        (frontend,) = [
            p for p in descendants(fleet.replica(1).process.pid) if "sluice-frontend" in cmdline(p)
        ]
        os.kill(frontend, signal.SIGKILL)
        fleet.kill(1)

        def finish(stream: Any) -> str:
            try:
                for _ in stream:
                    pass
            except openai.APIError as error:
                return f"error: {error}"
            return "finished"

        with ThreadPoolExecutor(12) as pool:
            # Sent while the replica is dead but not yet ejected: retried on the survivor.
            fresh = [pool.submit(complete, client) for _ in range(8)]
            # Every stream ends, none hangs: those on the killed replica with an error event.
            endings = list(pool.map(finish, streams, timeout=120))
            texts = [future.result(timeout=120) for future in fresh]
        assert endings.count("finished") == 2, endings
        assert all("failed mid-stream" in e for e in endings if e != "finished"), endings
        assert len(texts) == 8
        wait_for(lambda: fleet.served(0) - survivor_before >= 10, 10, "the survivor to count 2 + 8 requests")
        assert fleet.served(0) - survivor_before == 10
        assert router.counter("retries_total", replica=victim) >= 1
        wait_for(lambda: router.call("GET", "/health")[0] == 200, 1, "the survivor to keep /health 200")
        wait_for(lambda: router.counter("ejections_total", replica=victim) >= 1, 10, "the ejection")

        fleet.start(1)
        before = fleet.served(1)
        # Readmitted after 2 good health checks; round-robin then sends it every other request.
        deadline = time.monotonic() + 30
        while fleet.served(1) == before:
            assert time.monotonic() < deadline, "the restarted replica was not readmitted"
            complete(client)
            time.sleep(0.1)


def test_sluice_router_refuses_bad_replica_urls_and_no_replicas() -> None:
    cases = [
        (["--replica", "localhost:8000"], "--replica"),
        ([], "--replica"),
        (["--discover-dns", "x"], "--discover-dns"),
    ]
    for args, flag in cases:
        done = subprocess.run(
            [str(SLUICE), "router", *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 2, done.stderr
        assert flag in done.stderr, done.stderr


def test_sluice_router_refuses_bad_cache_aware_settings() -> None:
    cases = [
        (["--cache-aware-pending-s=-1"], "--cache-aware-pending-s"),
        (["--cache-aware-balance-rel", "0.5"], "--cache-aware-balance-rel"),
    ]
    for args, flag in cases:
        argv = [str(SLUICE), "router", "--replica", "http://127.0.0.1:1", "--policy", "cache-aware", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2, done.stderr
        assert flag in done.stderr, done.stderr


def test_a_router_without_a_kv_index_says_so_at_its_kv_index_route(fleet: Fleet, tmp_path: Path) -> None:
    with running_router(["--policy", "round-robin", *fleet.replica_flags], tmp_path / "r.log") as router:
        status, _, body = router.call("GET", "/sluice/kv_index")
        assert status == 404, body
        assert json.loads(body)["error"]["code"] == "no_kv_index"
