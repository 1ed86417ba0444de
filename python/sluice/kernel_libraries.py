"""Which of the built kernel libraries this process runs, checked before anything loads it.

KernelConfig.cpu_isa ("auto", a tier's name, or "none") and this CPU's flags pick the tier
(sluice/cpu_tiers.py); the build's manifest.json names each tier's library with its SHA-256, so a
library that is missing, truncated or altered is refused with an error that names the file and the
command that rebuilds it, never loaded. Nothing here imports torch: `sluice serve` checks the choice
before it starts any process, and `sluice info` reports it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from sluice import cpu_tiers
from sluice.errors import InvalidConfigError, SluiceError


class KernelLibraryError(SluiceError, RuntimeError):
    """A kernel library (or the manifest that lists them) is missing, corrupt or from other sources."""


class CpuIsaError(InvalidConfigError):
    """--cpu-isa names a tier this CPU cannot run, or one that does not exist."""


@dataclass(frozen=True)
class KernelChoice:
    tier: str  # a tier's name, or cpu_tiers.NO_TIER
    library: Path | None  # None for "none"
    reason: str  # why this tier, for the log line at start and `sluice info`


def rebuild_command() -> str:
    """How to build the libraries again where this copy of Sluice came from."""
    builder = cpu_tiers.KERNEL_DIR.parents[2] / "csrc" / "build_kernels.py"
    if builder.is_file():
        return f"{sys.executable} {builder} (scripts/setup runs it)"
    return "pip install --force-reinstall on Sluice's wheel (the wheel carries the libraries)"


def read_manifest(kernel_dir: Path = cpu_tiers.KERNEL_DIR) -> dict:
    path = kernel_dir / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
        assert isinstance(manifest.get("tiers"), dict)
    except (OSError, ValueError, AssertionError) as exc:
        raise KernelLibraryError(
            f"the CPU kernel libraries' manifest {path} is missing or unreadable ({exc}); "
            f"rebuild them with {rebuild_command()}"
        ) from None
    return manifest


def verified_library(tier: str, kernel_dir: Path = cpu_tiers.KERNEL_DIR) -> Path:
    """The tier's library, once its bytes match the manifest's SHA-256."""
    entry = read_manifest(kernel_dir)["tiers"].get(tier)
    if entry is None:
        raise KernelLibraryError(
            f"no {tier} kernel library was built into {kernel_dir}; rebuild them with {rebuild_command()}"
        )
    path = kernel_dir / entry["file"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KernelLibraryError(
            f"the {tier} kernel library {path} cannot be read ({exc.strerror}); rebuild it with {rebuild_command()}"
        ) from None
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise KernelLibraryError(
            f"the {tier} kernel library {path} is corrupt (its SHA-256 is not the one its build recorded); "
            f"rebuild it with {rebuild_command()}"
        )
    return path


def choose_kernels(
    cpu_isa: str,
    flags: frozenset[str] | None = None,
    arch: str | None = None,
    kernel_dir: Path = cpu_tiers.KERNEL_DIR,
) -> KernelChoice:
    """The tier to run for --cpu-isa on this CPU, its library verified; raises CpuIsaError or
    KernelLibraryError with what is wrong."""
    flags = cpu_tiers.cpu_flags() if flags is None else flags
    arch = cpu_tiers.host_arch() if arch is None else arch
    if cpu_isa == cpu_tiers.NO_TIER:
        return KernelChoice(cpu_tiers.NO_TIER, None, "--cpu-isa none: torch's own ops")
    if cpu_isa == "auto":
        runnable = cpu_tiers.runnable_tiers(arch, flags)
        if not runnable:
            why = (
                f"Sluice has no CPU kernels for {arch}"
                if not cpu_tiers.tiers_for(arch)
                else f"this {arch} CPU lacks every tier's instructions"
            )
            return KernelChoice(cpu_tiers.NO_TIER, None, f"{why}: running on torch's own ops")
        tier = runnable[0]
        return KernelChoice(tier.name, verified_library(tier.name, kernel_dir), "the best tier this CPU runs")
    if cpu_isa not in cpu_tiers.CPU_ISA_CHOICES:
        raise CpuIsaError(f"--cpu-isa {cpu_isa!r}: expected one of {', '.join(cpu_tiers.CPU_ISA_CHOICES)}")
    tier = cpu_tiers.tier_named(cpu_isa)
    if tier.arch != arch:
        raise CpuIsaError(f"--cpu-isa {cpu_isa}: that tier is for {tier.arch} CPUs, and this one is {arch}")
    missing = cpu_tiers.missing_flags(tier, flags)
    if missing:
        raise CpuIsaError(
            f"--cpu-isa {cpu_isa}: this CPU lacks {' '.join(missing)} (its flags: {' '.join(sorted(flags))}); "
            f"it runs {', '.join(t.name for t in cpu_tiers.runnable_tiers(arch, flags)) or 'no tier'} and none"
        )
    return KernelChoice(tier.name, verified_library(tier.name, kernel_dir), f"--cpu-isa {cpu_isa}")
