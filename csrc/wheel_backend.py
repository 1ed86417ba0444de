"""Sluice's PEP 517 build backend: maturin's, once the CPU kernel libraries are built.

`pip wheel .` and `pip install .` build through maturin (the Rust binaries and the Python packages).
Before that, csrc/build_kernels.py compiles the kernel library of every instruction-set tier of the
build machine's architecture into python/worker/kernel_libs, which the wheel carries (pyproject.toml,
tool.maturin include), so an installed Sluice runs without a compiler. Every other hook is maturin's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import maturin

_BUILDER = Path(__file__).resolve().with_name("build_kernels.py")


def _build_kernels() -> None:
    subprocess.run([sys.executable, str(_BUILDER)], check=True)


def build_wheel(
    wheel_directory: str, config_settings: dict | None = None, metadata_directory: str | None = None
) -> str:
    _build_kernels()
    return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(
    wheel_directory: str, config_settings: dict | None = None, metadata_directory: str | None = None
) -> str:
    _build_kernels()
    return maturin.build_editable(wheel_directory, config_settings, metadata_directory)


def __getattr__(name: str) -> Any:
    # The hooks this module does not wrap (sdist, metadata, requirements) are maturin's own.
    return getattr(maturin, name)
