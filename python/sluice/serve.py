"""`sluice serve`: one replica, i.e. the engine core process and the Rust frontend binary, supervised.

Both children get their own process group, so that a terminal's Ctrl-C reaches only this process,
which then stops them in order: the frontend first (it stops taking requests and drains the ones in
flight), then the engine core. Each child also gets SIGTERM from the kernel if this process dies
without cleaning up. The two talk over IPC sockets in a private (0700) temporary folder.

Exit status: 0 after SIGINT or SIGTERM; 3 when the engine core died (after giving the frontend a
few seconds to fail what was in flight); the frontend's own status (or 1) when it exited by itself;
1 when the server never became ready.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import http.client
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from sluice.binaries import FRONTEND, rust_binary
from sluice.config_checks import check_engine_config
from sluice.engine_args import add_engine_arguments, config_from_args, model_path_from_args
from sluice.errors import SluiceError
from sluice.model_spec import read_model_spec

# The exit status when the engine core died: the same as the frontend's in that case.
ENGINE_DIED_STATUS = 3
# How long the frontend gets, beyond its own grace period, to exit after the engine core died.
_FRONTEND_AFTER_ENGINE_S = 10.0
# How long a child gets after SIGTERM before SIGKILL (the frontend's drain is not capped).
_ENGINE_STOP_S = 15.0
_HEALTH_POLL_S = 0.25
_TAIL_LINES = 30
_PR_SET_PDEATHSIG = 1


class ServeError(SluiceError):
    """The server could not start."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: the model folder's name)",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("SLUICE_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 endpoints (default: $SLUICE_API_KEY, else none)",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 429 once this many requests wait (default: the frontend's)",
    )
    group.add_argument(
        "--max-body-bytes", type=int, default=None, help="largest request body (default: the frontend's)"
    )
    group.add_argument(
        "--tokenizer-workers", type=int, default=None, help="tokenizer threads (default: the frontend's)"
    )
    group.add_argument(
        "--exit-grace-seconds",
        type=float,
        default=None,
        help="how long the frontend keeps answering after the engine core died (default: the frontend's)",
    )
    add_engine_arguments(parser, model_positional=True)


def engine_argv(args: argparse.Namespace, model_dir: Path) -> list[str]:
    """The engine options in `args`, as the engine core process's command line takes them."""
    engine_only = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(engine_only)
    argv = ["--model", str(model_dir)]
    for action in engine_only._actions:
        if action.dest == "model" or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:
            # A plain flag (store_true): present or absent.
            if value:
                argv.append(action.option_strings[0])
        elif isinstance(value, tuple):
            argv += [action.option_strings[0], ",".join(str(v) for v in value)]
        elif value is not None:
            argv += [action.option_strings[0], str(value)]
    return argv


def frontend_argv(args: argparse.Namespace, model_dir: Path, name: str, socket_dir: Path) -> list[str]:
    argv = [
        str(rust_binary(FRONTEND)),
        "--model-dir",
        str(model_dir),
        "--served-model-name",
        name,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--engine-input",
        f"ipc://{socket_dir}/input",
        "--engine-output",
        f"ipc://{socket_dir}/output",
    ]
    for option in (
        "api_key",
        "max_waiting_requests",
        "max_body_bytes",
        "tokenizer_workers",
        "exit_grace_seconds",
    ):
        value = getattr(args, option)
        if value is not None:
            argv += ["--" + option.replace("_", "-"), str(value)]
    return argv


def _die_with_parent() -> None:
    """In the child, before exec: its own process group, and SIGTERM when `sluice serve` dies."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    """A supervised process whose output is passed to our stderr, its last lines kept."""

    name: str
    process: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))
    pidfd: int | None = None
    forwarder: threading.Thread | None = None

    @classmethod
    def start(cls, name: str, argv: Sequence[str]) -> Child:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Only setpgid and prctl run in the child before exec: no lock another thread could hold.
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
        child = cls(name, process)
        with contextlib.suppress(OSError, AttributeError):
            child.pidfd = os.pidfd_open(process.pid)
        return child

    def forward_output(self) -> None:
        self.forwarder = threading.Thread(target=self._forward, name=f"{self.name} output", daemon=True)
        self.forwarder.start()

    def _forward(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode(errors="replace")
            self.tail.append(line)
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(line)
                sys.stderr.flush()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float | None) -> int:
        """SIGTERM, wait `timeout` seconds (None: forever), then SIGKILL; returns the exit status."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                print(
                    f"sluice serve: the {self.name} did not stop in {timeout:.0f} s: killing it",
                    file=sys.stderr,
                )
                self.kill()
        return self.process.wait()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def describe_exit(self) -> str:
        status = self.process.wait()
        if self.forwarder is not None:
            self.forwarder.join(timeout=1.0)
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        tail = "".join(self.tail).rstrip()
        return f"the {self.name} {how}" + (f"; its last output:\n{tail}" if tail else "")

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class Supervisor:
    """Runs the two children, sleeping until a signal arrives or a child exits."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.signals: list[int] = []
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    def install_signal_handlers(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.signals.append(signum)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        signal.set_wakeup_fd(self._wake_write, warn_on_full_buffer=False)

    def wait(self, timeout: float | None, watch: Sequence[Child]) -> None:
        """Return after `timeout`, on a signal, or once one of `watch` has exited.

        A signal caught since the last wait leaves a byte in the wake-up pipe, and an exited child's
        pidfd stays readable, so neither can slip in unseen before select.
        """
        fds = [self._wake_read] + [c.pidfd for c in watch if c.pidfd is not None]
        # Without pidfds (old kernels), a child's exit is noticed within a second.
        if len(fds) <= len(watch):
            timeout = 1.0 if timeout is None else min(timeout, 1.0)
        select.select(fds, [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_read, 512)

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        for child in self.children:
            child.close()
        os.close(self._wake_read)
        os.close(self._wake_write)


def _health_ok(host: str, port: int) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=2.0)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def _connect_host(host: str) -> str:
    """Where to reach a server that listens on `host`: a wildcard address means this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host.strip("[]"))


