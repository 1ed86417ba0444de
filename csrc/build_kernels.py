#!/usr/bin/env python3
"""Builds Sluice's CPU kernel libraries ahead of time: one shared library per instruction-set tier of an
architecture (python/sluice/cpu_tiers.py), from the same sources (csrc/cpu) with each tier's target flags,
plus a manifest.json that names each library with its SHA-256, which the worker checks before it loads one.

    python csrc/build_kernels.py                    # every tier of this machine's architecture, into
                                                    # python/worker/kernel_libs (what scripts/setup runs)
    python csrc/build_kernels.py --arch aarch64 --out DIR   # cross-compile (aarch64-linux-gnu-g++)

The libraries are plain C ABI (csrc/cpu/abi.cpp) with no torch or Python inside, so nothing but a C++17
compiler with OpenMP is needed, and nothing compiles when Sluice runs. Rebuilds are incremental: an object
is compiled again only when its source, a header, the flags or the compiler changed. Standard library only:
the wheel's build backend (csrc/wheel_backend.py) runs it before any dependency is installed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "csrc" / "cpu"
# -fvisibility=hidden: only abi.cpp's sluice_* functions leave the library, so two tiers loaded into one
# process (the tests compare them) never bind each other's symbols.
COMMON_FLAGS = (
    "-std=c++17",
    "-O3",
    "-ffp-contract=fast",
    "-fopenmp",
    "-fPIC",
    "-fvisibility=hidden",
    "-Wall",
)
# libgomp.so.1 by name: in the worker it is the one torch has already loaded, so the process keeps one
# OpenMP runtime.
LINK_FLAGS = ("-shared", "-fopenmp")
CROSS_COMPILERS = {"aarch64": "aarch64-linux-gnu-g++", "x86_64": "x86_64-linux-gnu-g++"}


def _load_tiers():
    spec = importlib.util.spec_from_file_location("cpu_tiers", ROOT / "python" / "sluice" / "cpu_tiers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses looks the module up by name while it builds Tier.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cpu_tiers = _load_tiers()


def compiler_for(arch: str) -> str:
    """$CXX for the host's own architecture, else the Debian cross compiler for arch."""
    if arch == platform.machine():
        return os.environ.get("CXX", "g++")
    return CROSS_COMPILERS.get(arch, f"{arch}-linux-gnu-g++")


def compiler_identity(compiler: str) -> str:
    path = shutil.which(compiler)
    if path is None:
        raise SystemExit(
            f"build_kernels: no C++ compiler {compiler!r} on PATH; install one (Debian: apt-get install g++, or "
            f"g++-aarch64-linux-gnu to cross-compile) or point CXX at it"
        )
    version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    return f"{path}\n{version.splitlines()[0]}"


def digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_tier(tier, compiler: str, identity: str, out: Path, jobs: int) -> Path:
    """The tier's library in out, compiled where anything it depends on changed."""
    sources = sorted(SOURCES.glob("*.cpp"))
    headers = b"".join(p.name.encode() + p.read_bytes() for p in sorted(SOURCES.glob("*.h")))
    flags = [*COMMON_FLAGS, *tier.cflags, f'-DSLUICE_TIER="{tier.name}"']
    objects_dir = out / ".objects" / tier.name
    objects_dir.mkdir(parents=True, exist_ok=True)

    def compile_one(source: Path) -> Path:
        key = digest(identity, " ".join(flags), source.name, source.read_bytes(), headers)[:16]
        obj = objects_dir / f"{source.stem}.{key}.o"
        if not obj.exists():
            tmp = obj.with_suffix(".tmp")
            command = [compiler, *flags, "-c", str(source), "-o", str(tmp)]
            done = subprocess.run(command, check=False, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(
                    f"build_kernels: {tier.name}: compiling {source.name} failed:\n{shlex.join(command)}\n{done.stderr}"
                )
            tmp.replace(obj)
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        objects = list(pool.map(compile_one, sources))
    library = out / cpu_tiers.LIBRARY_PATTERN.format(tier=tier.name)
    stamp = objects_dir / "linked"
    link_key = digest(identity, " ".join(LINK_FLAGS), *(o.name for o in objects))
    if not library.exists() or not stamp.exists() or stamp.read_text() != link_key:
        tmp = library.with_suffix(".tmp")
        command = [compiler, *LINK_FLAGS, *(str(o) for o in objects), "-o", str(tmp)]
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(
                f"build_kernels: {tier.name}: linking failed:\n{shlex.join(command)}\n{done.stderr}"
            )
        tmp.replace(library)
        stamp.write_text(link_key)
    # Objects of older sources are no longer anyone's cache.
    for stale in set(objects_dir.glob("*.o")) - set(objects):
        stale.unlink()
    return library


def build(arch: str, out: Path, tiers: list[str] | None, jobs: int) -> dict:
    chosen = [t for t in cpu_tiers.tiers_for(arch) if tiers is None or t.name in tiers]
    if not chosen:
        raise SystemExit(f"build_kernels: no tier to build for {arch} (tiers: {tiers})")
    compiler = compiler_for(arch)
    identity = compiler_identity(compiler)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "arch": arch,
        "compiler": identity.splitlines()[1],
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tiers": {},
    }
    for tier in chosen:
        started = time.monotonic()
        library = build_tier(tier, compiler, identity, out, jobs)
        manifest["tiers"][tier.name] = {
            "file": library.name,
            "sha256": sha256_of(library),
            "cflags": list(tier.cflags),
        }
        print(f"build_kernels: {tier.name}: {library} ({time.monotonic() - started:.1f} s)", file=sys.stderr)
    previous = out / "manifest.json"
    old = json.loads(previous.read_text()) if previous.exists() else None
    # An unchanged build keeps its manifest (and date), so that a rebuild that did nothing changes nothing.
    if old is None or {k: v for k, v in old.items() if k != "built"} != {
        k: v for k, v in manifest.items() if k != "built"
    }:
        tmp = previous.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.replace(previous)
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", default=platform.machine(), help="target architecture (default: this machine's)"
    )
    parser.add_argument("--out", type=Path, default=cpu_tiers.KERNEL_DIR, help="where the libraries go")
    parser.add_argument("--tier", action="append", help="build only this tier (repeatable)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if not cpu_tiers.tiers_for(args.arch):
        print(
            f"build_kernels: Sluice has no kernels for {args.arch}: it runs on torch's own ops there",
            file=sys.stderr,
        )
        return
    build(args.arch, args.out, args.tier, args.jobs)


if __name__ == "__main__":
    main()
