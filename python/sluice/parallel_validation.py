"""Checks that a tensor-parallel size fits the model and the machine, before any worker process starts.

Cheap to import (no torch unless the device is CUDA), so the engine core and `sluice serve` call it first.
"""

from __future__ import annotations

from sluice.errors import DeviceUnavailableError, TensorParallelSizeError
from sluice.model_spec import ModelSpec


def check_tensor_parallel(spec: ModelSpec, tp_size: int, device: str = "cpu") -> None:
    """Raise TensorParallelSizeError or DeviceUnavailableError, naming the counts, unless `tp_size` ranks fit.

    Each rank holds an equal share of the query heads, the KV heads and the MLP's (and each expert's)
    intermediate width;
    the vocab need not divide (the last rank's shard is padded). On CUDA each rank needs its own GPU.
    """
    if tp_size < 1:
        raise TensorParallelSizeError(f"tensor_parallel_size must be at least 1, got {tp_size}")
    hf = spec.hf_config
    num_heads = int(hf["num_attention_heads"])
    counts = {
        "attention heads (num_attention_heads)": num_heads,
        "KV heads (num_key_value_heads)": int(hf.get("num_key_value_heads") or num_heads),
        "intermediate_size": int(hf["intermediate_size"]),
    }
    # A mixture of experts splits every expert's (and the shared expert's) intermediate width as well.
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if hf.get(field):
            counts[field] = int(hf[field])
    for what, count in counts.items():
        if count % tp_size:
            fitting = [n for n in range(1, num_heads + 1) if all(c % n == 0 for c in counts.values())]
            raise TensorParallelSizeError(
                f"tensor_parallel_size {tp_size} does not divide the model's {count} {what}; "
                f"sizes that fit {spec.path.name}: {', '.join(map(str, fitting))}"
            )
    if device == "cuda" and tp_size > 1:
        visible = _visible_cuda_devices()
        if visible < tp_size:
            raise DeviceUnavailableError(
                f"tensor_parallel_size {tp_size} on cuda needs {tp_size} GPUs (one per rank), "
                f"but torch sees {visible}"
            )


def _visible_cuda_devices() -> int:
    # device_count() asks NVML where it can and does not initialise CUDA, so forked workers stay safe.
    import torch

    return torch.cuda.device_count()
