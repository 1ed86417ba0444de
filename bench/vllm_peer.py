"""Where the vLLM peer lives and how it is started: the venv the user names, and the variables it needs.

vLLM's CPU build is installed into a venv of its own (bench/README.md). Its best settings on this
kind of machine: Intel's OpenMP preloaded (shipped in the venv's lib/), its OpenMP threads bound
one per allowed core, a 4 GiB KV cache. A variable already set in the environment wins.
"""

from __future__ import annotations

import os
from pathlib import Path

VENV_ENV = "SLUICE_BENCH_VLLM_VENV"


def vllm_venv(option: str | None) -> Path | None:
    """The venv from --vllm-venv, else from $SLUICE_BENCH_VLLM_VENV; None: run Sluice alone."""
    value = option or os.environ.get(VENV_ENV)
    if not value:
        return None
    venv = Path(value).expanduser().resolve()
    if not (venv / "bin" / "python").is_file():
        raise SystemExit(f"no python in {venv}/bin: --vllm-venv must name vLLM's venv")
    return venv


def vllm_python(venv: Path) -> str:
    return str(venv / "bin" / "python")


def allowed_cores() -> str:
    """This process's allowed cores as a list vLLM reads, such as 0-1 or 0,2,5."""
    return ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))


def vllm_env(venv: Path) -> dict[str, str]:
    env = dict(os.environ)
    iomp = venv / "lib" / "libiomp5.so"
    defaults = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": allowed_cores(),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if iomp.is_file():
        defaults["LD_PRELOAD"] = str(iomp)
    for name, value in defaults.items():
        env.setdefault(name, value)
    # Sluice's source tree must not shadow anything in vLLM's interpreter.
    env.pop("PYTHONPATH", None)
    return env
