"""Why Sluice's W1 is unsteady: W1 under process-level settings, each in fresh processes.

Each setting (OpenMP runtime and its waiting and binding, allocator, huge pages, thread count and
pinning, a competing busy process) runs W1 once per fresh process, --processes times, the settings
taken round-robin so that the machine's drift hits them alike. Prints each setting's median output
tok/s and spread, (max - min) / median, and the CPU seconds that other processes used during the
timed runs (noise that was not ours).

  python bench/steadiness.py [--processes 3] [--lock FILE] [--iomp PATH] [SETTING ...]
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import LOCK_ENV, bench_lock, log, machine_busy_seconds, offline_workload, spread

# glibc's malloc: keep freed memory in the heap instead of unmapping it (32 MiB is the tunable's ceiling).
MALLOC_KEEP = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
BIND_CORES = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
KERNEL_SHAPE = (64, 576, 1536)
KERNEL_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class Setting:
    env: dict[str, str] = field(default_factory=dict)
    # Libraries to LD_PRELOAD, by soname or path: "jemalloc", "tcmalloc", "iomp" are looked up.
    preload: tuple[str, ...] = ()
    num_threads: int | None = None
    # Cores the whole process (and so every thread it starts) may run on, set before torch loads.
    cores: tuple[int, ...] | None = None
    # A process that spins on the CPU for the whole run, placed wherever the kernel puts it.
    busy: bool = False


SETTINGS: dict[str, Setting] = {
    "default": Setting(),
    "omp-bind": Setting(env=BIND_CORES),
    "omp-passive": Setting(env={"OMP_WAIT_POLICY": "passive"}),
    "omp-active": Setting(env={"OMP_WAIT_POLICY": "active"}),
    "omp-bind-passive": Setting(env={**BIND_CORES, "OMP_WAIT_POLICY": "passive"}),
    "spin-10k": Setting(env={"GOMP_SPINCOUNT": "10000"}),
    "malloc-keep": Setting(env={"GLIBC_TUNABLES": MALLOC_KEEP}),
    "malloc-arena-1": Setting(env={"MALLOC_ARENA_MAX": "1"}),
    "malloc-thp": Setting(env={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}),
    "torch-thp": Setting(env={"THP_MEM_ALLOC_ENABLE": "1"}),
    "jemalloc": Setting(preload=("jemalloc",)),
    "tcmalloc": Setting(preload=("tcmalloc",)),
    "iomp": Setting(preload=("iomp",)),
    "iomp-bind": Setting(preload=("iomp",), env={"KMP_AFFINITY": "granularity=fine,compact,1,0"}),
    "1-thread": Setting(num_threads=1),
    "1-thread-core0": Setting(num_threads=1, cores=(0,)),
    "busy+default": Setting(busy=True),
    "busy+omp-bind": Setting(env=BIND_CORES, busy=True),
    "busy+omp-passive": Setting(env={"OMP_WAIT_POLICY": "passive"}, busy=True),
    "busy+omp-bind-passive": Setting(env={**BIND_CORES, "OMP_WAIT_POLICY": "passive"}, busy=True),
    "busy+iomp-bind": Setting(
        preload=("iomp",), env={"KMP_AFFINITY": "granularity=fine,compact,1,0"}, busy=True
    ),
    "busy+1-thread": Setting(num_threads=1, busy=True),
    "busy+1-thread-core0": Setting(num_threads=1, cores=(0,), busy=True),
}


def library_path(name: str, iomp: str | None) -> str:
    """A preload's soname (found by the dynamic loader) or path; iomp comes from --iomp or this venv."""
    if name == "iomp":
        candidates = [iomp] if iomp else [str(Path(sys.prefix) / "lib" / "libiomp5.so")]
        for candidate in candidates:
            if Path(candidate).is_file():
                return candidate
        raise FileNotFoundError("libiomp5.so not found: pip install intel-openmp, or pass --iomp PATH")
    soname = ctypes.util.find_library({"jemalloc": "jemalloc", "tcmalloc": "tcmalloc_minimal"}[name])
    if soname is None:
        raise FileNotFoundError(
            f"lib{name} not found (Debian: apt-get install libjemalloc2 libtcmalloc-minimal4)"
        )
    return soname


