"""Running a test module again in a child pytest process under Triton's interpreter.

triton.jit reads TRITON_INTERPRET when a kernels module is imported. In a whole-suite pytest process that
moment is not a test's to control (and setting the variable there would leak into every other module),
so on a CPU-only machine a Triton test module runs itself in a child with the variable set from the start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(test_file: str, *pytest_args: str) -> None:
    """Runs `test_file`'s tests (narrowed by pytest_args) with TRITON_INTERPRET=1; fails with their output
    unless they pass and at least one ran."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, test_file]
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-6000:] + done.stderr[-3000:]
