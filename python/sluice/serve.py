"""`sluice serve`: one replica (the engine core process and the Rust frontend binary), or with
--data-parallel-size N, N replicas on internal loopback ports behind the `sluice-router` binary; supervised.

Every child gets its own process group, so that a terminal's Ctrl-C reaches only this process,
which then stops them in order: the router first, then the frontends (they stop taking requests
and drain the ones in flight), then the engine cores. Each child also gets SIGTERM from the kernel
if this process dies without cleaning up. A replica's frontend and engine core talk over IPC
sockets in a private (0700) temporary folder. Each of N > 1 replicas runs on its share of the
cores (its processes' affinity), so its workers size and pin their threads within that share.

An engine core that dies (or whose worker dies) is restarted, after a backoff, on the same IPC
sockets; its frontend stays up, fails what was in flight, answers 503 meanwhile and reconnects
(`docs/protocol.md`, Restarts). More than --max-engine-restarts restarts within
--engine-restart-window-s seconds end the server; --no-restart-engine ends it at the first death.

Exit status: 0 after SIGINT or SIGTERM; 3 when an engine core died and was not restarted (after
giving its frontend a few seconds to fail what was in flight); a frontend's or the router's own
status (or 1) when it exited by itself; 1 when the server never became ready. Whatever else is
running is then stopped.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import ctypes
import functools
import http.client
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import get_args

from sluice.binaries import FRONTEND, ROUTER, rust_binary
from sluice.config import EngineRestartConfig, MetricsPrefix
from sluice.config_checks import check_engine_config
from sluice.cpu_binding import cores_per_replica, usable_cores, worker_environment
from sluice.engine_args import (
    add_engine_arguments,
    at_least,
    config_from_args,
    device_config_from_args,
    model_path_from_args,
    positive_float,
)
from sluice.errors import SluiceError
from sluice.gguf_model import gguf_model_folder, is_gguf_file
from sluice.kernel_libraries import choose_kernels
from sluice.model_spec import read_model_spec

# Where the replicas behind the router listen: this machine only.
_REPLICA_HOST = "127.0.0.1"
# The exit status when an engine core died for good: the same as the frontend's in that case.
ENGINE_DIED_STATUS = 3
# How long the frontend gets, beyond its own grace period, to exit after the engine core died.
_FRONTEND_AFTER_ENGINE_S = 10.0
# How long a child gets after SIGTERM before SIGKILL (the frontend's drain is not capped).
_ENGINE_STOP_S = 15.0
_HEALTH_POLL_S = 0.25
_TAIL_LINES = 30
_PR_SET_PDEATHSIG = 1
API_KEY_ENV = "SLUICE_API_KEY"


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
    key = group.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health (default: $SLUICE_API_KEY, "
        "else none); prefer $SLUICE_API_KEY or --api-key-file, as a command line is visible to all users",
    )
    key.add_argument(
        "--api-key-file", default=None, help="a file holding the API key (one trailing newline ignored)"
    )
    group.add_argument(
        "--metrics-without-auth", action="store_true", help="serve /metrics without the API key"
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let chat and /tokenize requests bring their own chat_template (vLLM's flag); a template "
        "is code that runs on the server, so only for trusted clients",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="engine requests (one per choice: prompts x n) and tokenizer calls that may wait for the engine "
        "at once; a request waits until its first token, running ones do not count. Beyond it 429, and a "
        "request with more choices than it 400 (default: the frontend's, 512)",
    )
    group.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body, 413 beyond (default: the frontend's)",
    )
    group.add_argument(
        "--max-body-bytes-in-flight",
        type=int,
        default=None,
        help="body bytes all requests being read or handled may hold together; more wait (default: the frontend's)",
    )
    group.add_argument(
        "--header-read-timeout-s",
        type=float,
        default=None,
        help="seconds a client may take to send a request's headers, and an idle keep-alive connection "
        "stays open (default: the frontend's)",
    )
    group.add_argument(
        "--body-read-timeout-s",
        type=float,
        default=None,
        help="seconds a client may take to send a request's body, 408 beyond (default: the frontend's)",
    )
    group.add_argument(
        "--drain-timeout-s",
        type=float,
        default=None,
        help="seconds requests in flight get to finish on SIGINT or SIGTERM (default: the frontend's)",
    )
    group.add_argument(
        "--tokenizer-workers", type=int, default=None, help="tokenizer threads (default: the frontend's)"
    )
    group.add_argument(
        "--tokenize-piece-bytes",
        type=int,
        default=None,
        help="texts longer than this are encoded in pieces of this size (the same ids, a bounded peak of "
        "memory) where the tokenizer allows it exactly; 0: every text whole (default: the frontend's, 16384)",
    )
    group.add_argument(
        "--exit-grace-seconds",
        type=float,
        default=None,
        help="how long the frontend keeps answering after the engine core died (default: the frontend's)",
    )
    restart = EngineRestartConfig()
    group.add_argument(
        "--restart-engine",
        action=argparse.BooleanOptionalAction,
        default=restart.enabled,
        help="restart an engine core that died (or whose worker died), with backoff, while its frontend "
        "stays up; --no-restart-engine exits with status 3 instead",
    )
    group.add_argument(
        "--max-engine-restarts",
        type=at_least(0),
        default=restart.max_restarts,
        metavar="N",
        help="give up (exit 3) when an engine core dies after N restarts within --engine-restart-window-s",
    )
    group.add_argument(
        "--engine-restart-window-s",
        type=positive_float,
        default=restart.window_s,
        metavar="S",
        help="the window, in seconds, over which --max-engine-restarts counts",
    )
    group.add_argument(
        "--metrics-prefix",
        choices=get_args(MetricsPrefix),
        default=None,
        help="the namespace of /metrics' names; vllm renders vLLM's exact names, so that its Grafana "
        "dashboards work unchanged (default: the frontend's, sluice)",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=("auto", "hermes", "llama3_json", "mistral"),
        default=None,
        help="how tool_choice auto finds calls in outputs; auto picks by the model's vocabulary, and a chat "
        "template without tools gets a Hermes-style tool prompt, so hermes (default: the frontend's, auto)",
    )
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=at_least(1),
        default=1,
        help="replicas, each pinned to its share of the cores, behind sluice-router on --port (default: 1)",
    )
    add_engine_arguments(parser, model_positional=True)


def restart_config_from_args(args: argparse.Namespace) -> EngineRestartConfig:
    return EngineRestartConfig(
        enabled=args.restart_engine,
        max_restarts=args.max_engine_restarts,
        window_s=args.engine_restart_window_s,
    )


class RestartBudget:
    """When a dead engine core may be restarted: at most max_restarts times within window_s, each
    restart after a backoff that doubles with every earlier restart still inside the window."""

    def __init__(self, config: EngineRestartConfig) -> None:
        assert config.enabled
        self.config = config
        self.restarts: collections.deque[float] = collections.deque()

    def delay(self, now: float) -> float | None:
        """Count a restart decided at `now` and return how long to wait before it; None when the
        budget is spent."""
        while self.restarts and now - self.restarts[0] > self.config.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.config.max_restarts:
            return None
        backoff = self.config.backoff_s * 2 ** len(self.restarts)
        self.restarts.append(now)
        return min(backoff, self.config.backoff_max_s)


def engine_argv(args: argparse.Namespace, model: Path) -> list[str]:
    """The engine options in `args`, as the engine core process's command line takes them."""
    engine_only = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(engine_only)
    argv = ["--model", str(model)]
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


