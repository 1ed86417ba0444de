"""The engine's command-line options, and the one place where they become a SluiceConfig.

`sluice generate`, `sluice serve` and the engine core process all call add_engine_arguments, so an
option means the same thing, with the same default, everywhere. Defaults come from the config
dataclasses themselves.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import get_args

from sluice.config import (
    CacheConfig,
    CudaAttentionBackend,
    Device,
    DeviceConfig,
    DType,
    ExecutorBackend,
    GraphConfig,
    GraphMode,
    KernelConfig,
    KvCacheDType,
    ModelConfig,
    ParallelConfig,
    Quantization,
    SchedulerConfig,
    SchedulingPolicy,
    SluiceConfig,
    SpeculativeConfig,
    SpeculativeMethod,
)
from sluice.cpu_binding import DEFAULT_OMP_SPIN_COUNT
from sluice.cpu_tiers import CPU_ISA_CHOICES
from sluice.errors import SluiceError


def at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


non_negative_float.__name__ = "float"


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


positive_float.__name__ = "float"


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1..65535, got {value}")
    return value


_port.__name__ = "port"


def _capture_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"capture sizes must be at least 1, got {text!r}")
    return sizes


_capture_sizes.__name__ = "sizes"


def add_engine_arguments(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Add the engine's options to `parser`.

    The model is `--model PATH`; with model_positional it may also be given as an optional
    positional MODEL (`sluice serve [MODEL]`). Absent both, the default model is used.
    """
    model = ModelConfig(path="")
    scheduler = SchedulerConfig()
    cache = CacheConfig()
    parallel = ParallelConfig()
    graph = GraphConfig()
    device = DeviceConfig()
    kernel = KernelConfig()
    speculative = SpeculativeConfig()
    group = parser.add_argument_group("engine")
    model_help = "a local Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)"
    if model_positional:
        group.add_argument("model", nargs="?", default=None, metavar="MODEL", help=model_help)
        group.add_argument("--model", dest="model_option", default=None, metavar="PATH", help=model_help)
    else:
        group.add_argument("--model", dest="model", default=None, metavar="PATH", help=model_help)
    group.add_argument("--dtype", default=model.dtype, choices=get_args(DType))
    group.add_argument(
        "--max-model-len",
        type=at_least(1),
        default=model.max_model_len,
        help="context length served (default: the model's max_position_embeddings)",
    )
    group.add_argument(
        "--max-num-seqs",
        type=at_least(1),
        default=scheduler.max_num_seqs,
        help="most requests in one step",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=at_least(1),
        default=scheduler.max_num_batched_tokens,
        help="token budget of one step",
    )
    group.add_argument(
        "--kv-cache-memory",
        type=positive_float,
        default=cache.kv_cache_memory_gib,
        metavar="GIB",
        help="KV cache budget of each worker (tensor-parallel rank) in GiB",
    )
    group.add_argument(
        "--num-kv-blocks",
        type=at_least(1),
        default=cache.num_gpu_blocks_override,
        help="exact number of KV blocks, overriding --kv-cache-memory",
    )
    group.add_argument("--block-size", type=at_least(1), default=cache.block_size, help="tokens per KV block")
    group.add_argument(
        "--kv-cache-dtype",
        default=cache.kv_cache_dtype,
        choices=get_args(KvCacheDType),
        help="the KV cache's element type: auto (the model's --dtype), or, on CPU, int8 or fp8_e4m3 (one byte "
        "per value and a scale per cached row: about twice the tokens in the same --kv-cache-memory)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=cache.enable_prefix_caching,
        help="share KV blocks between requests with a common prefix",
    )
    group.add_argument(
        "--kv-events-port",
        type=_port,
        default=cache.kv_events_port,
        metavar="PORT",
        help="publish KV-cache events for cache-aware routers on tcp://HOST:PORT (needs prefix caching)",
    )
    group.add_argument(
        "--kv-events-host",
        default=cache.kv_events_host,
        metavar="HOST",
        help="the address the KV-events socket binds: loopback by default; 0.0.0.0 for a router on another host",
    )
    group.add_argument("--scheduling-policy", default=scheduler.policy, choices=get_args(SchedulingPolicy))
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=scheduler.async_scheduling,
        help="plan step N+1 while step N runs (two batches in flight)",
    )
    group.add_argument(
        "--structured-output-overlap",
        action=argparse.BooleanOptionalAction,
        default=scheduler.structured_output_overlap,
        help="compute structured output bitmasks while the forward pass runs",
    )
    group.add_argument(
        "--early-step-output",
        action=argparse.BooleanOptionalAction,
        default=scheduler.early_step_output,
        help="CPU: a worker sends each step's tokens before it runs the next step, not after",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=at_least(1),
        default=parallel.tensor_parallel_size,
        help="worker processes that split each layer's heads (gloo on CPU, NCCL on CUDA)",
    )
    group.add_argument(
        "--executor",
        default=parallel.executor,
        choices=get_args(ExecutorBackend),
        help="mp: one worker process per rank; inproc: the worker inside the engine core (TP 1 only)",
    )
    group.add_argument(
        "--step-timeout-s",
        type=non_negative_float,
        default=parallel.step_timeout_s,
        metavar="S",
        help="how long the engine core waits for a step from its worker processes before it takes them "
        "for hung, fails the requests in flight and exits (sluice serve then restarts it); an engine core "
        "busy for twice this without getting back to its loop is ended by a watchdog; 0: forever",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        default=graph.enforce_eager,
        help="no graphs: every step runs op by op (CUDA graphs off; the fused C++ step off on CPU)",
    )
    group.add_argument(
        "--graph-mode",
        default=graph.mode,
        choices=get_args(GraphMode),
        help="which captured forms the graph dispatcher may use",
    )
    group.add_argument(
        "--capture-sizes",
        type=_capture_sizes,
        default=graph.capture_sizes,
        metavar="N,N,...",
        help="batch sizes (tokens) to capture graphs for; each at most --max-num-seqs",
    )
    group.add_argument("--device", default=device.device, choices=get_args(Device))
    group.add_argument(
        "--num-threads",
        type=at_least(1),
        default=device.num_threads,
        help="CPU threads per worker (default: the usable cores divided among the ranks)",
    )
    group.add_argument(
        "--cpu-bind",
        default=device.cpu_bind,
        metavar="auto|none|LIST",
        help="pin each worker thread to a core: auto, none, or cores such as 0-1 (ranks split by |)",
    )
    group.add_argument(
        "--omp-spin-count",
        default=device.omp_spin_count,
        metavar="auto|inherit|N",
        help="spins before an idle OpenMP thread of a worker process sleeps (GOMP_SPINCOUNT): auto is "
        f"{DEFAULT_OMP_SPIN_COUNT} unless the environment sets GOMP_SPINCOUNT or OMP_WAIT_POLICY; "
        "inherit leaves the environment's (else libgomp's 300000)",
    )
    group.add_argument(
        "--cpu-isa",
        default=kernel.cpu_isa,
        choices=CPU_ISA_CHOICES,
        help="CPU: the instruction-set tier of Sluice's kernels: auto (the best this CPU runs), a tier this "
        "CPU runs, or none (torch's own ops); `sluice info` lists them",
    )
    group.add_argument(
        "--packed-linear",
        action=argparse.BooleanOptionalAction,
        default=kernel.packed_linear,
        help="CPU: pack linear weights at load for the tier's GEMM; --no-packed-linear keeps them as "
        "loaded, for torch's matmul, and runs every step eagerly",
    )
    group.add_argument(
        "--gemm-k-blocks",
        action=argparse.BooleanOptionalAction,
        default=kernel.gemm_k_blocks,
        help="CPU, the avx512bf16 tier's bf16-pair GEMM: it takes K in blocks at 7-64 rows and prefetches the "
        "next block while it computes; --no-gemm-k-blocks reads each column group whole (the other tiers' "
        "GEMM keeps a tall block's weights in L2 instead, and records the choice only)",
    )
    group.add_argument(
        "--fused-gate-up",
        action=argparse.BooleanOptionalAction,
        default=kernel.fused_gate_up,
        help="CPU: pack each MLP's gate_up weight so that its GEMM writes silu(gate) * up from the epilogue; "
        "--no-fused-gate-up writes gate and up, then applies the activation over them",
    )
    group.add_argument(
        "--gguf-dequantize",
        action=argparse.BooleanOptionalAction,
        default=kernel.gguf_dequantize,
        help="CPU, a GGUF file: dequantize its quantized linear weights to --dtype at load, for the float "
        "GEMM; by default they stay quantized and run on the integer GEMM",
    )
    group.add_argument(
        "--quantization",
        default=kernel.quantization,
        choices=get_args(Quantization),
        help="CPU: quantize a Hugging Face folder's linear weights at load for the integer GEMM: int8 (blocks "
        "of 32 with a scale each) or int4 (blocks of 32 with a scale and a minimum each)",
    )
    group.add_argument(
        "--cpu-decode-attention",
        action=argparse.BooleanOptionalAction,
        default=kernel.cpu_decode_attention,
        help="CPU: run one-token (decode) attention on its own kernel path rather than the general tile path",
    )
    group.add_argument(
        "--cpu-decode-split-keys",
        action=argparse.BooleanOptionalAction,
        default=kernel.cpu_decode_split_keys,
        help="CPU: where too few sequences decode to keep every thread busy in attention, split each one's "
        "keys (512 or more) among the threads and merge the parts",
    )
    group.add_argument(
        "--native-argmax",
        action=argparse.BooleanOptionalAction,
        default=kernel.native_argmax,
        help="CPU: greedy rows pick their token with Sluice's one-pass argmax kernel rather than torch.argmax",
    )
    group.add_argument(
        "--cuda-attention-backend",
        default=kernel.cuda_attention_backend,
        choices=get_args(CudaAttentionBackend),
        help="CUDA: auto picks flash-attn where it imports and fits the KV cache, else Triton",
    )
    group.add_argument(
        "--speculative",
        default=speculative.method,
        choices=get_args(SpeculativeMethod),
        help="speculative decoding: ngram proposes tokens found earlier in the request (prompt lookup); "
        "greedy requests only, and one step in flight (it turns async scheduling off)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=at_least(1),
        default=speculative.num_speculative_tokens,
        metavar="K",
        help="most draft tokens verified per request and step",
    )
    group.add_argument(
        "--ngram-prompt-lookup-min",
        type=at_least(1),
        default=speculative.prompt_lookup_min,
        metavar="N",
        help="shortest n-gram of the request's last tokens that the ngram proposer looks up",
    )
    group.add_argument(
        "--ngram-prompt-lookup-max",
        type=at_least(1),
        default=speculative.prompt_lookup_max,
        metavar="N",
        help="longest n-gram that the ngram proposer looks up (it tries the longest first)",
    )


