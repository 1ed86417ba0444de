"""How the engine core reaches its workers: one process per rank (the default), or one in this process.

Both executors keep steps in order: submit() hands a step over without waiting, collect() returns
the oldest submitted step's output. That is all the async batch queue needs: it submits step N+1
before it collects step N.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from sluice.config import SluiceConfig
from sluice.model_spec import ModelSpec
from sluice.worker_seam import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send one step to every rank without waiting for it."""
        ...

    def submit_bitmask(self, bitmask: GrammarBitmask) -> None:
        """Send the structured output bitmask of the step submitted last, which is waiting for it."""
        ...

    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest submitted step's output; raises WorkerDiedError if a worker is gone."""
        ...

    def sentinels(self) -> list[int]:
        """File descriptors that turn readable when a worker dies, for the engine core's idle wait."""
        ...

    def check_workers(self) -> None:
        """Raise WorkerDiedError if a worker has exited."""
        ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """The worker in the engine core's own process: a step runs when it is collected."""

    def __init__(self, config: SluiceConfig, spec: ModelSpec) -> None:
        from worker.worker import Worker

        assert config.parallel.tensor_parallel_size == 1, "in-process execution has one rank"
        self.worker = Worker(config, spec)
        self.pending: deque[SchedulerOutput] = deque()
        self.bitmasks: dict[int, GrammarBitmask] = {}

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.pending.append(scheduler_output)

    def submit_bitmask(self, bitmask: GrammarBitmask) -> None:
        self.bitmasks[bitmask.step_id] = bitmask

    def collect(self) -> ModelRunnerOutput:
        return self.worker.execute_model(self.pending.popleft(), self.bitmasks.pop).output()

    def sentinels(self) -> list[int]:
        return []

    def check_workers(self) -> None:
        return None

    def shutdown(self) -> None:
        self.pending.clear()
        self.bitmasks.clear()


def make_executor(config: SluiceConfig, spec: ModelSpec) -> Executor:
    if config.parallel.executor == "inproc":
        return InProcessExecutor(config, spec)
    from engine.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config)
