"""One worker process per tensor-parallel rank, started and supervised by the engine core.

Each rank has its own PUSH socket from the engine core (a step is the same bytes sent to every
rank, encoded once) and all ranks PUSH to one PULL socket back; only rank 0 sends step outputs.
The sockets are IPC paths in a private (0700) folder. Every wait for a worker also watches the
workers' pidfds, so a worker that dies is noticed at once: the wait raises WorkerDiedError instead
of hanging. Workers also die with the engine core (a parent-death signal set in worker_process).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable
from typing import TypeVar

import zmq

from sluice.config import SluiceConfig, config_to_dict
from sluice.cpu_binding import worker_environment
from sluice.errors import WorkerDiedError
from sluice.worker_seam import (
    GrammarBitmask,
    InitKVCache,
    KVCacheReady,
    Message,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerReady,
    decode,
    encode,
)

logger = logging.getLogger("sluice.engine_core")

# Loading a model (and, on first use, compiling the CPU kernels) can take minutes.
_STARTUP_TIMEOUT_S = 1800.0
# A worker asked to exit gets this long before SIGKILL, so that a stopping engine core stays well within
# the grace that Docker and Kubernetes give a signalled container (and the tests' 10 s).
_SHUTDOWN_TIMEOUT_S = 4.0
_LINGER_MS = 0

_Reply = TypeVar("_Reply", WorkerReady, KVCacheReady, ModelRunnerOutput)


class _NoAnswer(Exception):
    """No worker message arrived within the wait's bound."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"no answer within {timeout} s")
        self.timeout = timeout


class _WorkerProcess:
    def __init__(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        self.rank = rank
        self.process = process
        self.pidfd = os.pidfd_open(process.pid)

    def describe_exit(self) -> str:
        status = self.process.wait()
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        return f"worker rank {self.rank} (pid {self.process.pid}) {how}"


class MultiprocExecutor:
    def __init__(self, config: SluiceConfig) -> None:
        world_size = config.parallel.tensor_parallel_size
        self.world_size = world_size
        self.step_timeout_s = config.parallel.step_timeout_s
        # mkdtemp makes the folder 0700: only this user can reach the workers' sockets.
        self.socket_dir = tempfile.mkdtemp(prefix="sluice-workers-")
        self.context = zmq.Context()
        self.results = self.context.socket(zmq.PULL)
        self.results.linger = _LINGER_MS
        self.results.bind(f"ipc://{self.socket_dir}/results")
        self.inputs: list[zmq.Socket] = []
        self.workers: list[_WorkerProcess] = []
        # Runs at shutdown() or when the executor is collected, whichever comes first.
        self._finalizer = weakref.finalize(
            self, _stop_workers, self.workers, self.inputs, self.results, self.context, self.socket_dir
        )
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: SluiceConfig) -> None:
        world_size = self.world_size
        config_json = json.dumps(config_to_dict(config))
        for rank in range(world_size):
            socket = self.context.socket(zmq.PUSH)
            socket.linger = _LINGER_MS
            socket.bind(f"ipc://{self.socket_dir}/rank{rank}")
            self.inputs.append(socket)
            command = [
                sys.executable,
                "-m",
                "worker.worker_process",
                "--rank",
                str(rank),
                "--world-size",
                str(world_size),
                "--input",
                f"ipc://{self.socket_dir}/rank{rank}",
                "--output",
                f"ipc://{self.socket_dir}/results",
                "--dist-init",
                f"file://{self.socket_dir}/dist-store",
                "--config",
                config_json,
            ]
            env = worker_environment(config.device, os.environ)
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
            self.workers.append(_WorkerProcess(rank, process))
        self.poller = zmq.Poller()
        self.poller.register(self.results, zmq.POLLIN)
        for worker in self.workers:
            self.poller.register(worker.pidfd, zmq.POLLIN)
        self._gather(WorkerReady, _STARTUP_TIMEOUT_S)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(InitKVCache(num_blocks=num_blocks))
        self._gather(KVCacheReady, _STARTUP_TIMEOUT_S)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self._broadcast(scheduler_output)

    def submit_bitmask(self, bitmask: GrammarBitmask) -> None:
        self._broadcast(bitmask)

    def collect(self) -> ModelRunnerOutput:
        try:
            return self._receive(ModelRunnerOutput, self.step_timeout_s or None)
        except _NoAnswer as exc:
            raise WorkerDiedError(
                f"no step result from the workers within {exc.timeout:.0f} s (--step-timeout-s): a worker "
                "is hung, so the engine core gives up on them"
            ) from None

    def sentinels(self) -> list[int]:
        return [worker.pidfd for worker in self.workers]

    def check_workers(self) -> None:
        for worker in self.workers:
            if worker.process.poll() is not None:
                raise WorkerDiedError(worker.describe_exit())

    def shutdown(self) -> None:
        self._finalizer()

    def _broadcast(self, message: Message) -> None:
        data = encode(message)
        for socket in self.inputs:
            socket.send(data, copy=False)

    def _gather(self, kind: type[WorkerReady | KVCacheReady], timeout: float) -> None:
        """Wait for one `kind` reply from every rank."""
        ranks: set[int] = set()
        try:
            while len(ranks) < self.world_size:
                ranks.add(self._receive(kind, timeout).rank)
        except _NoAnswer:
            raise WorkerDiedError(f"no answer from the workers within {timeout:.0f} s") from None

    def _receive(self, kind: type[_Reply], timeout: float | None) -> _Reply:
        """The next message from a worker, which must be a `kind`; a dead or failed worker raises."""
        while True:
            events = dict(self.poller.poll(None if timeout is None else int(timeout * 1000)))
            if not events:
                assert timeout is not None
                raise _NoAnswer(timeout)
            if self.results in events:
                message = decode(self.results.recv())
                if isinstance(message, WorkerError):
                    raise WorkerDiedError(f"worker rank {message.rank} failed: {message.message}")
                if not isinstance(message, kind):
                    raise WorkerDiedError(
                        f"expected {kind.__name__} from a worker, got {type(message).__name__}"
                    )
                return message
            # Only pidfds are left: a worker exited. Its last message, if any, was read above first.
            self.check_workers()


def _stop_workers(
    workers: list[_WorkerProcess],
    inputs: list[zmq.Socket],
    results: zmq.Socket,
    context: zmq.Context,
    socket_dir: str,
) -> None:
    """Ask every worker to exit, then make sure it did; close the sockets and remove their folder."""
    data = encode(Shutdown())
    for socket in inputs:
        with contextlib.suppress(zmq.ZMQError):
            socket.send(data, zmq.NOBLOCK)
    _wait_all(workers, lambda worker: None)
    _wait_all(workers, lambda worker: worker.process.send_signal(signal.SIGKILL))
    for worker in workers:
        os.close(worker.pidfd)
    for socket in [*inputs, results]:
        socket.close(0)
    context.term()
    shutil.rmtree(socket_dir, ignore_errors=True)


def _wait_all(workers: list[_WorkerProcess], nudge: Callable[[_WorkerProcess], None]) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                nudge(worker)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(_SHUTDOWN_TIMEOUT_S)
