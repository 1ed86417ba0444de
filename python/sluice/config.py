"""The one typed configuration that the CLI, the engine core and the workers all read."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

SchedulingPolicy = Literal["fcfs", "priority"]
DType = Literal["bfloat16", "float16", "float32"]
Device = Literal["cpu", "cuda"]
# "mp": one worker process per tensor-parallel rank; "inproc": the worker inside the engine core (TP=1).
ExecutorBackend = Literal["mp", "inproc"]
# Which captured forms the graph dispatcher may pick (vLLM's cudagraph_mode, lower-cased).
GraphMode = Literal["full_and_piecewise", "full", "piecewise", "none"]
# The namespace of the frontend's /metrics names: "vllm" renders vLLM's exact names, for its dashboards.
MetricsPrefix = Literal["sluice", "vllm"]
# Where draft tokens come from: "ngram" looks them up in the request's own tokens (prompt lookup).
SpeculativeMethod = Literal["ngram"]
# The attention kernel on CUDA: "auto" (flash-attn where it imports and fits the cache, else Triton).
CudaAttentionBackend = Literal["auto", "flash_attn", "triton"]
Quantization = Literal["int8", "int4"]
# The KV cache's element type: "auto" is the model's dtype; int8 and fp8_e4m3 keep each cached row as one
# byte per value plus a float32 scale (csrc/cpu/kv_quant.h), read by the CPU kernels at every tier.
KvCacheDType = Literal["auto", "int8", "fp8_e4m3"]
# Values per block of the integer GEMM's quantized weights (csrc/cpu/quant_weight.h kQuantBlock).
QUANTIZATION_BLOCK = 32


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # A local Hugging Face folder (config.json, *.safetensors, tokenizer files) or a .gguf file.
    path: str
    dtype: DType = "bfloat16"
    # None: take the model's max_position_embeddings.
    max_model_len: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    policy: SchedulingPolicy = "fcfs"
    # Two batches in flight: step N+1 is planned, with placeholders, while step N runs.
    async_scheduling: bool = True
    # A structured request's next-token bitmask is computed while its step's forward runs (sent
    # after the step): under async scheduling, once the step before it is folded in, so that a
    # structured request is planned while its last token is in flight. Off: computed before the
    # step is sent, and a structured request waits for its in-flight token.
    structured_output_overlap: bool = True
    # A CPU worker's step has run to the end when it returns: its output goes to the engine core at
    # once, before the worker runs the step waiting behind it, so the engine core folds it in and plans
    # the step after next while that one runs. False: the output goes after the next step, as on
    # CUDA always, where launching the waiting step first keeps the GPU busy while tokens come back.
    early_step_output: bool = True


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gib: float = 2.0
    kv_cache_dtype: KvCacheDType = "auto"
    enable_prefix_caching: bool = True
    # Overrides the memory budget with an exact block count (tests that force preemption).
    num_gpu_blocks_override: int | None = None
    # Publish the prefix cache's changes (KV events) for routers on a ZeroMQ PUB socket bound on
    # tcp://HOST:PORT; None: publish nothing and build no events.
    kv_events_port: int | None = None
    # Loopback unless widened: a router on another host (a pod, a container) needs 0.0.0.0.
    kv_events_host: str = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    executor: ExecutorBackend = "mp"
    # Replicas that `sluice serve` starts behind the router, each pinned to its share of the cores;
    # an engine core is always one replica.
    data_parallel_size: int = 1
    # Seconds the engine core waits for a step's result from its worker processes before it takes
    # them for hung (a stuck collective, a deadlock): it then fails every request in flight and
    # exits non-zero, and `sluice serve` starts a new one. vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS;
    # 0 waits forever. The engine core's watchdog ends the process when it stays busy for twice this
    # (a hang in the engine core itself, or in the in-process executor's forward pass).
    step_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class GraphConfig:
    # Run every step eagerly: no graphs on CUDA, no fused C++ step on CPU.
    enforce_eager: bool = False
    mode: GraphMode = "full_and_piecewise"
    # Batch sizes, in tokens, that get a captured graph; None: the default ladder up to max_num_seqs.
    capture_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: Device = "cpu"
    # Threads per worker; None: the cores this process may use, divided among the ranks.
    num_threads: int | None = None
    # CPU cores the workers' threads are pinned to, one thread per core: "auto" (the allowed cores,
    # split among the ranks), "none" (no pinning), or a list such as "0-1" or "0,1|2,3" (ranks split by |).
    cpu_bind: str = "auto"
    # How long an idle OpenMP thread of a worker process spins before it sleeps (libgomp's
    # GOMP_SPINCOUNT): "auto" (10,000, unless the environment sets GOMP_SPINCOUNT or
    # OMP_WAIT_POLICY), "inherit" (the environment's, else libgomp's 300,000), or a count.
    omp_spin_count: str = "auto"


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Which kernels a worker runs. Each switch turns one optimisation off, so its gain can be measured."""

    # CPU: the instruction-set tier of Sluice's kernels (sluice/cpu_tiers.py): "auto" (the best this CPU
    # runs), a tier's name (avx512bf16, avx512, avx2, neon), which must be one this CPU runs, or "none"
    # (torch's own ops; no Sluice kernel).
    cpu_isa: str = "auto"
    # CPU: linear weights (bf16, fp16 or fp32) packed at load for the tier's GEMM; False keeps them as
    # loaded, for torch's matmul (and every step then runs eagerly: the fused step multiplies packed weights).
    packed_linear: bool = True
    # CPU, the avx512bf16 tier's bf16-pair GEMM: it takes K in blocks at 7-64 rows, prefetching the next
    # block while it computes from cache; False reads each column group whole (its first row tile waits on
    # memory). Marked on each packed weight at load, so two models in one process may differ. The FMA GEMM
    # of the other tiers keeps a tall block's weights in L2 instead, so there the mark changes nothing.
    gemm_k_blocks: bool = True
    # CPU, where packed_linear packs: each MLP's gate_up weight packed so that its GEMM writes
    # silu(gate) * up from the epilogue (same bits); False writes gate and up, then runs silu_and_mul.
    fused_gate_up: bool = True
    # CPU, a GGUF file: its quantized linear weights are dequantized to the model dtype at load, for the
    # float GEMM; False (the default) keeps them quantized for the integer GEMM (worker/quantized_weights.py).
    gguf_dequantize: bool = False
    # CPU: quantize a Hugging Face folder's linear weights (and LM head) at load for the integer GEMM:
    # "int8" (8 bits in blocks of 32, one float16 scale each) or "int4" (4 bits in blocks of 32 with a
    # float16 scale and minimum each); None keeps them in the model dtype. A GGUF file is quantized already.
    quantization: Quantization | None = None
    # CPU: one-token (decode) attention on its own path; False sends it through the general tile path.
    cpu_decode_attention: bool = True
    # CPU, on that decode path: where a batch has too few one-token sequences (times KV heads) to share
    # out evenly among the threads, each one's keys are split into parts, attended in parallel and merged
    # (at least 512 keys a part). False leaves a thread idle instead, as one sequence with 3 KV heads on
    # 2 threads does. The parts' sums round differently from one pass, so the bits differ slightly.
    cpu_decode_split_keys: bool = True
    # CPU: greedy rows pick by Sluice's one-pass argmax kernel; False uses torch.argmax.
    native_argmax: bool = True
    cuda_attention_backend: CudaAttentionBackend = "auto"


