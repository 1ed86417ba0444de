"""A worker process: one tensor-parallel rank, driven by the engine core over ZeroMQ.

    python -m worker.worker_process --rank R --world-size N --input ADDR --output ADDR
        --dist-init URL --config JSON

It loads its shard of the model, reports `worker_ready`, allocates the KV cache on `init_kv_cache`,
then runs every `scheduler_output` it receives, in order; rank 0 answers each with a
`model_runner_output`. On `shutdown` it exits 0. Any failure is reported as `worker_error` before
the process exits 1, so the engine core can fail what is in flight with the reason. It dies with
the engine core (a parent-death signal), so no worker outlives it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
import traceback

import zmq

from sluice.config import config_from_dict
from sluice.model_spec import read_model_spec
from sluice.step_timing import PhaseTimes
from sluice.worker_seam import (
    GrammarBitmask,
    InitKVCache,
    KVCacheReady,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerReady,
    decode,
    encode,
)
from worker.distributed import destroy_tensor_parallel
from worker.model_runner import StepResult
from worker.worker import Worker

logger = logging.getLogger("sluice.worker")

_PR_SET_PDEATHSIG = 1
# A test hook: the worker stalls this many seconds before its first step, as a hung collective would.
STALL_FIRST_STEP_ENV = "SLUICE_TEST_WORKER_STALL_S"


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.worker_process", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--input", required=True, metavar="ADDR", help="where steps arrive (PULL)")
    parser.add_argument("--output", required=True, metavar="ADDR", help="where replies go (PUSH)")
    parser.add_argument("--dist-init", required=True, metavar="URL", help="torch.distributed init method")
    parser.add_argument("--config", required=True, metavar="JSON", help="the SluiceConfig, as plain values")
    return parser


def serve_steps(rank: int, worker: Worker, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
    """Answer the engine core's messages until it says shutdown.

    A step's tokens reach the host only when its output is sent. On a GPU, when the next step is
    already waiting (async scheduling), it is launched first: the device then never idles while the
    host copies tokens back. The next step reads the sampled ids on the device either way. A CPU
    step has run to the end when it returns, and nothing would be kept busy by waiting: with
    early_step_output its output goes at once, and the engine core folds it in while the next runs.
    """
    outputs.send(encode(WorkerReady(rank=rank)))
    send_at_once = worker.device.type == "cpu" and worker.config.scheduler.early_step_output
    pending: StepResult | None = None
    stall_s = float(os.environ.get(STALL_FIRST_STEP_ENV) or 0.0)

    def receive_bitmask(step_id: int) -> GrammarBitmask:
        # The engine core may compute this step's masks only from the previous step's tokens:
        # those go out first, while this step's forward is launched.
        nonlocal pending
        if pending is not None:
            _send_output(rank, pending, outputs, worker.model_runner.timer)
            pending = None
        return _receive_bitmask(inputs, step_id)

    while True:
        if pending is not None and (send_at_once or not inputs.poll(0)):
            _send_output(rank, pending, outputs, worker.model_runner.timer)
            pending = None
        message = decode(inputs.recv())
        if isinstance(message, SchedulerOutput):
            if stall_s:
                time.sleep(stall_s)
                stall_s = 0.0
            launched = worker.execute_model(message, receive_bitmask)
            if pending is not None:
                _send_output(rank, pending, outputs, worker.model_runner.timer)
            pending = launched
        elif isinstance(message, InitKVCache):
            worker.initialize_kv_cache(message.num_blocks)
            outputs.send(encode(KVCacheReady(rank=rank)))
        elif isinstance(message, Shutdown):
            return
        else:
            raise TypeError(f"a worker does not take {type(message).__name__} messages")


def _receive_bitmask(inputs: zmq.Socket, step_id: int) -> GrammarBitmask:
    """A structured step's bitmask: the next input message after the step (sent at once, or once the
    step before it is folded in)."""
    message = decode(inputs.recv())
    if not isinstance(message, GrammarBitmask) or message.step_id != step_id:
        raise TypeError(f"expected the grammar bitmask of step {step_id}, got {message!r:.200}")
    return message


def _send_output(rank: int, step: StepResult, outputs: zmq.Socket, timer: PhaseTimes) -> None:
    since = timer.start()
    output = step.output()
    if rank == 0:
        outputs.send(encode(output))
    timer.lap("send_output", since)


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"sluice worker {args.rank}: %(levelname)s %(message)s"
    )
    # The engine core stops workers with `shutdown`; a terminal's Ctrl-C reaches the engine core only.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    outputs = context.socket(zmq.PUSH)
    inputs.connect(args.input)
    outputs.connect(args.output)
    try:
        config = config_from_dict(json.loads(args.config))
        worker = Worker(
            config,
            read_model_spec(config.model.path),
            rank=args.rank,
            world_size=args.world_size,
            distributed_init_method=args.dist_init,
            pin_threads=True,
        )
        serve_steps(args.rank, worker, inputs, outputs)
        worker.model_runner.timer.report()
        destroy_tensor_parallel()
        return 0
    except Exception as exc:  # noqa: BLE001 -- any failure is reported to the engine core, then we exit.
        logger.error("failed:\n%s", traceback.format_exc())
        with contextlib.suppress(zmq.ZMQError):
            outputs.send(encode(WorkerError(rank=args.rank, message=f"{type(exc).__name__}: {exc}")))
        return 1
    finally:
        # Let a final message reach the engine core before the sockets go.
        outputs.linger = 2000
        inputs.close(0)
        outputs.close()
        context.term()


def exit_now(status: int) -> None:
    """Exit without the interpreter's teardown: with torch loaded it takes about a second, which a
    stopping engine core would wait for. The sockets are closed and their messages sent by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
