"""The one typed configuration that the CLI, the engine core and the workers all read."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, get_type_hints

from sluice.config_option import setting
from sluice.cpu_tiers import CPU_ISA_CHOICES

SchedulingPolicy = Literal["fcfs", "priority"]
DType = Literal["bfloat16", "float16", "float32"]
Device = Literal["cpu", "cuda"]
# "mp": one worker process per tensor-parallel rank; "inproc": the worker inside the engine core (TP=1).
ExecutorBackend = Literal["mp", "inproc"]
# Which captured forms the graph dispatcher may pick (vLLM's cudagraph_mode, lower-cased).
GraphMode = Literal["full_and_piecewise", "full", "piecewise", "none"]
# Where draft tokens come from: "ngram" looks them up in the request's own tokens (prompt lookup).
SpeculativeMethod = Literal["ngram"]
# The attention kernel on CUDA: "auto" (flash-attn where it imports and fits the cache, else Triton).
CudaAttentionBackend = Literal["auto", "flash_attn", "triton"]
Quantization = Literal["int8", "int4"]
# What the server answers with: "generate" (tokens), "pooling" (embeddings: sluice/pooling.py), or "auto":
# pooling for an embedding model (a sentence-transformers folder, or a base model with no LM head).
RunnerChoice = Literal["auto", "generate", "pooling"]
# The KV cache's element type: "auto" is the model's dtype; int8 and fp8_e4m3 keep each cached row as one
# byte per value plus a float32 scale (csrc/cpu/kv_quant.h), read by the CPU kernels at every tier.
KvCacheDType = Literal["auto", "int8", "fp8_e4m3"]
# Spins before an idle OpenMP thread of a worker sleeps under --omp-spin-count auto, unless the environment
# says otherwise (sluice/cpu_binding.py).
DEFAULT_OMP_SPIN_COUNT = 10_000
# Values per block of the integer GEMM's quantized weights (csrc/cpu/quant_weight.h kQuantBlock).
QUANTIZATION_BLOCK = 32


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # A local Hugging Face folder (config.json, *.safetensors, tokenizer files) or a .gguf file; its option
    # (`--model`, or `sluice serve`'s positional MODEL) is declared by engine_args, with the default model.
    path: str
    dtype: DType = setting("bfloat16", "the element type of the weights and activations")
    max_model_len: int | None = setting(
        None, "context length served (default: the model's max_position_embeddings)", at_least=1
    )
    runner: RunnerChoice = setting(
        "auto",
        "generate (completions, chat, messages, responses) or pooling (/v1/embeddings); auto: pooling "
        "for an embedding model (a sentence-transformers folder, or a base model with no LM head)",
    )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = setting(128, "most requests in one step", at_least=1)
    max_num_batched_tokens: int = setting(2048, "token budget of one step", at_least=1)
    policy: SchedulingPolicy = setting(
        "fcfs",
        "the order of the waiting queue: fcfs, or priority (a request's priority, then its arrival)",
        flag="--scheduling-policy",
    )
    # Two batches in flight: step N+1 is planned, with placeholders, while step N runs.
    async_scheduling: bool = setting(True, "plan step N+1 while step N runs (two batches in flight)")
    # A structured request's next-token bitmask is computed while its step's forward runs (sent
    # after the step): under async scheduling, once the step before it is folded in, so that a
    # structured request is planned while its last token is in flight. Off: computed before the
    # step is sent, and a structured request waits for its in-flight token.
    structured_output_overlap: bool = setting(
        True, "compute structured output bitmasks while the forward pass runs"
    )
    # A CPU worker's step has run to the end when it returns: its output goes to the engine core at
    # once, before the worker runs the step waiting behind it, so the engine core folds it in and plans
    # the step after next while that one runs. False: the output goes after the next step, as on
    # CUDA always, where launching the waiting step first keeps the GPU busy while tokens come back.
    early_step_output: bool = setting(
        True, "CPU: a worker sends each step's tokens before it runs the next step, not after"
    )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV block", at_least=1)
    kv_cache_memory_gib: float = setting(
        2.0,
        "KV cache budget of each worker (tensor-parallel rank) in GiB",
        flag="--kv-cache-memory",
        metavar="GIB",
        above=0.0,
    )
    kv_cache_dtype: KvCacheDType = setting(
        "auto",
        "the KV cache's element type: auto (the model's --dtype), or, on CPU, int8 or fp8_e4m3 (one byte per "
        "value and a scale per cached row: about twice the tokens in the same --kv-cache-memory)",
    )
    enable_prefix_caching: bool = setting(True, "share KV blocks between requests with a common prefix")
    # sluice/kv_cache_groups.py: a model whose layers have different windows (Gemma 2 and 3, Qwen2's
    # max_window_layers) keeps a block table per group of layers, and its sliding-window layers release
    # the blocks their windows left. Off: one block table for every layer, each holding the whole context.
    hybrid_kv_cache: bool = setting(
        True,
        "a model with sliding-window and full-attention layers: give each kind its own block tables, so that "
        "its windowed layers hold only the blocks their window sees (--no-hybrid-kv-cache: every layer holds "
        "the whole context)",
    )
    # Overrides the memory budget with an exact block count (tests that force preemption).
    num_gpu_blocks_override: int | None = setting(
        None, "exact number of KV blocks, overriding --kv-cache-memory", flag="--num-kv-blocks", at_least=1
    )
    # Publish the prefix cache's changes (KV events) for routers on a ZeroMQ PUB socket bound on
    # tcp://HOST:PORT; None: publish nothing and build no events.
    kv_events_port: int | None = setting(
        None,
        "publish KV-cache events for cache-aware routers on tcp://HOST:PORT (needs prefix caching)",
        metavar="PORT",
        at_least=1,
        at_most=65535,
    )
    # Loopback unless widened: a router on another host (a pod, a container) needs 0.0.0.0.
    kv_events_host: str = setting(
        "127.0.0.1",
        "the address the KV-events socket binds: loopback by default; 0.0.0.0 for a router on another host",
        metavar="HOST",
    )


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = setting(
        1,
        "worker processes that split each layer's heads (gloo on CPU, NCCL on CUDA)",
        alias="-tp",
        at_least=1,
    )
    executor: ExecutorBackend = setting(
        "mp", "mp: one worker process per rank; inproc: the worker inside the engine core (TP 1 only)"
    )
    # An engine core is always one replica; `sluice serve` starts these behind the router.
    data_parallel_size: int = setting(
        1,
        "replicas, each pinned to its share of the cores, behind sluice-router on --port",
        alias="-dp",
        at_least=1,
        scope="serve",
    )
    # A stuck collective or a deadlock in the workers: vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS.
    step_timeout_s: float = setting(
        300.0,
        "how long the engine core waits for a step from its worker processes before it takes them for hung, "
        "fails the requests in flight and exits (sluice serve then restarts it); an engine core busy for twice "
        "this without getting back to its loop is ended by a watchdog; 0: forever",
        metavar="S",
        at_least=0.0,
    )


@dataclass(frozen=True, slots=True)
class GraphConfig:
    enforce_eager: bool = setting(
        False, "no graphs: every step runs op by op (CUDA graphs off; the fused C++ step off on CPU)"
    )
    mode: GraphMode = setting(
        "full_and_piecewise", "which captured forms the graph dispatcher may use", flag="--graph-mode"
    )
    # None: the default ladder up to max_num_seqs.
    capture_sizes: tuple[int, ...] | None = setting(
        None,
        "batch sizes (tokens) to capture graphs for; each at most --max-num-seqs",
        metavar="N,N,...",
        at_least=1,
    )


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: Device = setting("cpu", "where the model runs")
    # None: the cores this process may use, divided among the ranks.
    num_threads: int | None = setting(
        None, "CPU threads per worker (default: the usable cores divided among the ranks)", at_least=1
    )
    # "auto": the allowed cores, split among the ranks; ranks of a list are split by |.
    cpu_bind: str = setting(
        "auto",
        "pin each worker thread to a core: auto, none, or cores such as 0-1 (ranks split by |)",
        metavar="auto|none|LIST",
    )
    # libgomp's GOMP_SPINCOUNT for the worker processes.
    omp_spin_count: str = setting(
        "auto",
        "spins before an idle OpenMP thread of a worker process sleeps (GOMP_SPINCOUNT): auto is "
        f"{DEFAULT_OMP_SPIN_COUNT} unless the environment sets GOMP_SPINCOUNT or OMP_WAIT_POLICY; inherit "
        "leaves the environment's (else libgomp's 300000)",
        metavar="auto|inherit|N",
    )


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Which kernels a worker runs. Each switch turns one optimisation off, so its gain can be measured."""

    # The tiers are sluice/cpu_tiers.py's; "none" runs torch's own ops.
    cpu_isa: str = setting(
        "auto",
        "CPU: the instruction-set tier of Sluice's kernels: auto (the best this CPU runs), a tier this CPU "
        "runs, or none (torch's own ops); `sluice info` lists them",
        choices=CPU_ISA_CHOICES,
    )
    # Every step runs eagerly without packed weights: the fused step multiplies packed weights.
    packed_linear: bool = setting(
        True,
        "CPU: pack linear weights at load for the tier's GEMM; --no-packed-linear keeps them as loaded, for "
        "torch's matmul, and runs every step eagerly",
    )
    # Marked on each packed weight at load, so two models in one process may differ. The FMA GEMM of the
    # other tiers keeps a tall block's weights in L2 instead, and the mark lets it prefetch the next span.
    gemm_k_blocks: bool = setting(
        True,
        "CPU, the packed GEMM streams its next weights while it computes: the avx512bf16 tier's bf16-pair GEMM "
        "takes K in blocks at 7-64 rows and prefetches the next block, the other tiers' FMA GEMM prefetches a "
        "thread's next span of column groups during the later row tiles of the current one (7-240 rows); "
        "--no-gemm-k-blocks does neither (same bits)",
    )
    # Same bits either way.
    fused_gate_up: bool = setting(
        True,
        "CPU: pack each MLP's gate_up weight so that its GEMM writes silu(gate) * up from the epilogue; "
        "--no-fused-gate-up writes gate and up, then applies the activation over them",
    )
    fused_moe: bool = setting(
        True,
        "a mixture-of-experts model: run each MoE layer in one kernel call that groups the tokens by expert "
        "(on CPU csrc/cpu/moe.cpp inside the C++ model step; on CUDA two Triton launches that FULL graphs "
        "capture); --no-fused-moe runs the same GEMMs one expert at a time from Python, eagerly",
    )
    # The quantized path is worker/quantized_weights.py.
    gguf_dequantize: bool = setting(
        False,
        "CPU, a GGUF file: dequantize its quantized linear weights to --dtype at load, for the float GEMM; by "
        "default they stay quantized and run on the integer GEMM",
    )
    # A decoder's LM head too (a cross-encoder's head stays float); a GGUF file is quantized already.
    quantization: Quantization | None = setting(
        None,
        "CPU: quantize a Hugging Face folder's linear weights at load for the integer GEMM: int8 (blocks of 32 "
        "with a scale each) or int4 (blocks of 32 with a scale and a minimum each)",
    )
    cpu_decode_attention: bool = setting(
        True, "CPU: run one-token (decode) attention on its own kernel path rather than the general tile path"
    )
    cpu_encoder_kernels: bool = setting(
        True,
        "CPU: an encoder's (BERT, XLM-RoBERTa) attention runs every sequence of a step in one kernel call, "
        "reading q, k and v in place, and its GELU in place on Sluice's kernel; --no-cpu-encoder-kernels runs "
        "torch's SDPA one sequence at a time and torch's GELU",
    )
    # One sequence with 3 KV heads on 2 threads leaves a thread idle without it. The parts' sums round
    # differently from one pass, so the bits differ slightly.
    cpu_decode_split_keys: bool = setting(
        True,
        "CPU: where too few sequences decode to keep every thread busy in attention, split each one's keys "
        "(512 or more) among the threads and merge the parts",
    )
    native_argmax: bool = setting(
        True,
        "CPU: greedy rows pick their token with Sluice's one-pass argmax kernel rather than torch.argmax",
    )
    cuda_attention_backend: CudaAttentionBackend = setting(
        "auto", "CUDA: auto picks flash-attn where it imports and fits the KV cache, else Triton"
    )


