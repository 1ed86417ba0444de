"""`sluice serve` from start to exit: check the model and options, start the replicas (and the router
behind N > 1), supervise them until a signal or a child's exit, and stop them in order."""

from __future__ import annotations

import argparse
import copy
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sluice.binaries import ROUTER, rust_binary
from sluice.config_checks import check_engine_config
from sluice.cpu_binding import cores_per_replica, usable_cores
from sluice.engine_args import config_from_args, model_path_from_args
from sluice.errors import SluiceError
from sluice.gguf_model import gguf_model_folder, is_gguf_file
from sluice.model_spec import read_model_spec
from sluice.serve.argv import child_environment, router_argv
from sluice.serve.child import STOP_TIMEOUT_S, Child
from sluice.serve.replica import Replica, connect_host, health_ok, own_exit_status, serves_tls
from sluice.serve.supervisor import Supervisor

# Where the replicas behind the router listen: this machine only.
_REPLICA_HOST = "127.0.0.1"
_HEALTH_POLL_S = 0.25


class ServeError(SluiceError):
    """The server could not start."""


def _url(host: str, port: int, tls: bool) -> str:
    host = host.strip("[]")
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}/v1" if ":" in host else f"{scheme}://{host}:{port}/v1"


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


def _next_restart_in(replicas: Sequence[Replica]) -> float | None:
    """Seconds until the earliest due engine restart; None when none is due."""
    due = [replica.restart_at for replica in replicas if replica.restart_at is not None]
    return max(0.0, min(due) - time.monotonic()) if due else None


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
        # The router faces clients, and serves TLS if asked; the replicas behind it, on loopback, do not.
        replica_args.ssl_certfile = replica_args.ssl_keyfile = None
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
    host = connect_host(args.host)
    watched = supervisor.children
    while not (
        all(r.ready() for r in replicas) and (router is None or health_ok(host, args.port, serves_tls(args)))
    ):
        if supervisor.signals:
            return _shut_down(supervisor, replicas, router)
        dead = next((child for child in watched if not child.alive()), None)
        if dead is not None:
            _stop_all(supervisor, replicas, router)
            print(f"sluice serve: the server never became ready: {dead.describe_exit()}", file=sys.stderr)
            return 1
        supervisor.wait(_HEALTH_POLL_S, watched)
    behind = "" if router is None else f" ({len(replicas)} replicas behind {ROUTER})"
    print(f"Sluice is serving {name} at {_url(args.host, args.port, serves_tls(args))}{behind}", flush=True)

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
            return own_exit_status(router)


def _stop_all(supervisor: Supervisor, replicas: Sequence[Replica], router: Child | None) -> None:
    """Stop whatever still runs after a child's exit: the router, the frontends, then the engine cores."""
    if router is not None:
        router.stop(STOP_TIMEOUT_S)
    _drain(supervisor, [replica.frontend for replica in replicas], None)
    for replica in replicas:
        replica.engine.stop(STOP_TIMEOUT_S)


def _drain(supervisor: Supervisor, children: Sequence[Child], seen: int | None) -> None:
    """SIGTERM each of `children` and wait until all have exited; with `seen` (the signals counted
    so far), a further signal kills those still draining; without it they get STOP_TIMEOUT_S."""
    for child in children:
        if child.alive():
            child.process.send_signal(signal.SIGTERM)
    if seen is None:
        for child in children:
            child.stop(STOP_TIMEOUT_S)
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
        replica.engine.stop(STOP_TIMEOUT_S)
    print("sluice serve: stopped", file=sys.stderr)
    return 0
