"""Which CPU cores each worker rank's threads run on, and how many threads it runs.

Two OpenMP threads on two cores collapse under any competing load when neither is pinned: a
descheduled thread stalls every barrier of the other. Pinning one thread per core keeps a rank's
threads apart from each other. The worker pins its own pool's threads once torch has sized it
(worker.cpu_threads); nothing is handed over through OpenMP's environment, because libgomp's
GOMP_CPU_AFFINITY pins the whole process to the first core before torch is imported, so that the
worker would see one usable core and run one thread.

How long a worker's idle OpenMP threads spin is the one OpenMP setting that is handed over, as
GOMP_SPINCOUNT in the environment of each worker process, and of `sluice serve`'s engine cores for
--executor inproc (libgomp reads it when torch loads it; an offline LLM's in-process worker keeps
its caller's). libgomp's default spins 300,000 times at every barrier: on a host whose frontend,
engine core and clients share the cores with the worker, a thread that waits for its descheduled
partner keeps its core from the very process that would let the partner run. Served W3 measured
about 1.1x the throughput at 3,000 to 30,000 spins (docs/perf-history.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from sluice.config import DEFAULT_OMP_SPIN_COUNT, DeviceConfig
from sluice.errors import InvalidConfigError, SluiceError

# The environment's own say over OpenMP's waiting, which "auto" leaves alone.
OMP_WAIT_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


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


def cores_per_replica(usable: list[int], data_parallel_size: int) -> list[list[int]]:
    """Per data-parallel replica, the cores its processes may run on: the usable cores in consecutive
    equal shares, the first replicas taking one more each when they do not split evenly."""
    assert 1 <= data_parallel_size <= len(usable), (data_parallel_size, usable)
    share, extra = divmod(len(usable), data_parallel_size)
    shares, start = [], 0
    for replica in range(data_parallel_size):
        end = start + share + (replica < extra)
        shares.append(usable[start:end])
        start = end
    return shares


def threads_per_rank(device: DeviceConfig, world_size: int, usable: list[int]) -> int:
    """--num-threads, else one per pinned core, else the usable cores shared among the ranks."""
    if device.num_threads is not None:
        return device.num_threads
    pinned = cores_per_rank(device, world_size, usable)
    if pinned is not None:
        return len(pinned[0])
    return max(1, len(usable) // world_size)


def omp_spin_count(device: DeviceConfig, environ: Mapping[str, str]) -> int | None:
    """The GOMP_SPINCOUNT a worker process gets from --omp-spin-count; None: the environment's own."""
    spec = device.omp_spin_count.strip()
    if spec == "inherit":
        return None
    if spec == "auto":
        return None if any(name in environ for name in OMP_WAIT_VARIABLES) else DEFAULT_OMP_SPIN_COUNT
    if not spec.isdecimal():
        raise InvalidConfigError(
            f"--omp-spin-count {device.omp_spin_count!r} is not auto, inherit or a count of spins such as 10000"
        )
    return int(spec)


def worker_environment(device: DeviceConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """A worker process's environment: `environ`, with GOMP_SPINCOUNT as --omp-spin-count says."""
    env = dict(environ)
    count = omp_spin_count(device, environ)
    if count is not None:
        env["GOMP_SPINCOUNT"] = str(count)
    return env