@dataclass(frozen=True, slots=True)
class EngineRestartConfig:
    """How `sluice serve` replaces a replica's engine core that died, while its frontend stays up."""

    enabled: bool = setting(
        True,
        "restart an engine core that died (or whose worker died), with backoff, while its frontend stays up; "
        "--no-restart-engine exits with status 3 instead",
        flag="--restart-engine",
        scope="serve",
    )
    # Beyond it `sluice serve` ends non-zero, so that the orchestrator (Kubernetes, Docker) takes over.
    max_restarts: int = setting(
        5,
        "give up (exit 3) when an engine core dies after N restarts within --engine-restart-window-s",
        flag="--max-engine-restarts",
        metavar="N",
        at_least=0,
        scope="serve",
    )
    window_s: float = setting(
        300.0,
        "the window, in seconds, over which --max-engine-restarts counts",
        flag="--engine-restart-window-s",
        metavar="S",
        above=0.0,
        scope="serve",
    )
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
    method: SpeculativeMethod | None = setting(
        None,
        "speculative decoding: ngram proposes tokens found earlier in the request (prompt lookup); greedy "
        "requests only, and one step in flight (it turns async scheduling off)",
        flag="--speculative",
    )
    num_speculative_tokens: int = setting(
        4, "most draft tokens verified per request and step", metavar="K", at_least=1
    )
    # The request's last n tokens are looked up earlier in it, the longest n first.
    prompt_lookup_min: int = setting(
        2,
        "shortest n-gram of the request's last tokens that the ngram proposer looks up",
        flag="--ngram-prompt-lookup-min",
        metavar="N",
        at_least=1,
    )
    prompt_lookup_max: int = setting(
        4,
        "longest n-gram that the ngram proposer looks up (it tries the longest first)",
        flag="--ngram-prompt-lookup-max",
        metavar="N",
        at_least=1,
    )

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
    for name, kind in SECTION_TYPES.items():
        values = dict(data[name])
        for field_name, value in values.items():
            if isinstance(value, list):
                values[field_name] = tuple(value)
        sections[name] = kind(**values)
    return SluiceConfig(**sections)


# Each section of SluiceConfig by its field's name, in declaration order.
SECTION_TYPES: dict[str, type] = get_type_hints(SluiceConfig)
assert list(SECTION_TYPES) == [section.name for section in fields(SluiceConfig)]
assert all(is_dataclass(kind) for kind in SECTION_TYPES.values())


def sluice_cache_dir() -> Path:
    """Where Sluice keeps what it builds once: converted models and compiled kernels."""
    return Path(os.environ.get("SLUICE_CACHE") or Path.home() / ".cache" / "sluice").expanduser()