def child_main(setting_name: str, kernel: bool) -> None:
    """One fresh process: time W1 once after a warm-up (or the clue's linear), print one JSON line."""
    setting = SETTINGS[setting_name]
    if setting.cores is not None:
        os.sched_setaffinity(0, setting.cores)
    import torch

    if setting.num_threads is not None:
        torch.set_num_threads(setting.num_threads)
    if kernel:
        print(json.dumps(linear_figures()), flush=True)
        return

    from engine import LLM, SamplingParams

    w1 = offline_workload("W1")
    llm = LLM(dtype="bfloat16", max_num_seqs=64, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in w1.prompts]
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=w1.output_tokens, temperature=0.0, ignore_eos=True)
    busy_before, cpu_before = machine_busy_seconds(), time.process_time()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ours = time.process_time() - cpu_before
    assert all(len(r.outputs[0].token_ids) == w1.output_tokens for r in results)
    tokens = len(prompts) * w1.output_tokens
    line = {"value": tokens / elapsed, "seconds": elapsed, "threads": torch.get_num_threads()}
    line["foreign_cpu_s"] = machine_busy_seconds() - busy_before - ours
    print(json.dumps(line), flush=True)


def linear_figures() -> dict[str, float]:
    """The issue's clue: bf16 F.linear at M=64, K=576, N=1536 (W1's decode MLP), median of 2 s of calls."""
    import torch
    import torch.nn.functional as F

    m, k, n = KERNEL_SHAPE
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    for _ in range(20):
        F.linear(x, w)
    times = []
    busy_before, cpu_before = machine_busy_seconds(), time.process_time()
    deadline = time.perf_counter() + KERNEL_SECONDS
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - start)
    ours = time.process_time() - cpu_before
    gflops = 2 * m * k * n / statistics.median(times) / 1e9
    return {
        "value": gflops,
        "threads": torch.get_num_threads(),
        "foreign_cpu_s": machine_busy_seconds() - busy_before - ours,
    }


def run_child(name: str, args: argparse.Namespace) -> dict[str, float]:
    setting = SETTINGS[name]
    env = dict(os.environ, **setting.env)
    if setting.preload:
        env["LD_PRELOAD"] = ":".join(library_path(p, args.iomp) for p in setting.preload)
    argv = [sys.executable, __file__, "--child", name, *(["--kernel"] if args.kernel else [])]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if setting.busy else None
    try:
        out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("settings", nargs="*", default=list(SETTINGS), metavar="SETTING")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per setting")
    parser.add_argument("--lock", default=os.environ.get(LOCK_ENV), help="flock file held during each round")
    parser.add_argument("--iomp", default=None, help="libiomp5.so to preload (default: this venv's)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run here")
    parser.add_argument("--kernel", action="store_true", help="time the clue's F.linear (GFLOP/s), not W1")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child, args.kernel)
        return
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.settings}
    for index in range(args.processes):
        # One round (every setting once) per exclusive hold: minutes, not the whole experiment.
        with bench_lock(args.lock, exclusive=True):
            for name in args.settings:
                log(f"process {index + 1}/{args.processes}: {name}")
                result = run_child(name, args)
                log(f"  {result['value']:.1f}, foreign CPU {result['foreign_cpu_s']:.1f} s")
                runs[name].append(result)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    unit = "GFLOP/s" if args.kernel else "tok/s"
    print(f"{'setting':24} {'median ' + unit:>14} {'spread':>7} {'foreign CPU s':>13}  runs")
    for name, results in runs.items():
        values = [r["value"] for r in results]
        foreign = max(r["foreign_cpu_s"] for r in results)
        shown = " ".join(f"{v:.0f}" for v in values)
        median = statistics.median(values)
        print(f"{name:24} {median:14.1f} {100 * spread(values):6.1f}% {foreign:13.1f}  {shown}")


if __name__ == "__main__":
    main()
