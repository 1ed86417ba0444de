"""A replica: one frontend and the engine core behind it, started, awaited and stopped as a pair."""

from __future__ import annotations

import argparse
import http.client
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.serve.argv import child_environment, engine_core_argv, engine_environment, frontend_argv
from sluice.serve.child import STOP_TIMEOUT_S, Child
from sluice.serve.flags import restart_config_from_args
from sluice.serve.restart_budget import RestartBudget
from sluice.serve.supervisor import Supervisor

# The exit status when an engine core died for good: the same as the frontend's in that case.
ENGINE_DIED_STATUS = 3
# How long the frontend gets, beyond its own grace period, to exit after the engine core died.
_FRONTEND_AFTER_ENGINE_S = 10.0


def serves_tls(args: argparse.Namespace) -> bool:
    """Whether the frontend (or the router) started with `args` serves HTTPS."""
    return args.ssl_certfile is not None


def health_ok(host: str, port: int, tls: bool = False) -> bool:
    """Whether the server on `host`:`port` answers /health with 200. Over TLS the certificate is
    not checked: the probe goes to a child of this process on this machine, whose certificate may
    name another host."""
    if tls:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        connection: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=2.0, context=context
        )
    else:
        connection = http.client.HTTPConnection(host, port, timeout=2.0)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def connect_host(host: str) -> str:
    """Where to reach a server that listens on `host`: a wildcard address means this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host.strip("[]"))


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
    # Whether the frontend serves HTTPS (--ssl-certfile).
    tls: bool = False
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
        engine_command = engine_core_argv(args, model, socket_dir)
        engine = start_engine(supervisor, label, engine_command, engine_environment(args), cores)
        # The frontend watches the engine's pid: it notices a crash at once, not after a timeout.
        frontend_command += ["--engine-pid", str(engine.process.pid)]
        frontend = Child.start(
            f"{label}frontend", frontend_command, child_environment(args, with_key=True), cores
        )
        supervisor.children.append(frontend)
        frontend.forward_output()
        restarts = RestartBudget(restart_config_from_args(args)) if args.restart_engine else None
        return cls(engine, frontend, host, port, engine_command, label, cores, restarts, serves_tls(args))

    def ready(self) -> bool:
        return health_ok(connect_host(self.host), self.port, self.tls)

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
                    self.frontend.stop(STOP_TIMEOUT_S)
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
            self.engine.stop(STOP_TIMEOUT_S)
            return own_exit_status(self.frontend)
        if self.restart_at is not None and time.monotonic() >= self.restart_at:
            self.restart_at = None
            self.engine = start_engine(
                supervisor,
                self.label,
                self.engine_command,
                engine_environment(args),
                self.cores,
            )
        return None


def start_engine(
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


def own_exit_status(child: Child) -> int:
    """serve's status when `child` exited by itself: its own, or 1 if that was 0 or a signal."""
    status = child.process.returncode
    return status if status > 0 else 1
