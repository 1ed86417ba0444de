"""Writing and rendering golden msgpack vectors: one .msgpack file per message plus index.json.

index.json lists each file with its type and its decoded value as JSON, so that a reader in any
language can compare decoded values. JSON has no integer map keys: a map keyed by token id is
written there with its keys as decimal strings; JSON has no bytes either: a msgpack bin (a block
hash) is written there as a lower-case hex string.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgpack


def json_value(value: Any) -> Any:
    """A decoded msgpack value as JSON can hold it: integer map keys become decimal strings, bins hex."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(key): json_value(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_value(item) for item in value]
    return value


def index_entry(stem: str, data: bytes) -> dict[str, Any]:
    value = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return {"file": f"{stem}.msgpack", "type": value["type"], "value": json_value(value)}


def render_index(files: dict[str, bytes], protocol_version: int, spec: str, note: str = "") -> str:
    index = {
        "protocol_version": protocol_version,
        "spec": spec,
        "note": "value is the msgpack body as JSON; maps keyed by token id have decimal-string keys here"
        + note,
        "vectors": [index_entry(stem, data) for stem, data in files.items()],
    }
    return json.dumps(index, indent=2, ensure_ascii=False) + "\n"


def write_vectors(folder: Path, files: dict[str, bytes], index: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for stem, data in files.items():
        (folder / f"{stem}.msgpack").write_bytes(data)
    (folder / "index.json").write_text(index, encoding="utf-8")
    print(f"wrote {len(files)} vectors and index.json to {folder}", file=sys.stderr)
