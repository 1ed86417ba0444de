"""Write kubeconform's schemas for one Kubernetes version from the PyPI package kubernetes-validate, offline.

kubernetes-validate ships one strict JSON schema per kind whose $refs point into a shared
`_definitions.json` that kubeconform cannot follow. Each kind is written as a standalone file with the
definitions it reaches copied under its own "$defs", so kubeconform reads it with
  -schema-location 'OUT_DIR/{{ .ResourceKind }}{{ .KindSuffix }}.json'
Usage: python k8s_schemas.py K8S_VERSION OUT_DIR      (e.g. 1.33.0)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate

_DEFINITIONS_REF = "_definitions.json#/$defs/"
_LOCAL_REF = "#/$defs/"


def source_dir(version: str) -> Path:
    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}-local-strict"
    if not folder.is_dir():
        raise SystemExit(f"k8s_schemas: kubernetes-validate has no strict schemas for Kubernetes {version}")
    return folder


def localized(node: Any, reached: set[str]) -> Any:
    """`node` with every $ref into the shared definitions made local; the names it refers to go into `reached`."""
    if isinstance(node, list):
        return [localized(item, reached) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            name = value.split("#/$defs/", 1)[1] if "#/$defs/" in value else None
            assert name is not None, f"unexpected $ref {value}"
            reached.add(name)
            out[key] = _LOCAL_REF + name
        else:
            out[key] = localized(value, reached)
    return out


def standalone(schema: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """`schema` with the transitive closure of the definitions it uses under its own $defs."""
    pending: set[str] = set()
    top = localized(schema, pending)
    copied: dict[str, Any] = {}
    while pending:
        name = pending.pop()
        if name in copied:
            continue
        found: set[str] = set()
        copied[name] = localized(definitions[name], found)
        pending |= found - copied.keys()
    top.pop("$id", None)
    top.pop("$schema", None)
    top["$defs"] = copied
    return top


def write_schemas(version: str, out: Path) -> int:
    src = source_dir(version)
    definitions = json.loads((src / "_definitions.json").read_text())["$defs"]
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for path in sorted(src.glob("*.json")):
        if path.name.startswith("_") or path.name == "all.json":
            continue
        schema = json.loads(path.read_text())
        # Only top-level kinds carry a group-version-kind; the rest are fragments kubeconform never asks for.
        if "x-kubernetes-group-version-kind" not in schema:
            continue
        (out / path.name).write_text(json.dumps(standalone(schema, definitions)))
        written += 1
    return written


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    count = write_schemas(sys.argv[1], Path(sys.argv[2]))
    print(f"k8s_schemas: {count} kinds for Kubernetes {sys.argv[1]} in {sys.argv[2]}", file=sys.stderr)


if __name__ == "__main__":
    main()
