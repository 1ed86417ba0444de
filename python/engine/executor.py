"""How the engine core reaches its workers. Today one worker in this process; later, over ZMQ."""

from __future__ import annotations

from sluice.config import SluiceConfig
from sluice.model_spec import ModelSpec
from sluice.worker_seam import ModelRunnerOutput, SchedulerOutput


class InProcessExecutor:
    def __init__(self, config: SluiceConfig, spec: ModelSpec) -> None:
        from worker.worker import Worker

        self.worker = Worker(config, spec)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