@dataclass(frozen=True, slots=True)
class EngineRestartConfig:
    """How `sluice serve` replaces a replica's engine core that died, while its frontend stays up."""

    enabled: bool = True
    # A death beyond this many restarts within window_s ends `sluice serve` with a non-zero status,
    # so that the orchestrator (Kubernetes, Docker) takes over.
    max_restarts: int = 5
    window_s: float = 300.0
    # The first restart within the window waits this long, each further one twice as long as the last.
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        assert self.max_restarts >= 0 and self.window_s > 0
        assert 0 <= self.backoff_s <= self.backoff_max_s


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: guess up to K next tokens cheaply, check them all in one forward pass."""

    # None: off.
    method: SpeculativeMethod | None = None
    num_speculative_tokens: int = 4
    # The n-gram lengths tried, longest first: the request's last n tokens are looked up earlier in it.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True, slots=True)
class SluiceConfig:
    model: ModelConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


def steps_in_flight(config: SluiceConfig) -> int:
    """Steps the engine core keeps submitted: two under async scheduling, one otherwise.

    Speculative decoding runs one: drafts are looked up after the last token is known, and under
    async scheduling the next step is planned before it is."""
    return 2 if config.scheduler.async_scheduling and not config.speculative.enabled else 1


def config_to_dict(config: SluiceConfig) -> dict[str, Any]:
    """Plain values only, for handing the config to a worker process (msgpack, no pickle)."""
    return asdict(config)


def config_from_dict(data: dict[str, Any]) -> SluiceConfig:
    """The inverse of config_to_dict: rebuilds every section, tuples included."""
    sections = {}
    for section in fields(SluiceConfig):
        kind = _SECTION_TYPES[section.name]
        values = dict(data[section.name])
        for name, value in values.items():
            if isinstance(value, list):
                values[name] = tuple(value)
        sections[section.name] = kind(**values)
    return SluiceConfig(**sections)


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "parallel": ParallelConfig,
    "graph": GraphConfig,
    "device": DeviceConfig,
    "kernel": KernelConfig,
    "speculative": SpeculativeConfig,
}
assert all(is_dataclass(kind) for kind in _SECTION_TYPES.values())


def sluice_cache_dir() -> Path:
    """Where Sluice keeps what it builds once: converted models and compiled kernels."""
    return Path(os.environ.get("SLUICE_CACHE") or Path.home() / ".cache" / "sluice").expanduser()
