"""The instruction-set tiers that Sluice's CPU kernels are built for, and which one a CPU runs.

One kernel library is built per tier of the machine's architecture (csrc/build_kernels.py, which reads
TIERS from this file: it must stay free of imports beyond the standard library). At start the worker
loads the best tier whose instructions this CPU has, read from its own feature flags (/proc/cpuinfo), as
llama.cpp's GGML_CPU_ALL_VARIANTS and oneDNN choose; KernelConfig.cpu_isa (--cpu-isa) caps it. "none" is
no Sluice kernel at all: torch's own ops, the reference the tiers are tested against, and what a CPU of
another architecture runs.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Tier:
    name: str
    arch: str  # platform.machine() of the CPUs that run it
    # The compiler's target flags for the tier's library.
    cflags: tuple[str, ...]
    # The /proc/cpuinfo flags (x86 "flags", aarch64 "Features") that a CPU must report to run it.
    requires: tuple[str, ...]
    description: str


_X86_64_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_AVX512 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni")

# Per architecture, best first.
TIERS: tuple[Tier, ...] = (
    Tier(
        "avx512bf16",
        "x86_64",
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
        _X86_64_V3 + _AVX512 + ("avx512_bf16",),
        "AVX-512 with BF16 dot products (vdpbf16ps): Zen 4 and later, Cooper Lake, Sapphire Rapids",
    ),
    Tier(
        "avx512",
        "x86_64",
        ("-march=x86-64-v4", "-mavx512vnni"),
        _X86_64_V3 + _AVX512,
        "AVX-512 F/BW/CD/DQ/VL with VNNI: Cascade Lake, Ice Lake",
    ),
    Tier(
        "avx2",
        "x86_64",
        ("-march=x86-64-v3",),
        _X86_64_V3,
        "x86-64-v3 (AVX2, FMA, F16C): Haswell and later, every Zen",
    ),
    Tier(
        "neon",
        "aarch64",
        ("-march=armv8-a",),
        ("fp", "asimd"),
        "ARMv8-A NEON: Graviton, Ampere, Apple Silicon under Linux, Raspberry Pi 4",
    ),
)
NO_TIER = "none"
# What --cpu-isa accepts: "auto" (the best this CPU runs), a tier's name, or "none".
CPU_ISA_CHOICES: tuple[str, ...] = ("auto", *(tier.name for tier in TIERS), NO_TIER)
# Where the worker looks for the built libraries and their manifest.json (csrc/build_kernels.py --out).
KERNEL_DIR = Path(__file__).resolve().parents[1] / "worker" / "kernel_libs"
LIBRARY_PATTERN = "libsluice_kernels_{tier}.so"


def tiers_for(arch: str) -> list[Tier]:
    """The tiers built for an architecture, best first; none for an architecture Sluice has no kernels for."""
    return [tier for tier in TIERS if tier.arch == arch]


def tier_named(name: str) -> Tier:
    for tier in TIERS:
        if tier.name == name:
            return tier
    raise KeyError(name)


def host_arch() -> str:
    return platform.machine()


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """This CPU's feature flags as the kernel reports them (which leaves out what the OS does not enable,
    such as AVX-512 state that XSAVE does not save)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def missing_flags(tier: Tier, flags: frozenset[str]) -> list[str]:
    return [flag for flag in tier.requires if flag not in flags]


def runnable_tiers(arch: str, flags: frozenset[str]) -> list[Tier]:
    """The tiers of arch whose instructions this CPU has, best first."""
    return [tier for tier in tiers_for(arch) if not missing_flags(tier, flags)]