def frontend_argv(
    args: argparse.Namespace, model_dir: Path, name: str, socket_dir: Path, host: str, port: int
) -> list[str]:
    argv = [
        str(rust_binary(FRONTEND)),
        "--model-dir",
        str(model_dir),
        "--served-model-name",
        name,
        "--host",
        host,
        "--port",
        str(port),
        "--engine-input",
        f"ipc://{socket_dir}/input",
        "--engine-output",
        f"ipc://{socket_dir}/output",
    ]
    for option in (
        "api_key_file",
        "max_waiting_requests",
        "max_body_bytes",
        "max_body_bytes_in_flight",
        "header_read_timeout_s",
        "body_read_timeout_s",
        "drain_timeout_s",
        "tokenizer_workers",
        "tokenize_piece_bytes",
        "exit_grace_seconds",
        "metrics_prefix",
        "tool_call_parser",
    ):
        value = getattr(args, option)
        if value is not None:
            argv += ["--" + option.replace("_", "-"), str(value)]
    # The engine core's policy, so that the frontend refuses a priority that fcfs would ignore (a
    # parser without the engine's options has none: the frontend's default, fcfs, is the engine's).
    policy = getattr(args, "scheduling_policy", None)
    if policy is not None:
        argv += ["--scheduling-policy", policy]
    if args.restart_engine:
        argv.append("--reconnect-engine")
    if args.metrics_without_auth:
        argv.append("--metrics-without-auth")
    if args.trust_request_chat_template:
        argv.append("--trust-request-chat-template")
    # The tier the workers will load (a parser without the engine's options has no --cpu-isa: none).
    cpu_isa = getattr(args, "cpu_isa", None)
    if cpu_isa is not None and args.device == "cpu":
        argv += ["--cpu-kernels", choose_kernels(cpu_isa).tier]
    return argv


