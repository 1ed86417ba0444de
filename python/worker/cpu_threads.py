"""Sizes this process's torch thread pool and pins its threads to cores, as --num-threads and --cpu-bind say."""

from __future__ import annotations

import logging

import torch

from sluice.config import DeviceConfig
from sluice.cpu_binding import cores_per_rank, threads_per_rank, usable_cores

logger = logging.getLogger("sluice.worker")


def configure_cpu_threads(device: DeviceConfig, rank: int, world_size: int, pin: bool) -> list[int] | None:
    """Sets torch's thread count for rank; with `pin` (a worker process of its own), on CPU with
    binding on, pins its i-th thread to its i-th core and returns, per thread, the core it was pinned
    to (or -errno); None when nothing is pinned."""
    usable = usable_cores()
    threads = threads_per_rank(device, world_size, usable)
    torch.set_num_threads(threads)
    pinned = cores_per_rank(device, world_size, usable) if pin else None
    if pinned is None:
        return None
    from worker.native_ops import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        # The pinning goes through the kernel library; torch's own ops (the "none" tier) run unpinned.
        logger.warning("rank %d: threads not pinned: no CPU kernel library at the none tier", rank)
        return None
    cores = pinned[rank]
    # More threads than cores (an explicit --num-threads) take the cores in turn.
    bound = kernels.bind_threads([cores[i % len(cores)] for i in range(threads)])
    if any(core < 0 for core in bound):
        logger.warning("rank %d: the kernel refused some thread pinnings (per thread: %s)", rank, bound)
    else:
        logger.info("rank %d: %d threads pinned to cores %s", rank, threads, bound)
    return bound
