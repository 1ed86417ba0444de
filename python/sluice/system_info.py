"""`sluice info`: what Sluice sees of this machine and what it would run here, as vLLM's collect-env
reports it: the CPU's features, the kernel tiers built and the one chosen, thread binding, and the
versions of Python, torch and the kernel libraries."""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from sluice import cpu_tiers
from sluice.config import DeviceConfig
from sluice.cpu_binding import cores_per_rank, omp_spin_count, threads_per_rank, usable_cores
from sluice.errors import SluiceError
from sluice.kernel_libraries import KernelLibraryError, choose_kernels, read_manifest, verified_library


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "CPU part"):
            return value.strip()
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _tier_rows(flags: frozenset[str], arch: str, chosen: str) -> list[dict[str, Any]]:
    """Per tier of this architecture: whether this CPU runs it and whether its library is intact."""
    try:
        manifest_tiers = read_manifest()["tiers"]
    except KernelLibraryError:
        manifest_tiers = {}
    rows = []
    for tier in cpu_tiers.tiers_for(arch):
        missing = cpu_tiers.missing_flags(tier, flags)
        try:
            library: str = str(verified_library(tier.name))
        except KernelLibraryError as exc:
            library = f"unusable: {exc}"
        rows.append(
            {
                "tier": tier.name,
                "runs_here": not missing,
                "missing_flags": missing,
                "library": library,
                "cflags": manifest_tiers.get(tier.name, {}).get("cflags", list(tier.cflags)),
                "chosen": tier.name == chosen,
                "description": tier.description,
            }
        )
    return rows


def collect(cpu_isa: str, device: DeviceConfig) -> dict[str, Any]:
    """Everything `sluice info` prints, as plain values (its --json form)."""
    cpuinfo = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    flags = cpu_tiers.cpu_flags(cpuinfo) if cpuinfo else frozenset()
    arch = cpu_tiers.host_arch()
    try:
        choice = choose_kernels(cpu_isa, flags, arch)
        chosen: dict[str, Any] = {
            "tier": choice.tier,
            "reason": choice.reason,
            "library": str(choice.library),
        }
    except SluiceError as exc:
        chosen = {"tier": None, "error": str(exc)}
    try:
        manifest = read_manifest()
        build = {
            "compiler": manifest.get("compiler"),
            "built": manifest.get("built"),
            "arch": manifest.get("arch"),
        }
    except KernelLibraryError as exc:
        build = {"error": str(exc)}
    usable = usable_cores()
    pinned = cores_per_rank(device, 1, usable)
    relevant = sorted({flag for tier in cpu_tiers.tiers_for(arch) for flag in tier.requires} & flags)
    info: dict[str, Any] = {
        "sluice": _version("sluice"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": {
            "model": _cpu_model(cpuinfo),
            "arch": arch,
            "usable_cores": usable,
            "tier_flags": relevant,
        },
        "cpu_isa": cpu_isa,
        "chosen": chosen,
        "tiers": _tier_rows(flags, arch, chosen.get("tier")),
        "kernel_build": build,
        "threads": {
            "cpu_bind": device.cpu_bind,
            "pinned_cores": pinned[0] if pinned else None,
            "threads": threads_per_rank(device, 1, usable),
            "omp_spin_count": omp_spin_count(device, {}),
        },
    }
    info.update(_torch_and_kernels(chosen.get("tier")))
    return info


def _torch_and_kernels(tier: str | None) -> dict[str, Any]:
    """torch's version and threads, and the chosen library's own answer (its ABI and tier) once loaded."""
    try:
        import torch
    except ImportError as exc:
        return {"torch": f"not importable: {exc}"}
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_parallel": torch.__config__.parallel_info().splitlines()[-1].strip(),
    }
    if tier in (None, cpu_tiers.NO_TIER):
        return out
    from worker.native_ops import native_ops_for

    try:
        ops = native_ops_for(tier)
        assert ops is not None
        out["kernel_library"] = {
            "tier": ops.library.sluice_tier().decode(),
            "abi": ops.library.sluice_abi_version(),
            "path": str(ops.path),
        }
    except SluiceError as exc:
        out["kernel_library"] = {"error": str(exc)}
    return out


def render(info: dict[str, Any]) -> str:
    cpu = info["cpu"]
    lines = [
        f"Sluice {info['sluice']}, Python {info['python']}, torch {info.get('torch')}",
        f"platform: {info['platform']}",
        f"CPU: {cpu['model']} ({cpu['arch']}), usable cores {cpu['usable_cores']}",
        f"  tier flags: {' '.join(cpu['tier_flags']) or 'none'}",
        "kernel libraries: "
        + (
            info["kernel_build"]["error"]
            if "error" in info["kernel_build"]
            else f"{info['kernel_build']['arch']}, built {info['kernel_build']['built']} by {info['kernel_build']['compiler']}"
        ),
        "tiers:",
    ]
    for row in info["tiers"]:
        runs = "runs here" if row["runs_here"] else f"not this CPU (lacks {' '.join(row['missing_flags'])})"
        mark = "->" if row["chosen"] else "  "
        lines.append(f"  {mark} {row['tier']:<11} {runs}; {row['library']}")
    lines.append(
        f"  {'->' if info['chosen'].get('tier') == cpu_tiers.NO_TIER else '  '} none        torch's own ops"
    )
    chosen = info["chosen"]
    if chosen.get("tier") is None:
        lines.append(chosen["error"])
    else:
        lines.append(f"--cpu-isa {info['cpu_isa']}: {chosen['tier']} ({chosen['reason']})")
    if "kernel_library" in info:
        lines.append(f"  loaded: {info['kernel_library']}")
    threads = info["threads"]
    lines.append(
        f"threads: {threads['threads']} per worker (one rank), --cpu-bind {threads['cpu_bind']}: "
        f"pinned to {threads['pinned_cores'] if threads['pinned_cores'] is not None else 'nothing'}; "
        f"GOMP_SPINCOUNT {threads['omp_spin_count']}"
    )
    if "torch_threads" in info:
        lines.append(f"torch: {info['torch_threads']} threads here, {info['torch_parallel']}")
    return "\n".join(lines)


def run(cpu_isa: str, device: DeviceConfig, as_json: bool) -> int:
    """Prints the report; 1 where --cpu-isa cannot run here, else 0."""
    info = collect(cpu_isa, device)
    print(json.dumps(info, indent=2) if as_json else render(info))
    return 0 if info["chosen"].get("tier") is not None else 1