def router_argv(args: argparse.Namespace, model_dir: Path, replica_urls: Sequence[str]) -> list[str]:
    """The router on serve's own address, cache-aware over the replicas (the model for exact matching)."""
    argv = [
        str(rust_binary(ROUTER)),
        "--host",
        args.host,
        "--port",
        str(args.port),
    ]
    argv += ["--policy", "cache-aware", "--model", str(model_dir)]
    for url in replica_urls:
        argv += ["--replica", url]
    for option in ("api_key_file", "header_read_timeout_s", "body_read_timeout_s", "drain_timeout_s"):
        value = getattr(args, option)
        if value is not None:
            argv += ["--" + option.replace("_", "-"), str(value)]
    if args.metrics_without_auth:
        argv.append("--metrics-without-auth")
    return argv


def child_environment(args: argparse.Namespace, with_key: bool) -> dict[str, str]:
    """Our environment for a child. With `with_key` (the frontends and the router), SLUICE_API_KEY
    holds the key given by --api-key or our own SLUICE_API_KEY, so that it never appears on a command
    line; it is removed otherwise, and when --api-key-file names the key."""
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    if not with_key:
        return env
    if args.api_key is not None:
        env[API_KEY_ENV] = args.api_key
    elif args.api_key_file is None and os.environ.get(API_KEY_ENV):
        env[API_KEY_ENV] = os.environ[API_KEY_ENV]
    return env


def engine_environment(args: argparse.Namespace) -> dict[str, str]:
    """An engine core's environment, with the OpenMP spin count of its workers: under --executor
    inproc the engine core's own threads run the forward pass."""
    return worker_environment(device_config_from_args(args), child_environment(args, with_key=False))


