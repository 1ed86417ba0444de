"""`sluice router` as a test fixture: started on a free port in front of the replicas its arguments
name, stopped even on failure."""

from __future__ import annotations

import contextlib
import http.client
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai

from serve_fixtures import SLUICE, free_port

ROUTER_START_TIMEOUT_S = 20.0


@dataclass
class Router:
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    api_key: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        key: str | None | bool = True,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """One raw HTTP request. key True sends the router's key, None sends none."""
        key = self.api_key if key is True else key
        headers = {"Content-Type": "application/json", **(headers or {})}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    def counter(self, name: str, **labels: str) -> float:
        """The sum of `sluice_router:NAME` over the series whose labels include `labels`."""
        status, _, body = self.call("GET", "/metrics")
        assert status == 200
        total = 0.0
        for line in body.decode().splitlines():
            if not line.startswith(f"sluice_router:{name}{{"):
                continue
            series, value = line.rsplit(" ", 1)
            pairs = series.split("{", 1)[1].rstrip("}").split(",")
            found = {k: v.strip('"') for k, v in (p.split("=", 1) for p in pairs)}
            if labels.items() <= found.items():
                total += float(value)
        return total

    def in_flight(self) -> dict[str, float]:
        status, _, body = self.call("GET", "/metrics")
        assert status == 200
        prefix = 'sluice_router:requests_in_flight{replica="'
        return {
            line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in body.decode().splitlines()
            if line.startswith(prefix)
        }

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


@contextlib.contextmanager
def running_router(args: list[str], log: Path, api_key: str, wait_healthy: bool = True) -> Iterator[Router]:
    """`sluice router ARGS` on a free port, with `api_key`, until the block ends."""
    port = free_port()
    argv = [str(SLUICE), "router", "--host", "127.0.0.1", "--port", str(port), "--api-key", api_key, *args]
    with log.open("wb") as log_file:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file)
    router = Router(process, port, log, api_key)
    try:
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while True:
            assert process.poll() is None, f"sluice router exited {process.returncode}:\n{router.log_tail()}"
            with contextlib.suppress(OSError):
                if router.call("GET", "/health")[0] == 200 or not wait_healthy:
                    break
            assert time.monotonic() < deadline, f"sluice router did not become healthy:\n{router.log_tail()}"
            time.sleep(0.05)
        yield router
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def client_of(router: Router, key: str | None = None) -> openai.OpenAI:
    """The `openai` client on the router's API, with its key unless `key` says otherwise: no retries."""
    return openai.OpenAI(
        base_url=router.url + "/v1", api_key=key or router.api_key, max_retries=0, timeout=60
    )
