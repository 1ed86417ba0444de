"""Where the Rust executables are: `pip install` (maturin) builds them next to this interpreter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sluice.errors import SluiceError

FRONTEND = "sluice-frontend"
ROUTER = "sluice-router"


class MissingBinaryError(SluiceError):
    """A Rust executable that `pip install` should have built is not there."""


def rust_binary(name: str) -> Path:
    """The executable `name` from the interpreter's bin folder; $SLUICE_FRONTEND / $SLUICE_ROUTER
    (the name upper-cased, dashes as underscores) overrides it, e.g. with a worktree's target/release."""
    override = os.environ.get(name.upper().replace("-", "_"))
    path = Path(override) if override else Path(sys.executable).parent / name
    if not os.access(path, os.X_OK):
        raise MissingBinaryError(
            f"the {name} binary {path} is missing: run ./scripts/setup (or `pip install -e .` in the "
            "repository), which builds it with cargo"
        )
    return path
