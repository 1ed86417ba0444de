"""`sluice serve`'s options: its own address and model name, each frontend flag it forwards (from the
frontend's own schema), the engine restart settings, and the engine's options (engine_args)."""

from __future__ import annotations

import argparse
from typing import Any

from sluice.binaries import FRONTEND
from sluice.config import EngineRestartConfig
from sluice.engine_args import (
    SERVE_SCOPE,
    add_engine_arguments,
    add_section_arguments,
    number_parser,
    section_from_args,
)
from sluice.serve.child_flags import ChildFlag, child_flags

# The frontend's flags that serve sets itself, from its own options and the replica it starts: it does not offer them.
WIRED_FRONTEND_FLAGS = frozenset(
    {
        "model_dir",
        "served_model_name",
        "host",
        "port",
        "engine_input",
        "engine_output",
        "engine_pid",
        "reconnect_engine",
        "scheduling_policy",
        "cpu_kernels",
    }
)
# The two ways to give the API key, which exclude each other.
_KEY_FLAGS = ("api_key", "api_key_file")


def frontend_options() -> tuple[ChildFlag, ...]:
    """The frontend's flags that `sluice serve` offers as its own and forwards."""
    return tuple(flag for flag in child_flags(FRONTEND) if flag.name not in WIRED_FRONTEND_FLAGS)


def add_frontend_arguments(group: argparse._ArgumentGroup) -> None:
    """An option for each of frontend_options(), parsed into its name; None (absent) leaves the child's default."""
    key = group.add_mutually_exclusive_group()
    for flag in frontend_options():
        assert not flag.required and not flag.repeated, f"serve cannot forward {flag.flag}"
        if flag.env:
            default = f"${flag.env}, else none"
        else:
            default = "off" if flag.kind == "flag" else f"the frontend's, {flag.default or 'none'}"
        kwargs: dict[str, Any] = {"dest": flag.name, "help": f"{flag.help} (default: {default})"}
        if flag.kind == "flag":
            kwargs["action"] = "store_true"
        else:
            kwargs["default"] = None
            kwargs["choices"] = flag.choices
            if flag.kind in ("int", "float"):
                # The children's numbers are unsigned or checked positive there; refuse a negative one here.
                kwargs["type"] = number_parser(int if flag.kind == "int" else float, at_least=0)
        (key if flag.name in _KEY_FLAGS else group).add_argument(flag.flag, **kwargs)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: the model folder's name)",
    )
    add_frontend_arguments(group)
    add_section_arguments(group, EngineRestartConfig, SERVE_SCOPE)
    add_engine_arguments(parser, model_positional=True, scopes=SERVE_SCOPE)


def restart_config_from_args(args: argparse.Namespace) -> EngineRestartConfig:
    return section_from_args(EngineRestartConfig, args)
