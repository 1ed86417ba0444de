"""The engine core process, driven over its real ZeroMQ sockets as the frontend drives it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from engine.engine_core_server import EngineCoreServer, check_bind_address
from sluice.frontend_seam import (
    Abort,
    AddRequest,
    EngineOutput,
    EngineStats,
    Message,
    Outputs,
    Ready,
    UtilityCall,
    UtilityResult,
    decode,
    encode,
)
from sluice.sampling_params import SamplingParams
from tiny_models import EOS_ID, VOCAB_SIZE, tiny_model_dir

ENGINE_OPTIONS = ["--dtype", "float32", "--num-kv-blocks", "256", "--num-threads", "1"]
MAX_MODEL_LEN = 256


@dataclass
class Client:
    """The frontend's half: PUSH requests in, PULL outputs out, sorted by request and call."""

    context: zmq.Context
    push: zmq.Socket
    pull: zmq.Socket
    outputs: dict[str, list[EngineOutput]] = field(default_factory=dict)
    utility_results: dict[int, UtilityResult] = field(default_factory=dict)
    last_stats: EngineStats | None = None
    ready: Ready | None = None

    @classmethod
    def connect(cls, input_address: str, output_address: str) -> Client:
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        pull = context.socket(zmq.PULL)
        for socket in (push, pull):
            socket.linger = 0
        push.connect(input_address)
        pull.connect(output_address)
        return cls(context, push, pull)

    def close(self) -> None:
        self.push.close(0)
        self.pull.close(0)
        self.context.term()

    def send(self, message: Message) -> None:
        self.push.send(encode(message))

    def add(self, request_id: str, prompt: list[int], **params: Any) -> None:
        self.send(AddRequest(request_id, prompt, SamplingParams(**params), arrival_time=time.time()))

    def receive(self, timeout: float = 30.0) -> Message:
        if not self.pull.poll(int(timeout * 1000)):
            raise TimeoutError(f"no message from the engine core in {timeout}s")
        message = decode(self.pull.recv())
        if isinstance(message, Outputs):
            self.last_stats = message.stats
            for output in message.outputs:
                self.outputs.setdefault(output.request_id, []).append(output)
        elif isinstance(message, UtilityResult):
            self.utility_results[message.call_id] = message
        elif isinstance(message, Ready):
            self.ready = message
        return message

    def wait_until(self, done: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            self.receive(max(0.01, deadline - time.monotonic()))

    def finished(self, request_id: str) -> EngineOutput | None:
        ended = [o for o in self.outputs.get(request_id, []) if o.finish_reason is not None]
        return ended[-1] if ended else None

    def run_to_end(self, request_ids: list[str], timeout: float = 60.0) -> dict[str, list[int]]:
        self.wait_until(lambda: all(self.finished(r) for r in request_ids), timeout)
        return {r: [t for o in self.outputs[r] for t in o.new_token_ids] for r in request_ids}

    def call(self, call_id: int, method: str) -> UtilityResult:
        self.send(UtilityCall(call_id, method))
        self.wait_until(lambda: call_id in self.utility_results, 30.0)
        return self.utility_results.pop(call_id)


@dataclass
class Server:
    process: subprocess.Popen
    client: Client
    folder: Path
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def start_server(folder: Path, *extra: str) -> subprocess.Popen:
    stderr = open(folder / "stderr.log", "wb")  # noqa: SIM115 -- the child owns it from here.
    try:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.engine_core_server",
                "--input",
                f"ipc://{folder}/input",
                "--output",
                f"ipc://{folder}/output",
                "--model",
                str(tiny_model_dir("llama")),
                *ENGINE_OPTIONS,
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    finally:
        stderr.close()


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(10)


@contextlib.contextmanager
def private_dir() -> Iterator[Path]:
    # Short (ipc paths are limited to ~100 bytes) and readable by this user only.
    folder = Path(tempfile.mkdtemp(prefix="sluice-ecs-"))
    os.chmod(folder, 0o700)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def running_server(*extra: str) -> Iterator[Server]:
    """A live engine core process that has sent ready; killed on the way out, whatever happened."""
    with private_dir() as folder:
        process = start_server(folder, *extra)
        client: Client | None = None
        try:
            client = Client.connect(f"ipc://{folder}/input", f"ipc://{folder}/output")
            server = Server(process, client, folder, folder / "stderr.log")
            deadline = time.monotonic() + 120
            while client.ready is None:
                assert process.poll() is None, f"the engine core died at startup:\n{server.stderr()}"
                assert time.monotonic() < deadline, "no ready in 120s"
                with contextlib.suppress(TimeoutError):
                    client.receive(0.5)
            yield server
        finally:
            stop(process)
            if client is not None:
                client.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server() as server:
        yield server


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    yield server.client
    assert server.process.poll() is None, f"the engine core died:\n{server.stderr()}"


@pytest.fixture(scope="module")
def offline_llm():
    from engine import LLM

    return LLM(model=str(tiny_model_dir("llama")), dtype="float32", num_kv_blocks=256)


def offline_tokens(llm, prompt: list[int], **params: Any) -> list[int]:
    (result,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params))
    return result.outputs[0].token_ids


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 * salt + 1) % 250 for i in range(length)]


