"""The one typed configuration that the CLI, the engine core and the workers all read."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]
DType = Literal["bfloat16", "float16", "float32"]
Device = Literal["cpu", "cuda"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # A local Hugging Face folder (config.json, *.safetensors, tokenizer files).
    path: str
    dtype: DType = "bfloat16"
    # None: take the model's max_position_embeddings.
    max_model_len: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    policy: SchedulingPolicy = "fcfs"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gib: float = 2.0
    enable_prefix_caching: bool = True
    # Overrides the memory budget with an exact block count (tests that force preemption).
    num_gpu_blocks_override: int | None = None


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: Device = "cpu"
    # None: let torch decide; otherwise torch.set_num_threads(num_threads).
    num_threads: int | None = None


@dataclass(frozen=True, slots=True)
class SluiceConfig:
    model: ModelConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)


def sluice_cache_dir() -> Path:
    """Where Sluice keeps what it builds once: converted models and compiled kernels."""
    return Path(os.environ.get("SLUICE_CACHE") or Path.home() / ".cache" / "sluice").expanduser()
