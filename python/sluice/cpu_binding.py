"""Which CPU cores each worker rank's threads run on, and the environment that pins them there.

Two OpenMP threads on two cores collapse under any competing load when neither is pinned: a
descheduled thread stalls every barrier of the other. Pinning one thread per core keeps a rank's
threads apart from each other. The pinning is handed to the worker process through OpenMP's own
environment (read when the runtime starts, before torch creates its thread pool).
"""

from __future__ import annotations

import os

from sluice.config import DeviceConfig
from sluice.errors import SluiceError


class CpuBindError(SluiceError, ValueError):
    """--cpu-bind names cores that do not exist here, or does not fit the ranks."""


def usable_cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def _parse_core_list(text: str) -> list[int]:
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            start, end = int(first), int(last if dash else first)
        except ValueError:
            raise CpuBindError(f"--cpu-bind: {text!r} is not a core list such as 0-3 or 0,2") from None
        if start > end:
            raise CpuBindError(f"--cpu-bind: the range {part!r} runs backwards")
        cores.extend(range(start, end + 1))
    return cores


def cores_per_rank(device: DeviceConfig, world_size: int, usable: list[int]) -> list[list[int]] | None:
    """Per rank, the cores its threads are pinned to, one thread per core; None when nothing is pinned.

    "auto" splits the usable cores evenly among the ranks, and pins nothing when there are fewer
    cores than ranks (ranks then share cores, each with one thread). An explicit list gives one
    group per rank, split by "|", or one group that is split evenly.
    """
    spec = device.cpu_bind.strip()
    if device.device != "cpu" or spec == "none":
        return None
    if spec == "auto":
        if len(usable) < world_size:
            return None
        share = len(usable) // world_size
        return [usable[rank * share : (rank + 1) * share] for rank in range(world_size)]
    groups = [_parse_core_list(group) for group in spec.split("|")]
    if len(groups) == 1 and world_size > 1:
        cores = groups[0]
        if len(cores) % world_size:
            raise CpuBindError(
                f"--cpu-bind {spec!r} lists {len(cores)} cores, which do not split evenly among "
                f"{world_size} ranks; give one group per rank, separated by |"
            )
        share = len(cores) // world_size
        groups = [cores[rank * share : (rank + 1) * share] for rank in range(world_size)]
    if len(groups) != world_size:
        raise CpuBindError(f"--cpu-bind {spec!r} gives {len(groups)} groups of cores for {world_size} ranks")
    unknown = sorted({core for group in groups for core in group} - set(usable))
    if unknown:
        raise CpuBindError(
            f"--cpu-bind {spec!r} names cores {unknown} that this process may not use (usable: {usable})"
        )
    return groups


def threads_per_rank(device: DeviceConfig, world_size: int, usable: list[int]) -> int:
    """--num-threads, else one per pinned core, else the usable cores shared among the ranks."""
    if device.num_threads is not None:
        return device.num_threads
    pinned = cores_per_rank(device, world_size, usable)
    if pinned is not None:
        return len(pinned[0])
    return max(1, len(usable) // world_size)


def worker_environment(device: DeviceConfig, world_size: int, rank: int) -> dict[str, str]:
    """Environment variables for rank's worker process: its thread count and, if pinned, its cores."""
    usable = usable_cores()
    threads = threads_per_rank(device, world_size, usable)
    env = {"OMP_NUM_THREADS": str(threads)}
    pinned = cores_per_rank(device, world_size, usable)
    if pinned is not None:
        cores = pinned[rank]
        # libgomp pins its i-th thread to the i-th listed core (Intel's runtime reads this one too).
        env["GOMP_CPU_AFFINITY"] = " ".join(str(core) for core in cores[:threads])
    return env