def test_ready_reports_the_served_geometry(server):
    # The tiny Llama: generative, 64 wide, its end-of-sequence id as its config.json says.
    assert server.client.ready == Ready(
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=256,
        block_size=16,
        runner="generate",
        embedding_size=64,
        matryoshka_dimensions=None,
        cross_encoder=False,
        eos_token_ids=[EOS_ID],
    )
    assert "ready" in server.stderr()


def test_greedy_requests_match_the_offline_engine(client, offline_llm):
    prompts = {f"greedy-{n}": prompt_of(n, salt=n) for n in (1, 5, 17, 40)}
    for request_id, prompt in prompts.items():
        client.add(request_id, prompt, temperature=0.0, max_tokens=12)
    got = client.run_to_end(list(prompts))
    for request_id, prompt in prompts.items():
        assert got[request_id] == offline_tokens(offline_llm, prompt, temperature=0.0, max_tokens=12)


def test_many_concurrent_requests_each_finish_exactly_once(client):
    max_tokens = {f"many-{i}": 1 + i % 9 for i in range(32)}
    for i, (request_id, n) in enumerate(max_tokens.items()):
        client.add(
            request_id, prompt_of(3 + i % 20, salt=i), temperature=0.8, seed=i, max_tokens=n, ignore_eos=True
        )
    got = client.run_to_end(list(max_tokens))
    for request_id, n in max_tokens.items():
        reasons = [o.finish_reason for o in client.outputs[request_id]]
        assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] == "length"
        assert len(got[request_id]) == n
    assert client.last_stats is not None and client.last_stats.num_running == 0


