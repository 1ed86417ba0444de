"""Picks the attention backend for a device at run time."""

from __future__ import annotations

import torch

from worker.attention.backend import AttentionBackend


def select_attention_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cpu":
        from worker.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if device.type == "cuda":
        from worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise NotImplementedError(
        f"no attention backend for device {device.type!r}: Sluice supports cpu and cuda"
    )
