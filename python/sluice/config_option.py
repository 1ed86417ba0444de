"""How a configuration field declares its command-line option, so that the CLI is generated from the config.

A field of a config section that users set is declared with `setting(default, help, ...)`: the help, the flag's
name where it differs from the field's, and the bounds its parser checks. `sluice.engine_args` builds the
argparse options (their type, choices and default from the field itself) and maps parsed values back.
A field declared without `setting` has no option: it is set only in code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Which commands offer an option: "engine" every command that runs an engine (generate, serve, the engine
# core process); "serve" only `sluice serve`, for settings of the processes it starts around the engine.
OptionScope = Literal["engine", "serve"]


@dataclass(frozen=True, slots=True)
class ConfigOption:
    help: str
    # The long flag; None: the field's name with dashes (`--max-num-seqs`).
    flag: str | None = None
    # A second, short spelling (`-tp`).
    alias: str | None = None
    metavar: str | None = None
    # Bounds of a number (of each number of a tuple): at_least is inclusive, above exclusive.
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    # A string field's allowed values, where its type is not a Literal.
    choices: tuple[str, ...] | None = None
    scope: OptionScope = "engine"


def setting(default: Any, help: str, **option: Any) -> Any:
    """A dataclass field with `default` whose command-line option ConfigOption(help, **option) describes."""
    return field(default=default, metadata={"option": ConfigOption(help=help, **option)})


def option_of(metadata: Any) -> ConfigOption | None:
    return metadata.get("option")
