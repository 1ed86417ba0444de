"""No import circle among the modules of either language, and no Python import that runs up the layers.

Python's layers, lowest first (LAYERS): the modules of `sluice` that every process shares (config, seam
types, errors), the worker, the engine core, and the entry points that load the engine in-process. An
import may name its own layer or a lower one, at module level or inside a function. A circle is looked
for in what runs at import time: module-level imports outside `if TYPE_CHECKING:` (a package's
`__init__` that re-exports its modules is no circle with them unless one imports a name from it).

Rust: the modules of each crate (a file, or a folder's mod.rs), linked by the `crate::` and `super::`
paths they name, tests included.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / "python"
# The `sluice` modules that load the engine or the kernels in-process: the package's lazy `LLM`, the
# CLI's offline commands and the system report.
ENTRY_POINTS = {"sluice", "sluice.cli", "sluice.system_info"}
LAYERS = ("shared", "worker", "engine", "entry")
RUST_CRATES = ("common", "frontend", "router")


def layer_of(module: str) -> str:
    if module in ENTRY_POINTS:
        return "entry"
    return {"sluice": "shared", "worker": "worker", "engine": "engine"}[module.split(".")[0]]


def python_modules() -> dict[str, Path]:
    modules = {}
    for path in PYTHON.rglob("*.py"):
        parts = list(path.relative_to(PYTHON).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, known: Iterable[str], module_level_only: bool) -> set[str]:
    """The known modules that `module` imports: every import, or only those that run when it is imported
    (module level, outside `if TYPE_CHECKING:`)."""
    known = set(known)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    if module_level_only:
        nodes = [
            n for n in tree.body if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
        ]
        nodes = [
            n for top in nodes for n in ast.walk(top) if not isinstance(top, (ast.FunctionDef, ast.ClassDef))
        ]
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {resolve(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found |= {resolve(f"{base}.{alias.name}") or resolve(base) for alias in node.names}
    found.discard(None)
    found.discard(module)
    return found  # type: ignore[return-value]


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_python_modules_import_each_other_without_a_circle() -> None:
    modules = python_modules()
    graph = {
        module: imports_of(module, path, modules, module_level_only=True) for module, path in modules.items()
    }
    assert cycles(graph) == []


def test_no_python_import_runs_up_the_layers() -> None:
    modules = python_modules()
    upward = []
    for module, path in modules.items():
        for imported in imports_of(module, path, modules, module_level_only=False):
            if LAYERS.index(layer_of(imported)) > LAYERS.index(layer_of(module)):
                upward.append(f"{module} ({layer_of(module)}) imports {imported} ({layer_of(imported)})")
    assert upward == []


RUST_PATH = re.compile(r"\b(crate|super)::((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*|\{)")


def rust_modules(src: Path) -> dict[str, Path]:
    modules = {}
    for path in src.rglob("*.rs"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] in ("mod", "lib", "main"):
            parts.pop()
        modules["::".join(parts)] = path
    return modules


def rust_paths(text: str) -> Iterable[tuple[str, str]]:
    """(crate or super, the path after it) for each path named, a `{...}` group expanded."""
    text = re.sub(r"//[^\n]*", "", text)
    for match in RUST_PATH.finditer(text):
        anchor, path = match.groups()
        if path != "{":
            yield anchor, path
            continue
        depth, end = 1, match.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        for item in re.split(r",(?![^{]*\})", text[match.end() : end - 1]):
            head = re.match(r"[a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)*", item.strip())
            if head:
                yield anchor, head.group(0)


def rust_graph(src: Path) -> dict[str, set[str]]:
    modules = rust_modules(src)
    graph = {}
    for module, path in modules.items():
        # Inside a module's file (a.rs, or its folder's mod.rs), `super` is its parent; a `mod tests` in
        # the file is the file itself.
        parent = module.rpartition("::")[0]
        linked = set()
        for anchor, named in rust_paths(path.read_text()):
            full = named if anchor == "crate" else (f"{parent}::{named}" if parent else named)
            segments = full.split("::")
            for end in range(len(segments), 0, -1):
                candidate = "::".join(segments[:end])
                if candidate in modules:
                    if candidate != module:
                        linked.add(candidate)
                    break
        graph[module] = linked
    return graph


def test_rust_modules_of_each_crate_name_each_other_without_a_circle() -> None:
    for crate in RUST_CRATES:
        assert cycles(rust_graph(ROOT / crate / "src")) == [], crate


def test_the_checks_find_a_circle_and_an_upward_import() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert list(rust_paths("use crate::{health::HealthConfig, policies::{Policy, ReplicaId}};")) == [
        ("crate", "health"),
        ("crate", "policies"),
    ]
    assert LAYERS.index(layer_of("engine.scheduler")) > LAYERS.index(layer_of("worker.sampler"))
    assert layer_of("sluice.config") == "shared" and layer_of("sluice.cli") == "entry"