def model_path_from_args(args: argparse.Namespace) -> str | None:
    """The model folder named on the command line, or None for the default model."""
    positional = getattr(args, "model", None)
    option = getattr(args, "model_option", None)
    if positional is not None and option is not None and positional != option:
        raise SluiceError(f"two models named: {positional} and --model {option}")
    return positional if positional is not None else option


def device_config_from_args(args: argparse.Namespace) -> DeviceConfig:
    return DeviceConfig(
        device=args.device,
        num_threads=args.num_threads,
        cpu_bind=args.cpu_bind,
        omp_spin_count=args.omp_spin_count,
    )


def config_from_args(args: argparse.Namespace, model_path: str | None = None) -> SluiceConfig:
    """The SluiceConfig that parsed engine options describe; prepares the default model if none is named.

    `model_path`, when given, is the model folder already resolved from the options."""
    path = model_path or model_path_from_args(args)
    if path is None:
        from sluice.default_model import prepare_default_model

        path = str(prepare_default_model())
    return SluiceConfig(
        model=ModelConfig(path=path, dtype=args.dtype, max_model_len=args.max_model_len),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.scheduling_policy,
            async_scheduling=args.async_scheduling,
            structured_output_overlap=args.structured_output_overlap,
            early_step_output=args.early_step_output,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_gib=args.kv_cache_memory,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=args.enable_prefix_caching,
            num_gpu_blocks_override=args.num_kv_blocks,
            kv_events_port=args.kv_events_port,
            kv_events_host=args.kv_events_host,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            executor=args.executor,
            # Only `sluice serve` takes --data-parallel-size: everything else runs one replica.
            data_parallel_size=getattr(args, "data_parallel_size", 1),
            step_timeout_s=args.step_timeout_s,
        ),
        graph=GraphConfig(
            enforce_eager=args.enforce_eager, mode=args.graph_mode, capture_sizes=args.capture_sizes
        ),
        device=device_config_from_args(args),
        kernel=KernelConfig(
            packed_linear=args.packed_linear,
            gemm_k_blocks=args.gemm_k_blocks,
            fused_gate_up=args.fused_gate_up,
            gguf_dequantize=args.gguf_dequantize,
            quantization=args.quantization,
            cpu_decode_attention=args.cpu_decode_attention,
            cpu_decode_split_keys=args.cpu_decode_split_keys,
            cpu_isa=args.cpu_isa,
            native_argmax=args.native_argmax,
            cuda_attention_backend=args.cuda_attention_backend,
        ),
        speculative=SpeculativeConfig(
            method=args.speculative,
            num_speculative_tokens=args.num_speculative_tokens,
            prompt_lookup_min=args.ngram_prompt_lookup_min,
            prompt_lookup_max=args.ngram_prompt_lookup_max,
        ),
    )
