"""The kernel libraries as built: every tier of this architecture is in the manifest and intact, each
passes csrc/tests/kernel_check.cpp (the kernels against scalar references through the C ABI, no torch)
at every tier this CPU runs, and on an x86 machine the aarch64 build compiles and passes the same checks
under qemu-user, so a build break on any CPU fails here."""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sluice import cpu_tiers
from sluice.config import sluice_cache_dir
from tiers import KERNEL_TIERS

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "csrc" / "tests" / "kernel_check.cpp"
# An ELF file's e_machine (offset 18, little-endian) for each architecture.
ELF_MACHINE = {"x86_64": 62, "aarch64": 183}


def compile_check(compiler: str, out: Path, *flags: str) -> Path:
    binary = out / "kernel_check"
    subprocess.run([compiler, "-std=c++17", "-O1", *flags, str(CHECK), "-ldl", "-o", str(binary)], check=True)
    return binary


def elf_machine(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[18:20], "little")


def test_every_tier_of_this_architecture_is_built_and_intact() -> None:
    manifest = json.loads((cpu_tiers.KERNEL_DIR / "manifest.json").read_text())
    arch = cpu_tiers.host_arch()
    assert manifest["arch"] == arch
    assert sorted(manifest["tiers"]) == sorted(t.name for t in cpu_tiers.tiers_for(arch))
    for tier, entry in manifest["tiers"].items():
        library = cpu_tiers.KERNEL_DIR / entry["file"]
        assert hashlib.sha256(library.read_bytes()).hexdigest() == entry["sha256"], tier
        assert elf_machine(library) == ELF_MACHINE[arch]


@pytest.fixture(scope="module")
def native_check(tmp_path_factory: pytest.TempPathFactory) -> Path:
    flags = ("-mf16c",) if platform.machine() == "x86_64" else ()
    return compile_check("g++", tmp_path_factory.mktemp("check"), *flags)


@pytest.mark.parametrize("tier", KERNEL_TIERS)
def test_kernel_check_passes_at_every_tier_this_cpu_runs(native_check: Path, tier: str) -> None:
    library = cpu_tiers.KERNEL_DIR / cpu_tiers.LIBRARY_PATTERN.format(tier=tier)
    done = subprocess.run([str(native_check), str(library)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"kernel_check: {tier} tier: every check passed" in done.stdout


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the aarch64 cross-build runs on x86 hosts")
def test_the_aarch64_build_compiles_and_passes_its_checks_under_qemu(tmp_path: Path) -> None:
    for tool in ("aarch64-linux-gnu-g++", "qemu-aarch64"):
        assert shutil.which(tool), (
            f"{tool} is missing: scripts/setup installs it (g++-aarch64-linux-gnu, qemu-user)"
        )
    # Kept between runs, so that only what changed compiles again.
    out = sluice_cache_dir() / "kernel_build" / "aarch64"
    subprocess.run(
        [sys.executable, str(ROOT / "csrc" / "build_kernels.py"), "--arch", "aarch64", "--out", str(out)],
        check=True,
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["tiers"]) == sorted(t.name for t in cpu_tiers.tiers_for("aarch64"))
    check = compile_check("aarch64-linux-gnu-g++", tmp_path)
    assert elf_machine(check) == ELF_MACHINE["aarch64"]
    for tier, entry in manifest["tiers"].items():
        library = out / entry["file"]
        assert elf_machine(library) == ELF_MACHINE["aarch64"]
        done = subprocess.run(
            ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(check), str(library)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"kernel_check: {tier} tier: every check passed" in done.stdout
