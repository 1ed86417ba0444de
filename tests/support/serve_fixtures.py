"""`sluice serve` as a test fixture: started on a free port, stopped (with all it started) even on failure."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from sluice.stress.server_state import summed_metrics

SLUICE = Path(sys.executable).parent / "sluice"
READY_LINE = "Sluice is serving"
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            # The command name (field 2) may hold spaces; the parent id follows its closing ")".
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`."""
    result, frontier = [], [pid]
    while frontier:
        children = [c for p in frontier for c in _children(p)]
        result += children
        frontier = children
    return result


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Response:
    status: int
    body: Any


@dataclass
class Server:
    """A running `sluice serve`; its children are in process groups of their own."""

    process: subprocess.Popen[bytes]
    port: int
    api_key: str | None
    log: Path
    socket_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_pid(self) -> int:
        (pid,) = [p for p in descendants(self.process.pid) if "engine.engine_core_server" in cmdline(p)]
        return pid

    def worker_pids(self) -> list[int]:
        return [p for p in descendants(self.process.pid) if "worker.worker_process" in cmdline(p)]

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        api_key: str | None | bool = True,
    ) -> Response:
        """One raw HTTP request. api_key True sends the server's key, None sends none."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        sent = {"Content-Type": "application/json", **(headers or {})}
        key = self.api_key if api_key is True else api_key
        if key:
            sent["Authorization"] = f"Bearer {key}"
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request(method, path, body=data, headers=sent)
            response = connection.getresponse()
            raw = response.read()
        finally:
            connection.close()
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw.decode(errors="replace")
        return Response(response.status, parsed)

    def health(self) -> int:
        return self.request("GET", "/health", api_key=None).status

    def metrics(self) -> dict[str, float]:
        """Each metric's value, summed over its label sets."""
        response = self.request("GET", "/metrics")
        assert response.status == 200, response
        return summed_metrics(str(response.body))

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def kill_all(self) -> None:
        """SIGKILL `sluice serve` and everything below it, and reap it."""
        for pid in [*descendants(self.process.pid), self.process.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


def _socket_dir(pid: int) -> Path | None:
    for child in descendants(pid):
        for word in cmdline(child).split():
            if word.startswith("ipc://"):
                return Path(word.removeprefix("ipc://")).parent
    return None


def _wait_ready(process: subprocess.Popen[bytes], log: Path) -> None:
    assert process.stdout is not None
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    buffered = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            chunk = os.read(process.stdout.fileno(), 4096)
            buffered += chunk
            if READY_LINE.encode() in buffered:
                return
            if not chunk:
                break
        elif process.poll() is not None:
            break
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    raise RuntimeError(f"sluice serve did not become ready (exit status {process.poll()}):\n{tail}")


@contextlib.contextmanager
def openai_client(server: Server) -> Iterator[openai.OpenAI]:
    """The `openai` client on `server`'s API with its key: no retries, so a failure shows at once."""
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120
    ) as client:
        yield client


@contextlib.contextmanager
def running_server(
    args: Sequence[str], log: Path, api_key: str | None = None, port: int | None = None
) -> Iterator[Server]:
    """`sluice serve ARGS` on `port` (a free one by default) until the block ends; whatever is left is
    then killed."""
    port = free_port() if port is None else port
    argv = [str(SLUICE), "serve", "--port", str(port), *args]
    if api_key is not None:
        argv += ["--api-key", api_key]
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file, start_new_session=True
        )
    server = Server(process, port, api_key, log)
    try:
        _wait_ready(process, log)
        server.socket_dir = _socket_dir(process.pid)
        yield server
    finally:
        # Gracefully first, so that it removes its socket folder; then nothing is left to chance.
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_TIMEOUT_S)
        server.kill_all()
        if server.socket_dir is not None:
            shutil.rmtree(server.socket_dir, ignore_errors=True)
        if process.stdout is not None:
            process.stdout.close()
