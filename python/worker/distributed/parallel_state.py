"""The process-wide tensor-parallel group: set up once per worker process, torn down at its exit."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from worker.distributed.communication import TensorParallelGroup

_SINGLE_RANK = TensorParallelGroup()
_group = _SINGLE_RANK


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device | str,
    timeout: timedelta | None = None,
) -> TensorParallelGroup:
    """Join the group of `world_size` ranks that rendezvous at `init_method` (e.g. "tcp://127.0.0.1:PORT").

    gloo for a CPU device, NCCL for CUDA, where rank r drives GPU r (the ranks of a replica share a
    host, so the rank is the local rank). With one rank nothing is initialised. Every rank must call
    this before it builds the model, which reads the group through tensor_parallel_group().
    """
    global _group
    assert world_size >= 1 and 0 <= rank < world_size, (rank, world_size)
    assert _group.size == 1 and not dist.is_initialized(), "the tensor-parallel group is already set up"
    if world_size == 1:
        return _group
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", rank if device.index is None else device.index)
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device,
        )
    elif device.type == "cpu":
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
    else:
        raise NotImplementedError(
            f"tensor parallelism runs on cpu (gloo) and cuda (NCCL), not {device.type!r}"
        )
    _group = TensorParallelGroup(rank, world_size, dist.group.WORLD, device)
    return _group


def destroy_tensor_parallel() -> None:
    """Leave the group (every rank calls this); afterwards this process is a single rank again."""
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = _SINGLE_RANK


def tensor_parallel_group() -> TensorParallelGroup:
    """This process's group: the single-rank one unless init_tensor_parallel set up a larger one."""
    return _group