def _url(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def serve(args: argparse.Namespace) -> int:
    """Run the server until a signal or a child's exit; returns the process exit status."""
    path = model_path_from_args(args)
    if path is None:
        from sluice.default_model import prepare_default_model

        model_dir = prepare_default_model()
    else:
        model_dir = Path(path)
        if not model_dir.is_dir():
            raise ServeError(f"{path} is not a folder: the model must be a local Hugging Face folder")
    model_dir = model_dir.resolve()
    name = args.served_model_name or model_dir.name
    # A bad engine option is refused here, before any process starts.
    check_engine_config(config_from_args(args, str(model_dir)), read_model_spec(model_dir))

    supervisor = Supervisor()
    supervisor.install_signal_handlers()
    # mkdtemp makes the folder 0700, as the protocol asks of the IPC sockets' folder.
    socket_dir = Path(tempfile.mkdtemp(prefix="sluice-"))
    try:
        frontend_command = frontend_argv(args, model_dir, name, socket_dir)
        engine = Child.start(
            "engine core",
            [
                sys.executable,
                "-m",
                "engine.engine_core_server",
                "--input",
                f"ipc://{socket_dir}/input",
                "--output",
                f"ipc://{socket_dir}/output",
                *engine_argv(args, model_dir),
            ],
        )
        supervisor.children.append(engine)
        # The frontend watches the engine's pid: it notices a crash at once, not after a timeout.
        frontend = Child.start("frontend", [*frontend_command, "--engine-pid", str(engine.process.pid)])
        supervisor.children.append(frontend)
        engine.forward_output()
        frontend.forward_output()
        return _supervise(supervisor, engine, frontend, args, name)
    finally:
        for child in supervisor.children:
            child.kill()
            child.process.wait()
        supervisor.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


def _supervise(
    supervisor: Supervisor, engine: Child, frontend: Child, args: argparse.Namespace, name: str
) -> int:
    host = _connect_host(args.host)
    while not _health_ok(host, args.port):
        if supervisor.signals:
            return _shut_down(supervisor, engine, frontend)
        for child in (engine, frontend):
            if not child.alive():
                other = frontend if child is engine else engine
                other.stop(_ENGINE_STOP_S)
                print(
                    f"sluice serve: the server never became ready: {child.describe_exit()}", file=sys.stderr
                )
                return 1
        supervisor.wait(_HEALTH_POLL_S, [engine, frontend])
    print(f"Sluice is serving {name} at {_url(args.host, args.port)}", flush=True)

    while True:
        supervisor.wait(None, [engine, frontend])
        if supervisor.signals:
            return _shut_down(supervisor, engine, frontend)
        if not engine.alive():
            print(f"sluice serve: {engine.describe_exit()}", file=sys.stderr)
            # The frontend fails what is in flight, reports unhealthy, then exits by itself.
            try:
                frontend.process.wait(_FRONTEND_AFTER_ENGINE_S + (args.exit_grace_seconds or 0.0))
            except subprocess.TimeoutExpired:
                frontend.stop(_ENGINE_STOP_S)
            return ENGINE_DIED_STATUS
        if not frontend.alive():
            status = frontend.process.returncode
            print(f"sluice serve: {frontend.describe_exit()}", file=sys.stderr)
            engine.stop(_ENGINE_STOP_S)
            return status if status > 0 else 1


def _shut_down(supervisor: Supervisor, engine: Child, frontend: Child) -> int:
    print("sluice serve: stopping: draining requests in flight (a second Ctrl-C kills)", file=sys.stderr)
    if frontend.alive():
        frontend.process.send_signal(signal.SIGTERM)
    seen = len(supervisor.signals)
    while frontend.alive():
        supervisor.wait(None, [frontend])
        if len(supervisor.signals) > seen:
            frontend.kill()
    frontend.process.wait()
    engine.stop(_ENGINE_STOP_S)
    print("sluice serve: stopped", file=sys.stderr)
    return 0
