"""One worker: owns a device, the model runner on it, and the KV cache sized from a memory budget."""

from __future__ import annotations

import torch

from sluice.config import SluiceConfig
from sluice.errors import DeviceUnavailableError, KVCacheTooSmallError
from sluice.model_spec import ModelSpec
from sluice.worker_seam import ModelRunnerOutput, SchedulerOutput
from worker.model_runner import ModelRunner

GIB = 1 << 30


class Worker:
    def __init__(self, config: SluiceConfig, spec: ModelSpec) -> None:
        self.config = config
        if config.device.device == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError("--device cuda was asked for, but torch sees no CUDA device")
        if config.device.num_threads is not None:
            torch.set_num_threads(config.device.num_threads)
        self.device = torch.device(config.device.device)
        self.model_runner = ModelRunner(config, spec, self.device)

    def determine_num_blocks(self) -> int:
        """How many KV blocks the memory budget holds; at least one max_model_len request must fit."""
        cache = self.config.cache
        runner = self.model_runner
        bytes_per_block = runner.kv_cache_bytes_per_block()
        num_blocks = cache.num_gpu_blocks_override or int(cache.kv_cache_memory_gib * GIB // bytes_per_block)
        blocks_per_request = -(-runner.max_model_len // cache.block_size)
        if num_blocks < blocks_per_request:
            need_gib = blocks_per_request * bytes_per_block / GIB
            raise KVCacheTooSmallError(
                f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens "
                f"({cache.kv_cache_memory_gib} GiB), but one request of max_model_len "
                f"{runner.max_model_len} needs {blocks_per_request} blocks ({need_gib:.3f} GiB): "
                "raise --kv-cache-memory or lower --max-model-len"
            )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
