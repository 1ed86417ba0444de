"""One worker: owns a device, the model runner on it, and the KV cache sized from a memory budget."""

from __future__ import annotations

import torch

from sluice.config import SluiceConfig
from sluice.errors import DeviceUnavailableError
from sluice.model_spec import ModelSpec
from sluice.worker_seam import SchedulerOutput
from worker.cpu_threads import configure_cpu_threads
from worker.distributed import init_tensor_parallel
from worker.model_runner import ModelRunner, ReceiveBitmask, StepResult
from worker.native_ops import use_cpu_isa


class Worker:
    def __init__(
        self,
        config: SluiceConfig,
        spec: ModelSpec,
        rank: int = 0,
        world_size: int = 1,
        distributed_init_method: str | None = None,
        pin_threads: bool = False,
    ) -> None:
        """pin_threads: this process is the worker's own, so its threads may be pinned to cores (an
        in-process worker shares the caller's process, whose threads are not ours to pin)."""
        self.config = config
        self.rank = rank
        if config.device.device == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError("--device cuda was asked for, but torch sees no CUDA device")
        if config.device.device == "cpu":
            # Before the threads are pinned (the kernel library pins them) and before the model is built.
            use_cpu_isa(config.kernel.cpu_isa)
        configure_cpu_threads(config.device, rank, world_size, pin_threads)
        self.device = torch.device(config.device.device)
        # Before the model is built: its layers read their shard from the tensor-parallel group.
        if world_size > 1:
            assert distributed_init_method is not None, "several ranks need a rendezvous"
            init_tensor_parallel(rank, world_size, distributed_init_method, self.device)
        self.model_runner = ModelRunner(config, spec, self.device)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(
        self, scheduler_output: SchedulerOutput, receive_bitmask: ReceiveBitmask | None = None
    ) -> StepResult:
        return self.model_runner.execute_model(scheduler_output, receive_bitmask)