def _die_with_parent(cores: Sequence[int] | None) -> None:
    """In the child, before exec: its own process group, SIGTERM when `sluice serve` dies, and its
    cores (None: this process's)."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if cores is not None:
        os.sched_setaffinity(0, cores)


@dataclass
class Child:
    """A supervised process whose output is passed to our stderr, its last lines kept."""

    name: str
    process: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))
    pidfd: int | None = None
    forwarder: threading.Thread | None = None

    @classmethod
    def start(
        cls, name: str, argv: Sequence[str], env: dict[str, str], cores: Sequence[int] | None = None
    ) -> Child:
        process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Only setpgid, prctl and sched_setaffinity run in the child before exec: no lock another
            # thread could hold.
            preexec_fn=functools.partial(_die_with_parent, cores),  # noqa: PLW1509
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
    """Runs the children, sleeping until a signal arrives or a child exits."""

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

    def retire(self, child: Child) -> None:
        """Stop watching `child`, which has exited and been reaped."""
        assert not child.alive()
        self.children.remove(child)
        child.close()

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


def free_port(taken: set[int]) -> int:
    """A loopback port the kernel reports free that is not in `taken`, which it then joins. `taken`
    holds the ports handed out but not bound yet, serve's own among them: the kernel may offer a
    port again once the probe closes, and a replica on serve's port left the router none."""
    while True:
        with socket.socket() as s:
            s.bind((_REPLICA_HOST, 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


@dataclass
class Replica:
    """One frontend and the engine core behind it, started, awaited and stopped as a pair; a dead
    engine core is restarted on the same sockets while the frontend stays up."""

    engine: Child
    frontend: Child
    host: str
    port: int
    engine_command: list[str]
    label: str
    cores: Sequence[int] | None
    # None: --no-restart-engine.
    restarts: RestartBudget | None
    # When the dead engine core's replacement starts (time.monotonic()); None when none is due.
    restart_at: float | None = None

    @classmethod
    def start(
        cls,
        supervisor: Supervisor,
        args: argparse.Namespace,
        model: Path,
        model_dir: Path,
        name: str,
        where: tuple[str, int],
        socket_dir: Path,
        label: str = "",
        cores: Sequence[int] | None = None,
    ) -> Replica:
        """Start the engine core, then the frontend on `where` (host, port), both on `cores`, talking
        over IPC sockets in `socket_dir`.

        The engine core loads `model` (a folder or GGUF file); the frontend reads the tokenizer and
        chat template in `model_dir`. `label` ("replica 1 ") prefixes the children's names; args are
        the engine's options."""
        host, port = where
        frontend_command = frontend_argv(args, model_dir, name, socket_dir, host, port)
        engine_command = [sys.executable, "-m", "engine.engine_core_server"]
        engine_command += ["--input", f"ipc://{socket_dir}/input", "--output", f"ipc://{socket_dir}/output"]
        if args.restart_engine:
            engine_command.append("--restarted-on-failure")
        engine_command += engine_argv(args, model)
        engine = _start_engine(supervisor, label, engine_command, engine_environment(args), cores)
        # The frontend watches the engine's pid: it notices a crash at once, not after a timeout.
        frontend_command += ["--engine-pid", str(engine.process.pid)]
        frontend = Child.start(
            f"{label}frontend", frontend_command, child_environment(args, with_key=True), cores
        )
        supervisor.children.append(frontend)
        frontend.forward_output()
        restarts = RestartBudget(restart_config_from_args(args)) if args.restart_engine else None
        return cls(engine, frontend, host, port, engine_command, label, cores, restarts)

    def ready(self) -> bool:
        return _health_ok(_connect_host(self.host), self.port)

    def exit_status(self, supervisor: Supervisor, args: argparse.Namespace) -> int | None:
        """None while both run or the engine core is being restarted; else, once the other has
        stopped too, serve's exit status. Starts a due restart."""
        if self.restart_at is None and not self.engine.alive():
            print(f"sluice serve: {self.engine.describe_exit()}", file=sys.stderr)
            if self.restarts is None:
                # The frontend fails what is in flight, reports unhealthy, then exits by itself.
                try:
                    self.frontend.process.wait(_FRONTEND_AFTER_ENGINE_S + (args.exit_grace_seconds or 0.0))
                except subprocess.TimeoutExpired:
                    self.frontend.stop(_ENGINE_STOP_S)
                return ENGINE_DIED_STATUS
            supervisor.retire(self.engine)
            delay = self.restarts.delay(time.monotonic())
            if delay is None:
                config = self.restarts.config
                print(
                    f"sluice serve: the {self.label}engine core died after {config.max_restarts} restarts "
                    f"within {config.window_s:g} s: giving up",
                    file=sys.stderr,
                )
                return ENGINE_DIED_STATUS
            print(f"sluice serve: restarting the {self.label}engine core in {delay:.2f} s", file=sys.stderr)
            self.restart_at = time.monotonic() + delay
        if not self.frontend.alive():
            print(f"sluice serve: {self.frontend.describe_exit()}", file=sys.stderr)
            self.engine.stop(_ENGINE_STOP_S)
            return _own_exit_status(self.frontend)
        if self.restart_at is not None and time.monotonic() >= self.restart_at:
            self.restart_at = None
            self.engine = _start_engine(
                supervisor,
                self.label,
                self.engine_command,
                engine_environment(args),
                self.cores,
            )
        return None


def _start_engine(
    supervisor: Supervisor,
    label: str,
    command: Sequence[str],
    env: dict[str, str],
    cores: Sequence[int] | None,
) -> Child:
    engine = Child.start(f"{label}engine core", command, env, cores)
    supervisor.children.append(engine)
    engine.forward_output()
    return engine


def _next_restart_in(replicas: Sequence[Replica]) -> float | None:
    """Seconds until the earliest due engine restart; None when none is due."""
    due = [replica.restart_at for replica in replicas if replica.restart_at is not None]
    return max(0.0, min(due) - time.monotonic()) if due else None


def _own_exit_status(child: Child) -> int:
    """serve's status when `child` exited by itself: its own, or 1 if that was 0 or a signal."""
    status = child.process.returncode
    return status if status > 0 else 1


def replica_urls(replicas: Sequence[Replica]) -> list[str]:
    return [f"http://{replica.host}:{replica.port}" for replica in replicas]


def _kv_events_ports(args: argparse.Namespace, count: int, taken: set[int]) -> list[int | None]:
    """Each replica's KV-events port: --kv-events-port P gives P, P+1, ...; else free ones; none
    without prefix caching, whose blocks are what the events describe."""
    if not args.enable_prefix_caching:
        return [None] * count
    first = args.kv_events_port
    return (
        [first + i for i in range(count)] if first is not None else [free_port(taken) for _ in range(count)]
    )


def _start_replicas(
    supervisor: Supervisor,
    args: argparse.Namespace,
    model: Path,
    model_dir: Path,
    name: str,
    size: int,
    socket_dir: Path,
) -> list[Replica]:
    """One replica on serve's own address, or `size` on loopback ports, each on its share of the cores
    and with its sockets in a folder of its own under `socket_dir`."""
    if size == 1:
        return [Replica.start(supervisor, args, model, model_dir, name, (args.host, args.port), socket_dir)]
    shares = cores_per_replica(usable_cores(), size)
    taken = {args.port}
    replicas = []
    for index, (cores, events_port) in enumerate(
        zip(shares, _kv_events_ports(args, size, taken), strict=True)
    ):
        replica_args = copy.copy(args)
        replica_args.kv_events_port = events_port
        where = (_REPLICA_HOST, free_port(taken))
        own_dir = socket_dir / str(index)
        own_dir.mkdir(mode=0o700)
        label = f"replica {index} "
        replicas.append(
            Replica.start(supervisor, replica_args, model, model_dir, name, where, own_dir, label, cores)
        )
    return replicas


def serve(args: argparse.Namespace) -> int:
    """Run the server until a signal or a child's exit; returns the process exit status."""
    path = model_path_from_args(args)
    if path is None:
        from sluice.default_model import prepare_default_model

        model = prepare_default_model()
    else:
        model = Path(path)
        if not (model.is_dir() or (is_gguf_file(model) and model.is_file())):
            raise ServeError(f"{path}: the model must be a local Hugging Face folder or a .gguf file")
    model = model.resolve()
    # A GGUF file's tokenizer and chat template are in a folder written from its metadata.
    model_dir = gguf_model_folder(model) if is_gguf_file(model) else model
    name = args.served_model_name or (model.stem if is_gguf_file(model) else model.name)
    # A bad engine option is refused here, before any process starts.
    config = config_from_args(args, str(model))
    check_engine_config(config, read_model_spec(model))
    size = config.parallel.data_parallel_size
    if size > 1:
        # A missing router is refused before any replica starts.
        rust_binary(ROUTER)

    supervisor = Supervisor()
    supervisor.install_signal_handlers()
    # mkdtemp makes the folder 0700, as the protocol asks of the IPC sockets' folder.
    socket_dir = Path(tempfile.mkdtemp(prefix="sluice-"))
    try:
        replicas = _start_replicas(supervisor, args, model, model_dir, name, size, socket_dir)
        router = None
        if size > 1:
            router = Child.start(
                "router",
                router_argv(args, model_dir, replica_urls(replicas)),
                child_environment(args, with_key=True),
            )
            supervisor.children.append(router)
            router.forward_output()
        return _supervise(supervisor, replicas, router, args, name)
    finally:
        for child in supervisor.children:
            child.kill()
            child.process.wait()
        supervisor.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


def _supervise(
    supervisor: Supervisor,
    replicas: Sequence[Replica],
    router: Child | None,
    args: argparse.Namespace,
    name: str,
) -> int:
    host = _connect_host(args.host)
    watched = supervisor.children
    while not (all(r.ready() for r in replicas) and (router is None or _health_ok(host, args.port))):
        if supervisor.signals:
            return _shut_down(supervisor, replicas, router)
        dead = next((child for child in watched if not child.alive()), None)
        if dead is not None:
            _stop_all(supervisor, replicas, router)
            print(f"sluice serve: the server never became ready: {dead.describe_exit()}", file=sys.stderr)
            return 1
        supervisor.wait(_HEALTH_POLL_S, watched)
    behind = "" if router is None else f" ({len(replicas)} replicas behind {ROUTER})"
    print(f"Sluice is serving {name} at {_url(args.host, args.port)}{behind}", flush=True)

    while True:
        supervisor.wait(_next_restart_in(replicas), watched)
        if supervisor.signals:
            return _shut_down(supervisor, replicas, router)
        for replica in replicas:
            status = replica.exit_status(supervisor, args)
            if status is not None:
                _stop_all(supervisor, replicas, router)
                return status
        if router is not None and not router.alive():
            print(f"sluice serve: {router.describe_exit()}", file=sys.stderr)
            _stop_all(supervisor, replicas, router)
            return _own_exit_status(router)


def _stop_all(supervisor: Supervisor, replicas: Sequence[Replica], router: Child | None) -> None:
    """Stop whatever still runs after a child's exit: the router, the frontends, then the engine cores."""
    if router is not None:
        router.stop(_ENGINE_STOP_S)
    _drain(supervisor, [replica.frontend for replica in replicas], None)
    for replica in replicas:
        replica.engine.stop(_ENGINE_STOP_S)


def _drain(supervisor: Supervisor, children: Sequence[Child], seen: int | None) -> None:
    """SIGTERM each of `children` and wait until all have exited; with `seen` (the signals counted
    so far), a further signal kills those still draining; without it they get _ENGINE_STOP_S."""
    for child in children:
        if child.alive():
            child.process.send_signal(signal.SIGTERM)
    if seen is None:
        for child in children:
            child.stop(_ENGINE_STOP_S)
        return
    while any(child.alive() for child in children):
        supervisor.wait(None, [child for child in children if child.alive()])
        if len(supervisor.signals) > seen:
            for child in children:
                child.kill()
    for child in children:
        child.process.wait()


def _shut_down(supervisor: Supervisor, replicas: Sequence[Replica], router: Child | None) -> int:
    print("sluice serve: stopping: draining requests in flight (a second Ctrl-C kills)", file=sys.stderr)
    seen = len(supervisor.signals)
    # The router first, so that nothing new reaches a frontend that is draining.
    if router is not None:
        _drain(supervisor, [router], seen)
    _drain(supervisor, [replica.frontend for replica in replicas], seen)
    for replica in replicas:
        replica.engine.stop(_ENGINE_STOP_S)
    print("sluice serve: stopped", file=sys.stderr)
    return 0
