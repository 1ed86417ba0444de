"""The engine core process: an EngineCore behind the frontend's two ZeroMQ sockets.

    python -m engine.engine_core_server --input ADDR --output ADDR [engine options]

It binds PULL (input) and PUSH (output) on IPC or loopback addresses only, loads the model, sends
`ready`, then loops. While there is work it drains every pending input without blocking, runs one
step, and sends one `outputs` message. When idle it blocks on the input socket.

An `outputs` message goes out after a step that produced outputs or changed the stats (so that
/metrics never reads stale running/waiting/KV figures), and right after a drain whose aborts or
rejected requests produced outputs, so that those never wait for a step.

Exit status: 0 after SIGTERM or SIGINT, 1 when the engine fails (every unfinished request is
first failed with finish_reason "error"), 2 for bad arguments or an address that cannot be bound.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import zmq

from sluice.engine_args import add_engine_arguments, config_from_args
from sluice.errors import InvalidRequestError, SluiceError
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
    kv_cache_to_wire,
    stats_to_wire,
)
from sluice.wire import ProtocolError

logger = logging.getLogger("sluice.engine_core")

# How long closing sockets may wait for queued outputs to reach the frontend.
_LINGER_MS = 1000
# A test hook: the first engine step takes this many seconds longer, as one huge prefill would.
SLOW_FIRST_STEP_ENV = "SLUICE_TEST_SLOW_FIRST_STEP_S"


class UnsafeAddressError(SluiceError, ValueError):
    """An address the engine core refuses to bind: not IPC and not loopback TCP."""


def check_bind_address(address: str) -> None:
    """Raise UnsafeAddressError unless `address` is ipc://PATH or tcp:// on a loopback host."""
    scheme, sep, rest = address.partition("://")
    if sep and scheme == "ipc":
        # "@name" is Linux's abstract namespace, which has no file permissions to keep others out.
        if rest and not rest.startswith("@"):
            return
        raise UnsafeAddressError(f"{address!r}: an ipc:// address must name a filesystem path")
    if sep and scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise UnsafeAddressError(f"{address!r}: a tcp:// address needs a port in 1..65535")
        if host == "localhost" or _is_loopback_ip(host.removeprefix("[").removesuffix("]")):
            return
        raise UnsafeAddressError(
            f"{address!r}: the engine core binds loopback only (127.x.x.x, [::1] or localhost)"
        )
    raise UnsafeAddressError(f"{address!r}: only ipc:// and loopback tcp:// addresses are accepted")


def _warn_if_shared(address: str) -> None:
    """The protocol wants IPC sockets in a folder only the serving user can open: say so if not."""
    if not address.startswith("ipc://"):
        return
    folder = Path(address.removeprefix("ipc://")).parent
    with contextlib.suppress(OSError):
        if folder.stat().st_mode & 0o077:
            logger.warning(
                "%s is in %s, which other users can open: any of them can send requests", address, folder
            )


