"""Publishing a folder that was built in a staging folder beside its place in the cache."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def publish_folder(staging: Path, target: Path, is_complete: Callable[[Path], bool]) -> None:
    """Move the finished `staging` folder to `target`; an incomplete leftover at `target` is replaced.

    The rename is atomic, so no reader ever sees a folder that looks complete but is not.
    """
    if target.exists():
        if is_complete(target):
            return  # another process finished first
        shutil.rmtree(target)
    os.chmod(staging, 0o755)
    for file in staging.iterdir():
        os.chmod(file, 0o644)
    try:
        staging.rename(target)
    except OSError:
        if not is_complete(target):
            raise
