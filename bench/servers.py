"""OpenAI-compatible servers under test (`sluice serve`, vLLM's api_server, llama-server, routers), started,
awaited, stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import process_tree_cpu_seconds
from llamacpp_peer import THREADS, tool
from vllm_peer import vllm_env, vllm_python

READY_TIMEOUT_S = 600.0


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    # Fields every request to this server carries besides the workload's own (a server's own switches).
    request_extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float:
        """CPU seconds of the server and every process under it (frontend, engine core, workers)."""
        return process_tree_cpu_seconds(self.process.pid)

    def wait_ready(self) -> None:
        """Poll /v1/models until it answers 200; fail with the log's tail if the server exits first."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} was not ready after {READY_TIMEOUT_S:.0f} s (log: {self.log_path})")

    def stop(self) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever is left of it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(url: str) -> int:
    """The status /health answers at `url` (a server's root), or 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def start_server(
    name: str,
    port: int,
    argv: list[str],
    env: dict[str, str] | None,
    log_dir: Path,
    cores: Sequence[int] | None = None,
) -> Server:
    """A server in a session of its own (so stop() reaches all its children), logging to a file,
    on `cores` (None: wherever this process may run)."""
    log_path = log_dir / f"{name.replace(' ', '_').replace('/', '_').replace('=', '')}.log"
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores),  # noqa: PLW1509
        )
    return Server(name, process, port, log_path)


def start_sluice(
    name: str, model: Path | None, extra_args: list[str], log_dir: Path, cores: Sequence[int] | None = None
) -> Server:
    """`sluice serve` on a free port, prefix caching off (unless extra_args turn it on), bf16,
    max_model_len 2048."""
    port = free_port()
    sluice = str(Path(sys.executable).parent / "sluice")
    argv = [sluice, "serve", *([str(model)] if model else []), "--port", str(port), "--dtype", "bfloat16"]
    argv += ["--max-model-len", "2048", "--no-enable-prefix-caching", *extra_args]
    return start_server(name, port, argv, None, log_dir, cores)


def start_vllm(venv: Path, model: Path, log_dir: Path) -> Server:
    """vLLM's api_server (the wheel's `vllm` command is broken: the module instead), prefix caching off."""
    port = free_port()
    argv = [vllm_python(venv), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--dtype", "bfloat16", "--max-model-len", "2048", "--no-enable-prefix-caching"]
    argv += ["--port", str(port), "--host", "127.0.0.1"]
    return start_server("vllm", port, argv, vllm_env(venv), log_dir)


def start_llamacpp(
    folder: Path, mode: str, gguf: Path, file_type: str, alias: str, log_dir: Path, slots: int = 16
) -> Server:
    """llama-server over a GGUF file (of file_type: f16, bf16, Q4_K_M, ...), `slots` parallel sequences
    sharing an 8,192-token context, 2 threads; its prompt cache is off in every request (cache_prompt
    false), as prefix caching is off on the other servers."""
    port = free_port()
    argv = [tool(folder, mode, "llama-server"), "-m", str(gguf)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS), "-tb", str(THREADS)]
    argv += ["-np", str(slots), "-c", "8192", "--cache-ram", "0", "--alias", alias]
    server = start_server(f"llama.cpp {file_type}", port, argv, None, log_dir)
    server.request_extra = {"cache_prompt": False}
    return server
