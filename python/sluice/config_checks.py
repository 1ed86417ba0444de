"""Every check of a configuration that needs no process: bad options get a typed error before any starts.

The engine core runs these before it starts its workers, and `sluice serve` before it starts the
engine core, so a bad option is refused at once with a message that names it. None of them loads
torch.
"""

from __future__ import annotations

import os
from typing import get_args

from sluice.capture_sizes import validate_graph_config
from sluice.config import (
    QUANTIZATION_BLOCK,
    CudaAttentionBackend,
    Device,
    ExecutorBackend,
    KvCacheDType,
    Quantization,
    SluiceConfig,
    SpeculativeMethod,
)
from sluice.cpu_binding import cores_per_rank, omp_spin_count, usable_cores
from sluice.errors import DeviceUnavailableError, InvalidConfigError
from sluice.kernel_libraries import choose_kernels
from sluice.kv_cache_layout import num_kv_blocks
from sluice.model_spec import ModelSpec, resolve_max_model_len, resolve_runner
from sluice.parallel_validation import check_tensor_parallel


def check_engine_config(config: SluiceConfig, spec: ModelSpec) -> int:
    """Raise a typed SluiceError for the first option that cannot work; returns the KV blocks to allocate."""
    device, parallel = config.device, config.parallel
    if device.device not in get_args(Device):
        raise InvalidConfigError(
            f"unknown device {device.device!r}: Sluice runs on {' or '.join(get_args(Device))}"
        )
    if parallel.executor not in get_args(ExecutorBackend):
        raise InvalidConfigError(f"unknown executor {parallel.executor!r}: use mp or inproc")
    if parallel.tensor_parallel_size < 1:
        raise InvalidConfigError(
            f"tensor_parallel_size must be at least 1, got {parallel.tensor_parallel_size}"
        )
    if not 0.0 <= parallel.step_timeout_s < float("inf"):
        raise InvalidConfigError(
            f"step_timeout_s must be a finite number of seconds, at least 0 (0: no bound), got {parallel.step_timeout_s}"
        )
    if parallel.executor == "inproc" and parallel.tensor_parallel_size > 1:
        raise InvalidConfigError(
            f"the in-process executor runs one rank; tensor_parallel_size {parallel.tensor_parallel_size} "
            "needs the multiprocess executor (--executor mp)"
        )
    check_tensor_parallel(spec, parallel.tensor_parallel_size, device.device)
    _check_kv_cache_dtype(config, spec)
    if device.device == "cuda":
        _check_cuda_available()
    backend = config.kernel.cuda_attention_backend
    if backend not in get_args(CudaAttentionBackend):
        raise InvalidConfigError(
            f"unknown cuda_attention_backend {backend!r}: use {', '.join(get_args(CudaAttentionBackend))}"
        )
    if device.device == "cpu":
        # The tier the workers will load, its library verified: a tier this CPU lacks, or a missing or
        # corrupt library, is refused here, before any process starts.
        choose_kernels(config.kernel.cpu_isa)
    _check_quantization(config, spec)
    # Raises for a base model served with --runner generate.
    runner = resolve_runner(spec, config.model.runner)
    if runner == "pooling" and config.speculative.enabled:
        raise InvalidConfigError(
            "speculative decoding drafts generated tokens: the pooling runner (embeddings) generates none"
        )
    if spec.is_encoder:
        _check_encoder(config, spec)
    validate_graph_config(config.graph, config.scheduler)
    if config.cache.kv_events_port is not None and not config.cache.enable_prefix_caching:
        raise InvalidConfigError(
            "--kv-events-port publishes the prefix cache's changes: it needs --enable-prefix-caching"
        )
    _check_speculative(config)
    cores_per_rank(device, parallel.tensor_parallel_size, usable_cores())
    omp_spin_count(device, os.environ)
    _check_data_parallel(config, usable_cores())
    return num_kv_blocks(config, spec, resolve_max_model_len(spec, config.model.max_model_len))


def _check_encoder(config: SluiceConfig, spec: ModelSpec) -> None:
    """An encoder computes each prompt whole in one step."""
    max_model_len = resolve_max_model_len(spec, config.model.max_model_len)
    if max_model_len > config.scheduler.max_num_batched_tokens:
        raise InvalidConfigError(
            f"{spec.architecture} encodes each prompt whole in one step: --max-num-batched-tokens "
            f"({config.scheduler.max_num_batched_tokens}) must hold a prompt of --max-model-len ({max_model_len})"
        )