def test_abort_mid_generation_ends_with_abort_and_frees_the_kv_cache(client):
    client.add("long", prompt_of(20), temperature=0.0, max_tokens=200, ignore_eos=True)
    client.wait_until(lambda: client.outputs.get("long"))
    client.send(Abort(["long", "never-existed"]))
    client.wait_until(lambda: client.finished("long"))
    assert client.finished("long").finish_reason == "abort"
    assert [o.finish_reason for o in client.outputs["long"]].count("abort") == 1
    assert sum(len(o.new_token_ids) for o in client.outputs["long"]) < 200
    assert "never-existed" not in client.outputs
    # The outputs message that carried the abort already reports the blocks freed.
    assert client.last_stats.kv_cache_usage == 0.0 and client.last_stats.num_running == 0
    stats = client.call(1, "stats").result
    assert stats["kv_cache_usage"] == 0.0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_invalid_requests_fail_alone_with_an_error(client, offline_llm):
    good = prompt_of(9, salt=3)
    client.add("good", good, temperature=0.0, max_tokens=24)
    invalid = {
        "empty": ([], {}),
        "out-of-vocab": ([1, VOCAB_SIZE + 5, 2], {}),
        "too-long": (prompt_of(MAX_MODEL_LEN + 1), {}),
        "bad-temperature": ([1, 2], {"temperature": -1.0}),
        "bad-stop-token": ([1, 2], {"stop_token_ids": [VOCAB_SIZE]}),
    }
    for request_id, (prompt, params) in invalid.items():
        client.add(request_id, prompt, **params)
    got = client.run_to_end(["good", *invalid])
    for request_id in invalid:
        (only,) = client.outputs[request_id]
        assert only.finish_reason == "error" and only.new_token_ids == [] and only.error
    assert "vocabulary" in client.finished("out-of-vocab").error
    assert "max_model_len" in client.finished("too-long").error
    assert got["good"] == offline_tokens(offline_llm, good, temperature=0.0, max_tokens=24)


def test_utility_calls_answer_health_and_stats(client):
    assert client.call(11, "health") == UtilityResult(11, {"ok": True}, None)
    stats = client.call(12, "stats")
    assert stats.error is None and list(stats.result) == [
        "num_running",
        "num_waiting",
        "kv_cache_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "num_eager_fallbacks",
        "iteration_tokens",
        "iteration_tokens_sum",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    ]
    unknown = client.call(13, "reboot")
    assert unknown.result is None and "reboot" in unknown.error


def test_malformed_messages_are_dropped_and_the_server_keeps_serving(client, server):
    import msgpack

    for junk in (
        b"",
        b"\xc1 not msgpack",
        msgpack.packb({"v": 2, "type": "abort", "request_ids": []}),
        msgpack.packb({"v": 1, "type": "shutdown"}),
        encode(Ready(1, 2, 3)),
    ):
        client.push.send(junk)
    # A malformed add_request that still names itself is answered, not left hanging.
    client.push.send(msgpack.packb({"v": 1, "type": "add_request", "request_id": "half", "params": {}}))
    client.wait_until(lambda: client.finished("half"))
    assert client.finished("half").finish_reason == "error"
    assert client.call(21, "health").result == {"ok": True}
    assert "dropped a malformed message" in server.stderr()


def _cpu_ticks(pid: int) -> int:
    # Fields 14 and 15 of /proc/PID/stat (utime, stime) cover every thread of the process.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_an_idle_server_blocks_instead_of_polling(client, server):
    client.add("warm", prompt_of(4), max_tokens=4)
    client.run_to_end(["warm"])
    assert client.call(31, "health").result == {"ok": True}
    # Lets OpenMP's spinning threads go to sleep after the last step.
    time.sleep(0.5)
    before = _cpu_ticks(server.process.pid)
    time.sleep(1.0)
    used = (_cpu_ticks(server.process.pid) - before) / os.sysconf("SC_CLK_TCK")
    assert used <= 0.03, f"an idle engine core used {used:.3f} CPU seconds in 1 s"


def test_a_frontend_that_stops_reading_is_waited_for_not_taken_for_a_hang():
    """The watchdog ends an engine core busy past twice --step-timeout-s (here 1 s). An output send
    that blocks because nobody reads the output socket is a wait on the frontend, not a hang: with
    the reader gone for 3 s, the engine core stays up and the request ends once a reader is back."""
    with running_server("--step-timeout-s", "0.5") as server:
        client = server.client
        client.pull.close(0)
        client.add("unread", prompt_of(6), temperature=0.0, max_tokens=8, ignore_eos=True)
        time.sleep(3.0)
        assert server.process.poll() is None, (
            f"the engine core died while blocked on its output:\n{server.stderr()}"
        )
        client.pull = client.context.socket(zmq.PULL)
        client.pull.linger = 0
        client.pull.connect(f"ipc://{server.folder}/output")
        tokens = client.run_to_end(["unread"], timeout=30)
        assert len(tokens["unread"]) == 8
        assert client.finished("unread").finish_reason == "length"
        assert server.process.poll() is None, server.stderr()


