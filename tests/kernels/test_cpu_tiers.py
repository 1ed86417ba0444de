"""Which kernel tier a CPU runs (--cpu-isa), and what is refused: a tier the CPU lacks, a library that is
missing, corrupt or of another ABI. Flags are given as a CPU would report them, so every rule is checked
on any machine; the real CPU's own choice is checked through `sluice info` and `sluice serve`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from serve_fixtures import SLUICE
from sluice import cpu_tiers
from sluice.kernel_libraries import CpuIsaError, KernelLibraryError, choose_kernels
from tiers import KERNEL_TIERS
from worker.native_abi import ABI_VERSION
from worker.native_ops import NativeOps

V3 = frozenset(cpu_tiers.tier_named("avx2").requires)
AVX512 = frozenset(cpu_tiers.tier_named("avx512").requires)
BF16 = frozenset(cpu_tiers.tier_named("avx512bf16").requires)
ZEN3 = V3 | {"sse4_2", "aes"}
ZEN5 = BF16 | {"sse4_2", "aes"}


@pytest.fixture
def kernel_dir(tmp_path: Path) -> Path:
    """A copy of the built x86 libraries and their manifest, for tests that break them."""
    manifest = json.loads((cpu_tiers.KERNEL_DIR / "manifest.json").read_text())
    for entry in manifest["tiers"].values():
        shutil.copy(cpu_tiers.KERNEL_DIR / entry["file"], tmp_path / entry["file"])
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


def choose(cpu_isa: str, flags: frozenset[str], kernel_dir: Path, arch: str = "x86_64"):
    return choose_kernels(cpu_isa, flags, arch, kernel_dir)


@pytest.mark.skipif(cpu_tiers.host_arch() != "x86_64", reason="these tests copy the x86 libraries")
class TestX86Choices:
    def test_auto_picks_the_best_tier_the_flags_allow(self, kernel_dir: Path) -> None:
        assert choose("auto", ZEN5, kernel_dir).tier == "avx512bf16"
        assert choose("auto", AVX512, kernel_dir).tier == "avx512"
        # An image moved to an older host: the same libraries, the tier that host runs (never SIGILL).
        assert choose("auto", ZEN3, kernel_dir).tier == "avx2"

    def test_a_cap_picks_that_tier_where_the_cpu_has_it(self, kernel_dir: Path) -> None:
        for tier in ("avx512bf16", "avx512", "avx2"):
            choice = choose(tier, ZEN5, kernel_dir)
            assert choice.tier == tier and choice.library == kernel_dir / f"libsluice_kernels_{tier}.so"
        assert choose("none", ZEN5, kernel_dir).library is None

    def test_a_tier_the_cpu_lacks_is_refused_naming_its_flags(self, kernel_dir: Path) -> None:
        with pytest.raises(
            CpuIsaError, match=r"lacks avx512f .*\(its flags: .*avx2.*\); it runs avx2 and none"
        ):
            choose("avx512", ZEN3, kernel_dir)
        with pytest.raises(CpuIsaError, match="lacks avx512_bf16"):
            choose("avx512bf16", AVX512, kernel_dir)
        with pytest.raises(CpuIsaError, match="for aarch64 CPUs, and this one is x86_64"):
            choose("neon", ZEN5, kernel_dir)
        with pytest.raises(CpuIsaError, match="expected one of auto"):
            choose("sse2", ZEN5, kernel_dir)

    def test_an_x86_cpu_without_avx2_runs_torch_and_says_why(self, kernel_dir: Path) -> None:
        choice = choose("auto", frozenset({"sse2", "sse4_2"}), kernel_dir)
        assert choice.tier == "none" and "lacks every tier" in choice.reason

    def test_a_missing_library_is_named_with_the_command_that_rebuilds_it(self, kernel_dir: Path) -> None:
        (kernel_dir / "libsluice_kernels_avx2.so").unlink()
        with pytest.raises(
            KernelLibraryError, match=r"libsluice_kernels_avx2\.so cannot be read .*build_kernels\.py"
        ):
            choose("auto", ZEN3, kernel_dir)
        (kernel_dir / "manifest.json").unlink()
        with pytest.raises(
            KernelLibraryError, match=r"manifest .*manifest\.json is missing.*build_kernels\.py"
        ):
            choose("auto", ZEN3, kernel_dir)

    def test_a_corrupt_library_is_refused_before_it_loads(self, kernel_dir: Path) -> None:
        library = kernel_dir / "libsluice_kernels_avx2.so"
        data = bytearray(library.read_bytes())
        data[len(data) // 2] ^= 0xFF
        library.write_bytes(bytes(data))
        with pytest.raises(
            KernelLibraryError, match=r"libsluice_kernels_avx2\.so is corrupt.*build_kernels\.py"
        ):
            choose("avx2", ZEN3, kernel_dir)
        library.write_bytes(bytes(data[:4096]))
        with pytest.raises(KernelLibraryError, match="corrupt"):
            choose("avx2", ZEN3, kernel_dir)


def test_arm_picks_neon_and_another_architecture_runs_torch() -> None:
    assert choose_kernels("auto", frozenset({"fp", "asimd"}), "riscv64").tier == "none"
    choice = choose_kernels("auto", frozenset(), "riscv64")
    assert choice.tier == "none" and "no CPU kernels for riscv64" in choice.reason
    with pytest.raises(CpuIsaError, match="lacks asimd"):
        choose_kernels("neon", frozenset({"fp"}), "aarch64")


def test_a_library_that_does_not_load_or_speaks_another_abi_is_refused(tmp_path: Path) -> None:
    garbage = tmp_path / "libsluice_kernels_avx2.so"
    garbage.write_bytes(b"not an ELF file")
    with pytest.raises(KernelLibraryError, match=r"does not load .*build_kernels\.py"):
        NativeOps("avx2", garbage)
    source = tmp_path / "old.c"
    source.write_text("int sluice_abi_version(void) { return 999; }\n")
    old = tmp_path / "libold.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(old)], check=True)
    with pytest.raises(KernelLibraryError, match="does not load .*speaks kernel ABI 999"):
        NativeOps("avx2", old)


def test_sluice_info_reports_the_tier_this_cpu_runs() -> None:
    done = subprocess.run([str(SLUICE), "info", "--json"], capture_output=True, text=True, check=True)
    info = json.loads(done.stdout)
    best = KERNEL_TIERS[0] if KERNEL_TIERS else "none"
    assert info["chosen"]["tier"] == best
    assert [row["tier"] for row in info["tiers"] if row["runs_here"]] == KERNEL_TIERS
    if KERNEL_TIERS:
        assert info["kernel_library"]["tier"] == best and info["kernel_library"]["abi"] == ABI_VERSION
    lacking = next((t.name for t in cpu_tiers.TIERS if t.name not in KERNEL_TIERS), None)
    assert lacking is not None
    refused = subprocess.run(
        [str(SLUICE), "info", "--cpu-isa", lacking], capture_output=True, text=True, check=False
    )
    assert refused.returncode == 1 and f"--cpu-isa {lacking}:" in refused.stdout


def test_serve_refuses_a_tier_the_cpu_lacks_before_any_process_starts(default_model_path: Path) -> None:
    lacking = next(t.name for t in cpu_tiers.TIERS if t.name not in KERNEL_TIERS)
    done = subprocess.run(
        [
            str(SLUICE),
            "serve",
            str(default_model_path),
            "--cpu-isa",
            lacking,
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "SLUICE_API_KEY": ""},
    )
    assert done.returncode == 2
    assert f"sluice: error: --cpu-isa {lacking}:" in done.stderr
    # Refused before the frontend or an engine core ran: neither printed a word.
    assert "sluice-frontend" not in done.stderr and "engine core" not in done.stderr