def _check_quantization(config: SluiceConfig, spec: ModelSpec) -> None:
    """--quantization needs the integer GEMM (a CPU kernel tier, packed weights), a model that is not
    quantized already, and every linear's input width a multiple of its blocks of 32."""
    quantization, kernel = config.kernel.quantization, config.kernel
    if quantization is None:
        return
    if quantization not in get_args(Quantization):
        raise InvalidConfigError(
            f"unknown quantization {quantization!r}: use {' or '.join(get_args(Quantization))}"
        )
    if spec.gguf_file is not None:
        raise InvalidConfigError(
            f"--quantization {quantization}: {spec.gguf_file.name} is a GGUF file, quantized already (its "
            "quantized weights run on the integer GEMM as they are)"
        )
    if (
        config.device.device != "cpu"
        or choose_kernels(kernel.cpu_isa).library is None
        or not kernel.packed_linear
    ):
        raise InvalidConfigError(
            f"--quantization {quantization} runs on Sluice's CPU integer GEMM: it needs --device cpu, a kernel "
            "tier (not --cpu-isa none) and packed linear weights (not --no-packed-linear)"
        )
    hf = spec.hf_config
    tp = config.parallel.tensor_parallel_size
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    widths = {
        "hidden_size": int(hf["hidden_size"]),
        "the attention output's width per rank (heads x head_dim / tensor_parallel_size)": heads
        * head_dim
        // tp,
        "intermediate_size per rank": int(hf["intermediate_size"]) // tp,
    }
    # A mixture of experts: each expert's down projection (and the shared expert's) reads its own width.
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if hf.get(field):
            widths[f"{field} per rank"] = int(hf[field]) // tp
    for name, width in widths.items():
        if width % QUANTIZATION_BLOCK:
            raise InvalidConfigError(
                f"--quantization {quantization} quantizes each linear's input in blocks of {QUANTIZATION_BLOCK}, "
                f"but {name} is {width}, not a multiple of {QUANTIZATION_BLOCK}"
            )


# csrc/cpu/kv_quant.h kMaxKvHeadDim: a quantized row is widened on the stack when it is written.
MAX_QUANTIZED_KV_HEAD_DIM = 1024


def _check_kv_cache_dtype(config: SluiceConfig, spec: ModelSpec) -> None:
    """int8 and fp8_e4m3 caches are read by the CPU kernels (every tier) and by torch's ops (--cpu-isa
    none); the CUDA backends read the model's dtype only."""
    kv_cache_dtype = config.cache.kv_cache_dtype
    if kv_cache_dtype not in get_args(KvCacheDType):
        raise InvalidConfigError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}: use {', '.join(get_args(KvCacheDType))}"
        )
    if kv_cache_dtype == "auto":
        return
    if config.device.device != "cpu":
        raise InvalidConfigError(
            f"--kv-cache-dtype {kv_cache_dtype} is read by the CPU attention kernels; the CUDA backends "
            "(flash-attn, Triton) read a cache of the model's dtype: use --kv-cache-dtype auto on cuda"
        )
    if spec.head_dim > MAX_QUANTIZED_KV_HEAD_DIM:
        raise InvalidConfigError(
            f"--kv-cache-dtype {kv_cache_dtype} takes head_dim up to {MAX_QUANTIZED_KV_HEAD_DIM}; "
            f"this model's is {spec.head_dim}"
        )


def _check_speculative(config: SluiceConfig) -> None:
    speculative = config.speculative
    if speculative.method not in (None, *get_args(SpeculativeMethod)):
        raise InvalidConfigError(f"unknown speculative method {speculative.method!r}: use ngram")
    if speculative.num_speculative_tokens < 1:
        raise InvalidConfigError(
            f"num_speculative_tokens must be at least 1, got {speculative.num_speculative_tokens}"
        )
    if not 1 <= speculative.prompt_lookup_min <= speculative.prompt_lookup_max:
        raise InvalidConfigError(
            "the ngram window needs 1 <= --ngram-prompt-lookup-min <= --ngram-prompt-lookup-max, got "
            f"{speculative.prompt_lookup_min} and {speculative.prompt_lookup_max}"
        )


def _check_data_parallel(config: SluiceConfig, usable: list[int]) -> None:
    size = config.parallel.data_parallel_size
    if size < 1:
        raise InvalidConfigError(f"data_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    if size > len(usable):
        raise InvalidConfigError(
            f"data_parallel_size {size} needs at least one core per replica, but this process may use "
            f"{len(usable)} cores ({','.join(map(str, usable))})"
        )
    if config.device.device != "cpu":
        raise InvalidConfigError(
            f"data_parallel_size {size} runs on CPU only: on {config.device.device} the replicas would "
            "share one device"
        )
    if config.device.cpu_bind.strip() not in ("auto", "none"):
        raise InvalidConfigError(
            f"--cpu-bind {config.device.cpu_bind!r} names cores, but with data_parallel_size {size} each "
            "replica is pinned to its share of the cores: use auto or none"
        )


def _check_cuda_available() -> None:
    # Only a CUDA configuration pays for importing torch here.
    import torch

    if not torch.cuda.is_available():
        raise DeviceUnavailableError("--device cuda was asked for, but torch sees no CUDA device")
