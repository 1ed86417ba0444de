"""Builds Sluice's C++ CPU kernels on first use and loads them; later runs reuse the cached build."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

from sluice.config import sluice_cache_dir
from sluice.errors import SluiceError

_SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
# at::parallel_for splits work only when built with OpenMP; the extension then shares the
# libgomp.so.1 that torch has already loaded, so there is one OpenMP runtime in the process.
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
_MODULE_NAME = "sluice_cpu_ops"


class NativeBuildError(SluiceError, RuntimeError):
    """The C++ kernels cannot be built here: no compiler, or missing sources."""


def _cpu_signature() -> str:
    # -march=native binaries must not be shared between different CPUs through one cache folder.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_dir(files: list[Path]) -> Path:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    # The source folder too: the build files name sources by absolute path, so two checkouts sharing
    # one build folder would rebuild each other's module on every load.
    for part in (str(_SOURCE_DIR), torch.__version__, sys.version, " ".join(_CFLAGS), _cpu_signature()):
        digest.update(part.encode())
    return sluice_cache_dir() / "torch_extensions" / digest.hexdigest()[:16]


@functools.cache
def load_native_ops() -> ModuleType:
    """The compiled module: paged_attention(out, query, key_cache, value_cache, block_table,
    query_start_loc, seq_lens, scale, decode_path, split_keys), write_kv_cache(key, value, key_cache,
    value_cache, slot_mapping), and the other ops of csrc/cpu/bindings.cpp.
    """
    files = sorted(p for p in _SOURCE_DIR.glob("*") if p.suffix in (".cpp", ".h"))
    sources = [str(p) for p in files if p.suffix == ".cpp"]
    if not sources:
        raise NativeBuildError(f"Sluice's C++ kernel sources are missing from {_SOURCE_DIR}")
    build_dir = _build_dir(files)
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{_MODULE_NAME}.so").exists():
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise NativeBuildError(
                f"no C++ compiler found ({compiler!r} is not on PATH): Sluice compiles its CPU kernels on "
                "first use; install one (e.g. `apt-get install g++`) or point CXX at it"
            )
        print("compiling Sluice CPU kernels (first run only)...", file=sys.stderr, flush=True)
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=_MODULE_NAME,
        sources=sources,
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        build_directory=str(build_dir),
        with_cuda=False,
        verbose=False,
    )
