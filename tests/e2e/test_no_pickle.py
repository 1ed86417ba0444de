"""No pickle anywhere: no source imports a pickling module or pyzmq's pickling calls; every frame
the real frontend and the real engine core exchange, captured on their sockets while they serve a
completion and a utility call, is one of the protocol's msgpack messages; and so is every frame the
engine core and its worker process exchange while they run plain and structured requests.

Unpickling bytes from a socket runs whatever they say; msgpack only ever builds plain values.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from engine import LLM, SamplingParams
from serve_fixtures import free_port
from sluice import worker_seam
from sluice.binaries import FRONTEND, rust_binary
from sluice.frontend_seam import decode
from sluice.sampling_params import StructuredOutput

ROOT = Path(__file__).resolve().parents[2]
PICKLING = re.compile(
    r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill|cloudpickle|joblib|multiprocessing)\b"
    r"|\b(send_pyobj|recv_pyobj|torch\.load|pickle\.loads?)\b",
    re.MULTILINE,
)
# Every pickle stream of protocol 2 or later opens with the PROTO opcode.
PICKLE_PROTO = 0x80


def test_no_source_pickles() -> None:
    sources = [p for folder in ("python", "frontend/src", "router/src") for p in (ROOT / folder).rglob("*.*")]
    sources = [p for p in sources if p.suffix in (".py", ".rs")]
    assert len(sources) > 50
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0).strip()}"
        for p in sources
        for m in PICKLING.finditer(p.read_text())
    ]
    assert not found, found


class Tap:
    """Stands between the frontend and the engine core: binds where the frontend connects, connects
    where the engine core binds, and forwards every frame both ways, keeping a copy."""

    def __init__(self, frontend_dir: Path, engine_dir: Path) -> None:
        self.context = zmq.Context()
        self.from_frontend = self._socket(zmq.PULL, bind=f"ipc://{frontend_dir}/input")
        self.to_frontend = self._socket(zmq.PUSH, bind=f"ipc://{frontend_dir}/output")
        self.to_engine = self._socket(zmq.PUSH, connect=f"ipc://{engine_dir}/input")
        self.from_engine = self._socket(zmq.PULL, connect=f"ipc://{engine_dir}/output")
        self.frames: list[tuple[str, bytes]] = []
        self.running = True
        self.thread = threading.Thread(target=self._forward, daemon=True)
        self.thread.start()

    def _socket(self, kind: int, bind: str | None = None, connect: str | None = None) -> zmq.Socket:
        socket = self.context.socket(kind)
        socket.linger = 0
        if bind:
            socket.bind(bind)
        if connect:
            socket.connect(connect)
        return socket

    def _forward(self) -> None:
        poller = zmq.Poller()
        poller.register(self.from_frontend, zmq.POLLIN)
        poller.register(self.from_engine, zmq.POLLIN)
        routes = {
            self.from_frontend: ("to engine", self.to_engine),
            self.from_engine: ("to frontend", self.to_frontend),
        }
        while self.running:
            for socket, _ in poller.poll(100):
                direction, onward = routes[socket]
                parts = socket.recv_multipart()
                self.frames += [(direction, part) for part in parts]
                onward.send_multipart(parts)

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        for socket in (self.from_frontend, self.to_frontend, self.to_engine, self.from_engine):
            socket.close(0)
        self.context.term()


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def tapped_server(default_model_path: Path) -> Iterator[tuple[int, Tap]]:
    with tempfile.TemporaryDirectory(prefix="sluice-tap-") as folder:
        frontend_dir, engine_dir = Path(folder) / "frontend", Path(folder) / "engine"
        frontend_dir.mkdir(mode=0o700)
        engine_dir.mkdir(mode=0o700)
        engine = subprocess.Popen(
            [sys.executable, "-m", "engine.engine_core_server", "--model", str(default_model_path)]
            + ["--input", f"ipc://{engine_dir}/input", "--output", f"ipc://{engine_dir}/output"]
            + ["--max-model-len", "256", "--kv-cache-memory", "0.25"],
            stdin=subprocess.DEVNULL,
        )
        tap = Tap(frontend_dir, engine_dir)
        port = free_port()
        frontend = subprocess.Popen(
            [str(rust_binary(FRONTEND)), "--model-dir", str(default_model_path), "--served-model-name", "m"]
            + ["--port", str(port), "--engine-input", f"ipc://{frontend_dir}/input"]
            + ["--engine-output", f"ipc://{frontend_dir}/output"],
            stdin=subprocess.DEVNULL,
        )
        try:
            yield port, tap
        finally:
            stop(frontend)
            stop(engine)
            tap.close()


def post(port: int, path: str, body: dict[str, object] | None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        method = "GET" if body is None else "POST"
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_the_frontend_and_engine_core_exchange_only_msgpack(tapped_server: tuple[int, Tap]) -> None:
    port, tap = tapped_server
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if post(port, "/health", None)[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.5)
    status, body = post(port, "/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 4, "n": 2})
    assert status == 200, body
    assert post(port, "/sluice/kv_cache", None)[0] == 200
    directions = {direction for direction, _ in tap.frames}
    assert directions == {"to engine", "to frontend"}, directions
    # The ready message, two adds, outputs, a utility call and its answer at the least.
    assert len(tap.frames) >= 6, tap.frames
    for direction, frame in tap.frames:
        assert frame[:1] != bytes([PICKLE_PROTO]), (direction, frame[:32])
        decode(frame)


def test_the_engine_core_and_its_worker_exchange_only_msgpack(default_model_path: Path) -> None:
    llm = LLM(model=str(default_model_path), executor="mp", max_model_len=128, num_kv_blocks=32)
    executor = llm.engine.executor
    frames: list[tuple[str, bytes]] = []
    # Each frame is kept as it goes into, or comes out of, the executor's real sockets.
    (to_worker,) = executor.inputs
    send, recv = to_worker.send, executor.results.recv

    def sent(data: Any, *args: Any, **kwargs: Any) -> Any:
        frames.append(("to worker", bytes(data)))
        return send(data, *args, **kwargs)

    def received(*args: Any, **kwargs: Any) -> Any:
        data = recv(*args, **kwargs)
        frames.append(("to engine", bytes(data)))
        return data

    to_worker.send, executor.results.recv = sent, received
    try:
        llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=4, temperature=0.0))
        digits = StructuredOutput("regex", "[0-9]{3}")
        llm.generate(["Pick a number:"], SamplingParams(max_tokens=8, structured_output=digits))
    finally:
        llm.engine.shutdown()
    kinds = set()
    for direction, frame in frames:
        assert frame[:1] != bytes([PICKLE_PROTO]), (direction, frame[:32])
        kinds.add(type(worker_seam.decode(frame)).__name__)
    assert {"SchedulerOutput", "GrammarBitmask", "ModelRunnerOutput", "Shutdown"} <= kinds, kinds
