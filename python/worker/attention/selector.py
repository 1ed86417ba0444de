"""Picks the attention backend for a device at run time.

On CUDA, flash-attn serves when it imports and fits the cache (block size a multiple of 256,
fp16/bf16); otherwise Triton. KernelConfig.cuda_attention_backend (--cuda-attention-backend)
"triton" or "flash_attn" forces one (the off switch for measuring flash-attn against Triton);
forcing flash-attn where it does not fit is an error that says why. On CPU, Sluice's kernels of the
process's tier serve (worker/native_ops.py), or torch's own ops at the "none" tier;
KernelConfig.cpu_decode_attention turns the kernel's decode path off, and
KernelConfig.cpu_decode_split_keys its splitting of a few sequences' keys among the threads.
"""

from __future__ import annotations

import torch

from sluice.config import KernelConfig
from sluice.errors import AttentionBackendError
from worker.attention.backend import AttentionBackend

CUDA_BACKENDS = ("flash_attn", "triton")
DEFAULT_KERNELS = KernelConfig()


def select_attention_backend(
    device: torch.device,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    kernel: KernelConfig = DEFAULT_KERNELS,
) -> AttentionBackend:
    """block_size and dtype describe the KV cache; without them flash-attn is never picked."""
    if device.type == "cpu":
        from worker.native_ops import cpu_kernels

        ops = cpu_kernels()
        if ops is None:
            from worker.attention.torch_backend import TorchAttentionBackend

            return TorchAttentionBackend()
        from worker.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(
            ops, decode_path=kernel.cpu_decode_attention, split_keys=kernel.cpu_decode_split_keys
        )
    if device.type == "cuda":
        return _cuda_backend(block_size, dtype, kernel.cuda_attention_backend)
    raise NotImplementedError(
        f"no attention backend for device {device.type!r}: Sluice supports cpu and cuda"
    )


def _cuda_backend(block_size: int | None, dtype: torch.dtype | None, choice: str) -> AttentionBackend:
    if choice not in ("auto", *CUDA_BACKENDS):
        raise AttentionBackendError(
            f"cuda_attention_backend {choice!r}: expected auto or one of {CUDA_BACKENDS}"
        )
    if choice != "triton":
        from worker.attention.flash_attn_backend import FlashAttentionBackend

        try:
            if block_size is None or dtype is None:
                raise AttentionBackendError("the selector was not told the KV cache's block size and dtype")
            return FlashAttentionBackend(block_size, dtype)
        except (AttentionBackendError, ImportError) as exc:
            if choice == "flash_attn":
                raise AttentionBackendError(f"cuda_attention_backend is flash_attn, but {exc}") from exc
    from worker.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
