"""The playground's committed bundle (frontend/playground/dist/, which sluice-frontend embeds) is what
its sources build to: an edit under frontend/playground/src/ without `npm run build` fails here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PLAYGROUND = Path(__file__).resolve().parents[2] / "frontend" / "playground"


def test_the_committed_bundle_is_built_from_the_sources(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None or not (PLAYGROUND / "node_modules" / "esbuild").is_dir():
        pytest.fail("Node.js and frontend/playground/node_modules are missing: scripts/setup installs them")
    subprocess.run([node, "build.mjs", "--outdir", str(tmp_path)], cwd=PLAYGROUND, check=True, timeout=120)
    committed = PLAYGROUND / "dist"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in committed.iterdir())
    for built in tmp_path.iterdir():
        assert built.read_bytes() == (committed / built.name).read_bytes(), (
            f"dist/{built.name} is stale: run `npm run build` in frontend/playground and commit dist/"
        )