def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class StepWatchdog:
    """Ends the process when the engine core stays busy past `timeout_s` without getting back to its
    loop: a hung engine core (the scheduler, a grammar, an in-process forward pass). faulthandler's
    own thread, which needs no GIL, so a hang in native code that holds it is caught too, writes
    every thread's stack to stderr and exits 1; the frontend sees a dead engine core, fails the
    requests in flight, and `sluice serve` starts a new one. Armed only while busy, and re-armed at
    most every tenth of the timeout (each arming starts a thread), so the process ends between 0.9
    and 1 timeout after its last trip round the loop. 0 disables it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.armed_at: float | None = None

    def busy(self) -> None:
        now = time.monotonic()
        if self.timeout_s and (self.armed_at is None or now - self.armed_at >= self.timeout_s / 10):
            faulthandler.dump_traceback_later(self.timeout_s, exit=True)
            self.armed_at = now

    def idle(self) -> None:
        if self.armed_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self.armed_at = None


class _Stop(Exception):
    """Raised by the signal handler to leave a blocking socket call."""


class EngineCoreServer:
    """The loop between the sockets and the engine. `engine` is an EngineCore (or a stand-in)."""

    def __init__(
        self,
        engine: Any,
        input_socket: zmq.Socket,
        output_socket: zmq.Socket,
        restarted: bool = False,
        signal_wakeup: socket.socket | None = None,
        watchdog_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.watchdog = StepWatchdog(watchdog_s)
        # The read end of signal.set_wakeup_fd's socket: readable once a signal arrived.
        self.signal_wakeup = signal_wakeup
        # Whether a supervisor restarts this process when it fails: the failed requests' errors say so.
        self.failure_note = "; the engine core is being restarted" if restarted else ""
        self.input = input_socket
        self.output = output_socket
        # Outputs of aborts and rejected requests, sent after the drain that produced them.
        self.pending: list[EngineOutput] = []
        self.last_stats: EngineStats | None = None
        self.stop_requested = False
        # True only inside a blocking socket call, where a signal may interrupt at once;
        # elsewhere a signal waits for the current step to end.
        self.interruptible = False
        self.first_step_delay_s = float(os.environ.get(SLOW_FIRST_STEP_ENV) or 0.0)

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = True
        if self.interruptible:
            raise _Stop

    def run(self) -> int:
        """Send ready, serve until stopped or failed; returns the process exit status."""
        try:
            # Logged first: whoever has the ready message can count on finding this line.
            logger.info(
                "ready: model %s, max_model_len %d, %d KV blocks of %d tokens",
                self.engine.config.model.path,
                self.engine.max_model_len,
                self.engine.num_kv_blocks,
                self.engine.config.cache.block_size,
            )
            self._send_blocking(
                Ready(
                    max_model_len=self.engine.max_model_len,
                    num_kv_blocks=self.engine.num_kv_blocks,
                    block_size=self.engine.config.cache.block_size,
                    runner=self.engine.runner,
                    embedding_size=self.engine.embedding_size,
                    matryoshka_dimensions=self.engine.matryoshka_dimensions,
                    cross_encoder=self.engine.cross_encoder,
                    eos_token_ids=list(self.engine.eos_token_ids),
                )
            )
            while not self.stop_requested:
                if not self.engine.has_unfinished_requests():
                    self.watchdog.idle()
                    data = self._recv_blocking()
                    if data is None:
                        return self._fail_on_worker_death()
                    # Armed before the message is handled: adding a request compiles its grammar.
                    self.watchdog.busy()
                    self._handle(data)
                self.watchdog.busy()
                self._drain()
                if self.engine.has_unfinished_requests() and not self._step():
                    return 1
        except _Stop:
            pass
        finally:
            self.watchdog.idle()
        logger.info("stopping on a signal")
        self._fail_unfinished("the engine core is shutting down")
        return 0

    def _recv_blocking(self) -> bytes | None:
        """The next input message, waiting for it; None if a worker died while we waited."""
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        for fd in self.engine.sentinels():
            poller.register(fd, zmq.POLLIN)
        # A signal that lands after the check below but before the poll starts (or on another
        # thread) would leave the poll blocked and its handler unrun; the wakeup fd ends the poll.
        if self.signal_wakeup is not None:
            poller.register(self.signal_wakeup, zmq.POLLIN)
        self.interruptible = True
        try:
            while True:
                # A signal that landed just before the flag was set would otherwise go unseen.
                if self.stop_requested:
                    raise _Stop
                ready = dict(poller.poll())
                if self.signal_wakeup in ready:
                    with contextlib.suppress(BlockingIOError):
                        self.signal_wakeup.recv(256)
                    continue
                if self.input not in ready:
                    return None
                return self.input.recv()
        finally:
            self.interruptible = False

    def _fail_on_worker_death(self) -> int:
        try:
            self.engine.check_workers()
        except SluiceError as exc:
            logger.error("%s", exc)
            self._fail_unfinished(f"the engine core failed: {exc}{self.failure_note}")
            return 1
        raise AssertionError("a sentinel fired while every worker lives")

    def _send_blocking(self, message: Message) -> None:
        data = encode(message)
        if self.stop_requested:
            raise _Stop
        with contextlib.suppress(zmq.Again):
            self.output.send(data, zmq.NOBLOCK)
            return
        # The frontend is not taking outputs (it is gone, or a high-water mark behind): waiting on it
        # is not a hung engine core, so the watchdog stands down until the send goes through.
        was_armed = self.watchdog.armed_at is not None
        self.watchdog.idle()
        self.interruptible = True
        try:
            if self.stop_requested:
                raise _Stop
            self.output.send(data)
        finally:
            self.interruptible = False
        if was_armed:
            self.watchdog.busy()

    def _drain(self) -> None:
        while True:
            try:
                data = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle(data)
        if self.pending:
            self._send_outputs(self.pending)
            self.pending = []

    def _handle(self, data: bytes) -> None:
        try:
            message = decode(data)
        except ProtocolError as exc:
            logger.warning("dropped a malformed message (%d bytes): %s", len(data), exc)
            # A request that named itself is answered, so that it does not hang in the frontend.
            if exc.request_id is not None and not self._is_live(exc.request_id):
                self.pending.append(_error_output(exc.request_id, f"malformed request: {exc}"))
            return
        if isinstance(message, AddRequest):
            self._add_request(message)
        elif isinstance(message, Abort):
            # The scheduler's abort reports one "abort" output per live request and frees its blocks.
            self.pending.extend(self.engine.abort_requests(message.request_ids))
        elif isinstance(message, UtilityCall):
            self._send_blocking(self._utility_result(message))
        else:
            logger.warning(
                "dropped a %s message: the engine core only receives requests", type(message).__name__
            )

    def _add_request(self, message: AddRequest) -> None:
        if self._is_live(message.request_id):
            logger.warning("rejected a duplicate request id %r", message.request_id)
            self.pending.append(
                _error_output(message.request_id, f"request id {message.request_id!r} is already live")
            )
            return
        try:
            self.engine.add_request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                message.arrival_time,
                message.priority,
                message.cache_salt,
                message.pooling,
                message.second_text_start,
            )
        except InvalidRequestError as exc:
            self.pending.append(_error_output(message.request_id, str(exc), exc.param or "request"))
        except SluiceError as exc:
            self.pending.append(_error_output(message.request_id, str(exc)))
        except Exception as exc:  # noqa: BLE001 -- validation missed it; the request fails, the loop goes on.
            logger.error("add_request %r failed:\n%s", message.request_id, traceback.format_exc())
            self.pending.append(_error_output(message.request_id, f"{type(exc).__name__}: {exc}"))

    def _is_live(self, request_id: str) -> bool:
        return self.engine.has_request(request_id)

    def _utility_result(self, call: UtilityCall) -> UtilityResult:
        if call.method == "health":
            return UtilityResult(call.call_id, {"ok": True}, None)
        if call.method == "stats":
            return UtilityResult(call.call_id, stats_to_wire(self._stats()), None)
        if call.method == "kv_cache":
            return UtilityResult(call.call_id, kv_cache_to_wire(self.engine.kv_cache()), None)
        if call.method == "block_pool_audit":
            return UtilityResult(call.call_id, self.engine.audit_block_pool().to_wire(), None)
        return UtilityResult(call.call_id, None, f"unknown utility method {call.method!r}")

    def _step(self) -> bool:
        """One engine step and its outputs message; False when the engine failed."""
        if self.first_step_delay_s:
            time.sleep(self.first_step_delay_s)
            self.first_step_delay_s = 0.0
        try:
            core_outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 -- any failure ends the process, after answering everyone.
            logger.error("the engine failed:\n%s", traceback.format_exc())
            self._fail_unfinished(f"the engine core failed: {type(exc).__name__}: {exc}{self.failure_note}")
            return False
        stats = self._stats()
        if core_outputs or stats != self.last_stats:
            self._send_outputs(core_outputs, stats)
        return True

    def _send_outputs(self, outputs: list[EngineOutput], stats: EngineStats | None = None) -> None:
        stats = stats or self._stats()
        self._send_blocking(Outputs(outputs=outputs, stats=stats, timestamp=time.time()))
        self.last_stats = stats

    def _stats(self) -> EngineStats:
        return self.engine.stats()

    def _fail_unfinished(self, reason: str) -> None:
        """Best effort on the way out: end every accepted request with an error, never block."""
        outputs = self.pending + [_error_output(rid, reason) for rid in self.engine.unfinished_request_ids()]
        self.pending = []
        if not outputs:
            return
        try:
            stats = self._stats()
        except Exception:  # noqa: BLE001 -- a broken engine may not even count; report it empty.
            stats = EngineStats()
        message = Outputs(outputs=outputs, stats=stats, timestamp=time.time())
        try:
            self.output.send(encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.error("could not report %d failed requests: %s", len(outputs), exc)


def _error_output(request_id: str, reason: str, invalid_param: str | None = None) -> EngineOutput:
    return EngineOutput(
        request_id=request_id,
        new_token_ids=[],
        finish_reason="error",
        error=reason,
        invalid_param=invalid_param,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine.engine_core_server",
        description="Sluice's engine core: serves token-id requests to the frontend over ZeroMQ.",
    )
    parser.add_argument("--input", required=True, metavar="ADDR", help="where the frontend's requests arrive")
    parser.add_argument("--output", required=True, metavar="ADDR", help="where outputs are sent")
    parser.add_argument(
        "--restarted-on-failure",
        action="store_true",
        help="a supervisor (sluice serve) restarts this process when it fails; failed requests are told so",
    )
    add_engine_arguments(parser)
    return parser


def _bind(context: zmq.Context, kind: int, address: str) -> zmq.Socket:
    bound = context.socket(kind)
    bound.linger = _LINGER_MS
    bound.ipv6 = "[" in address
    try:
        bound.bind(address)
    except zmq.ZMQError as exc:
        bound.close(0)
        raise UnsafeAddressError(f"cannot bind {address}: {exc}") from None
    return bound


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="sluice engine core: %(levelname)s %(message)s"
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    for address in (args.input, args.output):
        try:
            check_bind_address(address)
        except UnsafeAddressError as exc:
            parser.error(str(exc))
    if args.input == args.output:
        parser.error("--input and --output must differ")
    for address in (args.input, args.output):
        _warn_if_shared(address)

    context = zmq.Context()
    sockets: list[zmq.Socket] = []
    server: EngineCoreServer | None = None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Before the server exists, the model is still loading: leave at once.
        if server is None:
            raise SystemExit(0)
        server.request_stop(signum, frame)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    wakeup_read, wakeup_write = socket.socketpair()
    for end in (wakeup_read, wakeup_write):
        end.setblocking(False)
    signal.set_wakeup_fd(wakeup_write.fileno())
    try:
        sockets.append(_bind(context, zmq.PULL, args.input))
        sockets.append(_bind(context, zmq.PUSH, args.output))
        from engine.engine_core import EngineCore

        engine = EngineCore(config_from_args(args))
        try:
            server = EngineCoreServer(
                engine,
                sockets[0],
                sockets[1],
                args.restarted_on_failure,
                signal_wakeup=wakeup_read,
                # Twice the workers' bound, so that a hung worker ends through the executor's own
                # timeout, whose error names it.
                watchdog_s=2 * engine.config.parallel.step_timeout_s,
            )
            return server.run()
        finally:
            engine.shutdown()
    except SluiceError as exc:
        print(f"sluice engine core: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for bound in sockets:
            bound.close()
        signal.set_wakeup_fd(-1)
        wakeup_read.close()
        wakeup_write.close()
        context.term()


if __name__ == "__main__":
    sys.exit(main())
