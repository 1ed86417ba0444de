"""One worker: owns a device, the model runner on it, and the KV cache sized from a memory budget."""

from __future__ import annotations

import torch

from sluice.config import SluiceConfig
from sluice.cpu_binding import threads_per_rank, usable_cores
from sluice.errors import DeviceUnavailableError
from sluice.model_spec import ModelSpec
from sluice.worker_seam import SchedulerOutput
from worker.distributed import init_tensor_parallel
from worker.model_runner import ModelRunner, StepResult


class Worker:
    def __init__(
        self,
        config: SluiceConfig,
        spec: ModelSpec,
        rank: int = 0,
        world_size: int = 1,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        if config.device.device == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError("--device cuda was asked for, but torch sees no CUDA device")
        torch.set_num_threads(threads_per_rank(config.device, world_size, usable_cores()))
        self.device = torch.device(config.device.device)
        # Before the model is built: its layers read their shard from the tensor-parallel group.
        if world_size > 1:
            assert distributed_init_method is not None, "several ranks need a rendezvous"
            init_tensor_parallel(rank, world_size, distributed_init_method, self.device)
        self.model_runner = ModelRunner(config, spec, self.device)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepResult:
        return self.model_runner.execute_model(scheduler_output)