@pytest.mark.parametrize("signum, busy", [(signal.SIGTERM, True), (signal.SIGINT, False)])
def test_a_signal_stops_the_server_promptly_with_status_0(signum, busy):
    with running_server() as server:
        client = server.client
        if busy:
            client.add("in-flight", prompt_of(10), temperature=0.0, max_tokens=240, ignore_eos=True)
            client.wait_until(lambda: client.outputs.get("in-flight"))
        server.process.send_signal(signum)
        try:
            status = server.process.wait(10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the engine core did not stop within 10 s of signal {signum}:\n{server.stderr()}")
        assert status == 0, server.stderr()
        if busy:
            # A request still running when the engine stops is failed, never left hanging.
            client.wait_until(lambda: client.finished("in-flight"), timeout=5)
            assert client.finished("in-flight").finish_reason == "error"


@pytest.mark.parametrize(
    "address",
    [
        "tcp://0.0.0.0:5555",
        "tcp://10.1.2.3:5555",
        "tcp://*:5555",
        "tcp://example.com:5555",
        "ipc://@abstract",
    ],
)
def test_a_non_loopback_address_is_refused_at_startup(address):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.engine_core_server",
            "--input",
            address,
            "--output",
            "ipc:///tmp/unused",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert address in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "address",
    [
        "ipc:///tmp/x/input",
        "tcp://127.0.0.1:5555",
        "tcp://127.9.8.7:1",
        "tcp://[::1]:80",
        "tcp://localhost:9",
    ],
)
def test_ipc_and_loopback_addresses_are_accepted(address):
    check_bind_address(address)


class _FailingEngine:
    """Accepts requests, then fails its first step: what a lost device looks like to the loop."""

    def __init__(self) -> None:
        self.max_model_len = 64
        self.num_kv_blocks = 8
        self.runner = "generate"
        self.embedding_size = 32
        self.matryoshka_dimensions = None
        self.cross_encoder = False
        self.eos_token_ids = (2,)
        self.config = _Namespace(model=_Namespace(path="failing"), cache=_Namespace(block_size=16))
        self.requests: dict[str, list[int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: Any,
        arrival: float,
        priority: int,
        cache_salt: str | None,
        pooling: Any,
        second_text_start: int | None,
    ) -> None:
        self.requests[request_id] = prompt

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[Any]:
        raise RuntimeError("device lost")

    def sentinels(self) -> list[int]:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.requests), kv_cache_usage=0.5)


class _Namespace:
    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


def test_a_failing_step_fails_every_request_and_exits_nonzero():
    with private_dir() as folder:
        context = zmq.Context()
        sockets = [context.socket(zmq.PULL), context.socket(zmq.PUSH)]
        client = None
        try:
            for socket, name in zip(sockets, ("input", "output"), strict=True):
                socket.linger = 0
                socket.bind(f"ipc://{folder}/{name}")
            client = Client.connect(f"ipc://{folder}/input", f"ipc://{folder}/output")
            client.add("a", [1, 2])
            client.add("b", [3])
            # Both requests sit in the input queue before the loop starts, so one drain takes both.
            time.sleep(0.3)
            status: list[int] = []
            loop = threading.Thread(
                target=lambda: status.append(EngineCoreServer(_FailingEngine(), *sockets).run()), daemon=True
            )
            loop.start()
            client.wait_until(lambda: client.finished("a") and client.finished("b"), timeout=10)
            loop.join(10)
            assert status == [1]
            for request_id in ("a", "b"):
                assert client.finished(request_id).finish_reason == "error"
                assert "device lost" in client.finished(request_id).error
        finally:
            for socket in sockets:
                socket.close(0)
            if client is not None:
                client.close()
            context.term()
