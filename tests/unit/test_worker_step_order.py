"""The order in which a worker process runs steps and sends their outputs (worker_process.serve_steps).

The worker is a stand-in that records what happens; the sockets are real ZeroMQ ones. Two steps and a
shutdown wait in the queue before the loop starts, as under async scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
import zmq

from sluice.config import SchedulerConfig
from sluice.step_timing import PhaseTimes
from sluice.worker_seam import (
    CachedRequestData,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerReady,
    decode,
    encode,
)
from worker.worker_process import serve_steps


@dataclass
class RecordingWorker:
    device: torch.device
    config: SimpleNamespace
    events: list[str] = field(default_factory=list)
    model_runner: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(timer=PhaseTimes("test")))

    def execute_model(self, scheduler_output: SchedulerOutput, receive_bitmask) -> SimpleNamespace:
        step_id = scheduler_output.step_id
        self.events.append(f"run {step_id}")

        def output() -> ModelRunnerOutput:
            self.events.append(f"send {step_id}")
            return ModelRunnerOutput(step_id, [], [], [], 0)

        return SimpleNamespace(output=output)


def empty_step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id, [], CachedRequestData([], [], [], [], []), {}, 0, [], [])


def run_loop(device: str, early_step_output: bool) -> tuple[list[str], list[object]]:
    context = zmq.Context()
    to_worker, worker_inputs = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    worker_outputs, from_worker = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    worker_inputs.bind("inproc://steps")
    to_worker.connect("inproc://steps")
    from_worker.bind("inproc://outputs")
    worker_outputs.connect("inproc://outputs")
    try:
        for message in (empty_step(0), empty_step(1), Shutdown()):
            to_worker.send(encode(message))
        assert worker_inputs.poll(5000), "the steps did not arrive"
        config = SimpleNamespace(scheduler=SchedulerConfig(early_step_output=early_step_output))
        worker = RecordingWorker(torch.device(device), config)
        serve_steps(0, worker, worker_inputs, worker_outputs)  # type: ignore[arg-type]
        received = []
        while from_worker.poll(1000):
            received.append(decode(from_worker.recv()))
        return worker.events, received
    finally:
        for socket in (to_worker, worker_inputs, worker_outputs, from_worker):
            socket.close(0)
        context.term()


def test_a_cpu_worker_sends_each_output_before_it_runs_the_next_step():
    events, received = run_loop("cpu", early_step_output=True)
    assert events == ["run 0", "send 0", "run 1", "send 1"]
    assert isinstance(received[0], WorkerReady)
    assert [message.step_id for message in received[1:]] == [0, 1]


@pytest.mark.parametrize(
    ("device", "early_step_output"), [("cpu", False), ("cuda", True)], ids=["cpu-switched-off", "cuda"]
)
def test_otherwise_the_waiting_step_is_launched_before_the_output_goes(device, early_step_output):
    events, received = run_loop(device, early_step_output)
    # Step 1's output would go only when the loop finds nothing waiting; the shutdown is.
    assert events == ["run 0", "run 1", "send 0"]
    assert [message.step_id for message in received[1:]] == [0]
