"""The routers under test: this repository's `sluice-router`, and the peer `vllm-router` 0.1.17 from a
venv of its own (never the project's): `python -m venv DIR && DIR/bin/pip install vllm-router==0.1.17`.

Both are found the way the other peers are: an option, else a variable; without one, a script runs
the legs it can and says which it left out.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from servers import Server, free_port, start_server

SLUICE_ROUTER_ENV = "SLUICE_ROUTER"
VLLM_ROUTER_VENV_ENV = "SLUICE_BENCH_VLLM_ROUTER_VENV"
# Policy names as each router spells them.
SLUICE_POLICIES = {"cache-aware": "cache-aware", "round-robin": "round-robin"}
VLLM_POLICIES = {"cache-aware": "cache_aware", "round-robin": "round_robin"}


def sluice_router_binary() -> Path | None:
    """$SLUICE_ROUTER, else the binary `pip install` put next to this interpreter, else PATH's."""
    override = os.environ.get(SLUICE_ROUTER_ENV)
    candidates = [Path(override)] if override else [Path(sys.executable).parent / "sluice-router"]
    found = shutil.which("sluice-router")
    if not override and found:
        candidates.append(Path(found))
    return next((path for path in candidates if os.access(path, os.X_OK)), None)


def vllm_router_venv(option: str | None) -> Path | None:
    """The venv from the option, else $SLUICE_BENCH_VLLM_ROUTER_VENV; None: no vllm-router legs."""
    value = option or os.environ.get(VLLM_ROUTER_VENV_ENV)
    if not value:
        return None
    venv = Path(value).expanduser().resolve()
    if not os.access(venv / "bin" / "vllm-router", os.X_OK):
        raise SystemExit(f"no vllm-router in {venv}/bin: install vllm-router==0.1.17 into that venv")
    return venv


def start_sluice_router(
    name: str, binary: Path, replicas: list[str], policy: str, model: Path | None, log_dir: Path
) -> Server:
    port = free_port()
    argv = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--policy", SLUICE_POLICIES[policy]]
    if model is not None:
        argv += ["--model", str(model)]
    for url in replicas:
        argv += ["--replica", url]
    return start_server(name, port, argv, None, log_dir)


def start_vllm_router(name: str, venv: Path, replicas: list[str], policy: str, log_dir: Path) -> Server:
    port = free_port()
    argv = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port)]
    # Its Prometheus exporter takes a fixed port unless told otherwise: two routers would collide.
    argv += ["--prometheus-port", str(free_port()), "--log-level", "warning"]
    argv += ["--policy", VLLM_POLICIES[policy], "--worker-urls", *replicas]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return start_server(name, port, argv, env, log_dir)
