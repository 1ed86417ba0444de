"""The command line and environment of each child: the engine core, the frontend and the router."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sluice.binaries import FRONTEND, ROUTER, rust_binary
from sluice.cpu_binding import worker_environment
from sluice.engine_args import add_engine_arguments, device_config_from_args
from sluice.kernel_libraries import choose_kernels
from sluice.serve.child_flags import ChildFlag, child_flags
from sluice.serve.flags import frontend_options

API_KEY_ENV = "SLUICE_API_KEY"


def engine_argv(args: argparse.Namespace, model: Path) -> list[str]:
    """The engine options in `args`, as the engine core process's command line takes them."""
    engine_only = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(engine_only)
    argv = ["--model", str(model)]
    for action in engine_only._actions:
        if action.dest == "model" or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:
            # A plain flag (store_true): present or absent.
            if value:
                argv.append(action.option_strings[0])
        elif isinstance(value, tuple):
            argv += [action.option_strings[0], ",".join(str(v) for v in value)]
        elif value is not None:
            argv += [action.option_strings[0], str(value)]
    return argv


def engine_core_argv(args: argparse.Namespace, model: Path, socket_dir: Path) -> list[str]:
    """The engine core process serving `model` on the IPC sockets in `socket_dir`."""
    argv = [sys.executable, "-m", "engine.engine_core_server"]
    argv += ["--input", f"ipc://{socket_dir}/input", "--output", f"ipc://{socket_dir}/output"]
    if args.restart_engine:
        argv.append("--restarted-on-failure")
    return argv + engine_argv(args, model)


def _forwarded(args: argparse.Namespace, flags: Sequence[ChildFlag]) -> list[str]:
    """The command-line form of each of `flags` given to serve; those read from the environment go there
    (child_environment), and those not given are left to the child's default."""
    argv: list[str] = []
    for flag in flags:
        value = getattr(args, flag.name)
        if flag.env is not None or value is None or value is False:
            continue
        argv += [flag.flag] if value is True else [flag.flag, str(value)]
    return argv


def frontend_argv(
    args: argparse.Namespace, model_dir: Path, name: str, socket_dir: Path, host: str, port: int
) -> list[str]:
    argv = [
        str(rust_binary(FRONTEND)),
        "--model-dir",
        str(model_dir),
        "--served-model-name",
        name,
        "--host",
        host,
        "--port",
        str(port),
        "--engine-input",
        f"ipc://{socket_dir}/input",
        "--engine-output",
        f"ipc://{socket_dir}/output",
    ]
    argv += _forwarded(args, frontend_options())
    # The engine core's policy, so that the frontend refuses a priority that fcfs would ignore.
    argv += ["--scheduling-policy", args.scheduling_policy]
    if args.restart_engine:
        argv.append("--reconnect-engine")
    # The tier the workers will load.
    if args.device == "cpu":
        argv += ["--cpu-kernels", choose_kernels(args.cpu_isa).tier]
    return argv


def router_argv(args: argparse.Namespace, model_dir: Path, replica_urls: Sequence[str]) -> list[str]:
    """The router on serve's own address, cache-aware over the replicas (the model for exact matching)."""
    argv = [
        str(rust_binary(ROUTER)),
        "--host",
        args.host,
        "--port",
        str(args.port),
    ]
    argv += ["--policy", "cache-aware", "--model", str(model_dir)]
    for url in replica_urls:
        argv += ["--replica", url]
    # Every frontend option that the router declares too (the settings of sluice_common's ServerArgs).
    router_flags = {flag.name for flag in child_flags(ROUTER)}
    argv += _forwarded(args, [flag for flag in frontend_options() if flag.name in router_flags])
    return argv


def child_environment(args: argparse.Namespace, with_key: bool) -> dict[str, str]:
    """Our environment for a child. With `with_key` (the frontends and the router), SLUICE_API_KEY
    holds the key given by --api-key or our own SLUICE_API_KEY, so that it never appears on a command
    line; it is removed otherwise, and when --api-key-file names the key."""
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    if not with_key:
        return env
    if args.api_key is not None:
        env[API_KEY_ENV] = args.api_key
    elif args.api_key_file is None and os.environ.get(API_KEY_ENV):
        env[API_KEY_ENV] = os.environ[API_KEY_ENV]
    return env


def engine_environment(args: argparse.Namespace) -> dict[str, str]:
    """An engine core's environment, with the OpenMP spin count of its workers: under --executor
    inproc the engine core's own threads run the forward pass."""
    return worker_environment(device_config_from_args(args), child_environment(args, with_key=False))
