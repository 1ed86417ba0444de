"""The flags that a Rust child declares, read from its `--flag-schema` (common/src/flag_schema.rs), so that
`sluice serve` offers each of them and forwards it to every child that declares it, with no list of its own."""

from __future__ import annotations

import functools
import json
import subprocess
from dataclasses import dataclass
from typing import Literal

from sluice.binaries import rust_binary
from sluice.errors import SluiceError

FLAG_SCHEMA_ARG = "--flag-schema"


@dataclass(frozen=True, slots=True)
class ChildFlag:
    # clap's id: the field's name, and the attribute serve parses it into.
    name: str
    flag: str
    help: str
    # "flag": present or absent; else the kind of its value.
    kind: Literal["flag", "int", "float", "text"]
    default: str | None
    choices: tuple[str, ...] | None
    # The environment variable it is read from as well (the API key): serve hands it on there, never on argv.
    env: str | None
    required: bool
    repeated: bool


@functools.cache
def child_flags(binary: str) -> tuple[ChildFlag, ...]:
    """`binary`'s long flags, as it describes them."""
    path = rust_binary(binary)
    done = subprocess.run(
        [str(path), FLAG_SCHEMA_ARG], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise SluiceError(
            f"{path} {FLAG_SCHEMA_ARG} exited with status {done.returncode}: {done.stderr.strip()}"
        )
    flags = []
    for described in json.loads(done.stdout):
        choices = described.pop("choices")
        flags.append(ChildFlag(**described, choices=tuple(choices) if choices is not None else None))
    return tuple(flags)
