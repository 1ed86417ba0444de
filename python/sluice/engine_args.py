"""The engine's command-line options, generated from the config's fields, and the one place where they become
a SluiceConfig.

Every field declared with `setting` (sluice/config_option.py) is an option: its flag, help and bounds from the
setting, its type, choices and default from the field itself. `sluice generate`, `sluice serve` and the engine
core process all call add_engine_arguments, so an option means the same thing, with the same default,
everywhere, and a field added to a section is an option of each of them.
"""

from __future__ import annotations

import argparse
import math
import types
from collections.abc import Callable, Collection
from dataclasses import Field, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from sluice.config import SECTION_TYPES, DeviceConfig, ModelConfig, SluiceConfig
from sluice.config_option import ConfigOption, OptionScope, option_of
from sluice.errors import SluiceError

ENGINE_SCOPE: tuple[OptionScope, ...] = ("engine",)
SERVE_SCOPE: tuple[OptionScope, ...] = ("engine", "serve")


def flag_of(config_field: Field[Any], option: ConfigOption) -> str:
    return option.flag or "--" + config_field.name.replace("_", "-")


def dest_of(config_field: Field[Any], option: ConfigOption) -> str:
    """The attribute of the parsed namespace: the flag's name with underscores (`args.scheduling_policy`)."""
    return flag_of(config_field, option).removeprefix("--").replace("-", "_")


def number_parser(
    kind: type, at_least: float | None = None, above: float | None = None, at_most: float | None = None
) -> Callable[[str], Any]:
    """An argparse type for an int or a float within the bounds (at_least inclusive, above exclusive)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            )
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"must be at least {at_least}, got {text}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be more than {above}, got {text}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be at most {at_most}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _bounded(kind: type, option: ConfigOption) -> Callable[[str], Any]:
    return number_parser(kind, option.at_least, option.above, option.at_most)


def _list_parser(element: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        return tuple(element(part) for part in text.split(","))

    parse.__name__ = "list"
    return parse


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        others = [arg for arg in get_args(annotation) if arg is not type(None)]
        assert len(others) == 1, annotation
        return others[0]
    return annotation


def _argument_kwargs(annotation: Any, option: ConfigOption) -> dict[str, Any]:
    """How argparse parses a field of this type: the action, the type (with the setting's bounds) and choices."""
    kind = _without_none(annotation)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(kind) is Literal:
        return {"choices": get_args(kind)}
    if kind in (int, float):
        return {"type": _bounded(kind, option)}
    if get_origin(kind) is tuple:
        element, ellipsis = get_args(kind)
        assert ellipsis is Ellipsis and element in (int, float), kind
        return {"type": _list_parser(_bounded(element, option))}
    assert kind is str, f"no command-line form for {annotation}"
    return {"choices": option.choices} if option.choices else {}


def _options(section: type, scopes: Collection[OptionScope]) -> list[tuple[Field[Any], ConfigOption, Any]]:
    hints = get_type_hints(section)
    chosen = []
    for config_field in fields(section):
        option = option_of(config_field.metadata)
        if option is not None and option.scope in scopes:
            chosen.append((config_field, option, hints[config_field.name]))
    return chosen


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return ",".join(map(str, default)) if isinstance(default, tuple) else str(default)


def add_section_arguments(
    group: argparse._ArgumentGroup, section: type, scopes: Collection[OptionScope] = ENGINE_SCOPE
) -> None:
    """Add an option for each field of `section` declared with `setting` in one of `scopes`."""
    for config_field, option, annotation in _options(section, scopes):
        names = [flag_of(config_field, option)] + ([option.alias] if option.alias else [])
        default = config_field.default
        help_text = option.help
        if default is not None and "default" not in help_text:
            help_text += f" (default: {_shown(default)})"
        group.add_argument(
            *names,
            dest=dest_of(config_field, option),
            default=default,
            metavar=option.metavar,
            help=help_text,
            **_argument_kwargs(annotation, option),
        )


def section_from_args(section: type, args: argparse.Namespace, **given: Any) -> Any:
    """The `section` that parsed options describe; `given` sets the fields that have no option."""
    values = dict(given)
    for config_field, option, _ in _options(section, SERVE_SCOPE):
        dest = dest_of(config_field, option)
        if hasattr(args, dest):
            values[config_field.name] = getattr(args, dest)
        else:
            # Only `sluice serve` offers these; every other command runs with their defaults.
            assert option.scope == "serve", f"{dest} was not parsed"
    return section(**values)


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    model_positional: bool = False,
    scopes: Collection[OptionScope] = ENGINE_SCOPE,
) -> None:
    """Add the engine's options to `parser`: every section's, in `scopes`.

    The model is `--model PATH`; with model_positional it may also be given as an optional
    positional MODEL (`sluice serve [MODEL]`). Absent both, the default model is used.
    """
    group = parser.add_argument_group("engine")
    model_help = "a local Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)"
    if model_positional:
        group.add_argument("model", nargs="?", default=None, metavar="MODEL", help=model_help)
        group.add_argument("--model", dest="model_option", default=None, metavar="PATH", help=model_help)
    else:
        group.add_argument("--model", dest="model", default=None, metavar="PATH", help=model_help)
    for section in SECTION_TYPES.values():
        add_section_arguments(group, section, scopes)


def model_path_from_args(args: argparse.Namespace) -> str | None:
    """The model folder named on the command line, or None for the default model."""
    positional = getattr(args, "model", None)
    option = getattr(args, "model_option", None)
    if positional is not None and option is not None and positional != option:
        raise SluiceError(f"two models named: {positional} and --model {option}")
    return positional if positional is not None else option


def device_config_from_args(args: argparse.Namespace) -> DeviceConfig:
    return section_from_args(DeviceConfig, args)


def _coerced(annotation: Any, value: Any) -> Any:
    """A keyword's value as its field holds it: a list as a tuple, a number given for a string as its text."""
    kind = _without_none(annotation)
    if value is None:
        return None
    if get_origin(kind) is tuple:
        return tuple(value)
    return str(value) if kind is str and isinstance(value, int | float) else value


def config_from_options(model: str | None = None, **options: Any) -> SluiceConfig:
    """The SluiceConfig that keyword options describe, each named as its command line's (`kv_cache_memory`
    for --kv-cache-memory, `num_kv_blocks`, `graph_mode`): LLM(...)'s keywords. An unknown name is a
    TypeError, as for any function."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    args = parser.parse_args([])
    annotations = {
        dest_of(config_field, option): annotation
        for section in SECTION_TYPES.values()
        for config_field, option, annotation in _options(section, ENGINE_SCOPE)
    }
    unknown = sorted(set(options) - set(annotations))
    if unknown:
        raise TypeError(f"unknown engine options: {', '.join(unknown)}")
    for name, value in options.items():
        setattr(args, name, _coerced(annotations[name], value))
    return config_from_args(args, model_path=model)


def config_from_args(args: argparse.Namespace, model_path: str | None = None) -> SluiceConfig:
    """The SluiceConfig that parsed engine options describe; prepares the default model if none is named.

    `model_path`, when given, is the model folder already resolved from the options."""
    path = model_path or model_path_from_args(args)
    if path is None:
        from sluice.default_model import prepare_default_model

        path = str(prepare_default_model())
    sections = {
        name: section_from_args(kind, args) for name, kind in SECTION_TYPES.items() if kind is not ModelConfig
    }
    return SluiceConfig(model=section_from_args(ModelConfig, args, path=path), **sections)
