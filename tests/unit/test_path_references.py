"""Every path that the docs and the code's comments name exists in the repository, and none points outside it.

A reference is a relative path with at least two segments whose last one has a file extension, or that ends
in "/" (a folder): `python/worker/native_ops.py`, `tests/golden/protocol/`. It resolves when a tracked file
or folder is that path or ends with it (comments name files relative to their package:
`worker/native_ops.py`). Read from Markdown files whole, and from the comments and docstrings of Python,
Rust, C++, TypeScript, shell, TOML and YAML files; URLs, and paths under the folders that runs write into
(OUTPUT_FOLDERS), are not references.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What benchmarks and tests write, never tracked.
OUTPUT_FOLDERS = ("bench/results/", "test-artifacts/")
EXTENSIONS = (
    *("py", "rs", "cpp", "h", "ts", "tsx", "js", "html", "css", "sh"),
    *("md", "txt", "toml", "json", "yaml", "yml", "cfg", "ini", "lock", "jinja", "tpl"),
    *("msgpack", "gguf", "png"),
)
REFERENCE = re.compile(
    r"(?<![\w/.:@~$<-])"
    r"((?:\.\./|\./)*(?:[A-Za-z0-9_.-]+/)+(?:[A-Za-z0-9_-][A-Za-z0-9_.-]*\.(?:"
    + "|".join(EXTENSIONS)
    + r")\b)?)"
    r"(?![\w/{*<-])"
)
URL = re.compile(r"[a-z]+://\S+")
# Generated text (the playground's bundle) that names paths of other trees.
SKIPPED_PREFIXES = ("frontend/playground/dist/",)
SKIPPED_SUFFIXES = (".json", ".msgpack", ".lock", ".png", ".gguf")


def tracked_files() -> list[str]:
    """The files git tracks or would (not ignored), as they are on disk now."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return sorted({path for path in listing.stdout.split() if (ROOT / path).is_file()})


def python_comments(text: str) -> Iterator[tuple[int, str]]:
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                for offset, line in enumerate(first.value.value.splitlines()):
                    yield first.lineno + offset, line


def line_comments(text: str, marker: str) -> Iterator[tuple[int, str]]:
    """The text after `marker` on each line where it starts a comment (not inside a string literal)."""
    for number, line in enumerate(text.splitlines(), start=1):
        at = line.find(marker)
        while at >= 0 and line[:at].count('"') % 2 == 1:
            at = line.find(marker, at + 1)
        if at >= 0 and (at == 0 or line[at - 1] in " \t!"):
            yield number, line[at + len(marker) :]


def commented_text(path: str, text: str) -> Iterator[tuple[int, str]]:
    suffix = Path(path).suffix
    if suffix == ".md":
        yield from enumerate(text.splitlines(), start=1)
    elif suffix == ".py":
        yield from python_comments(text)
    elif suffix in (".rs", ".cpp", ".h", ".ts", ".tsx", ".js"):
        yield from line_comments(text, "//")
    elif (
        suffix in (".sh", ".toml", ".yaml", ".yml")
        or path.startswith(("scripts/", ".ci/"))
        or path.endswith(("deploy/check", "Dockerfile", "Dockerfile.cuda"))
    ):
        yield from line_comments(text, "#")


def references(path: str, text: str) -> Iterator[tuple[int, str]]:
    for number, line in commented_text(path, text):
        for match in REFERENCE.finditer(URL.sub("", line)):
            reference = match.group(1)
            if reference.rstrip("/").count("/") >= 1 and (
                reference.endswith("/") or "." in reference.rsplit("/", 1)[1]
            ):
                yield number, reference


def unresolved(path: str, reference: str, files: set[str], folders: set[str]) -> str | None:
    """Why `reference` (named in `path`) does not resolve, or None."""
    if reference.startswith("../"):
        target = (ROOT / path).parent / reference
        if not target.resolve().is_relative_to(ROOT):
            return "points outside the repository"
    name = reference
    while name.startswith(("../", "./")):
        name = name.split("/", 1)[1]
    if name.startswith(OUTPUT_FOLDERS):
        return None
    known = folders if name.endswith("/") else files
    if name in known or any(entry.endswith("/" + name) for entry in known):
        return None
    return "names no file of the repository"


def test_every_path_named_in_docs_and_comments_exists_in_the_repository() -> None:
    tracked = tracked_files()
    files = set(tracked)
    folders = {"/".join(f.split("/")[:i]) + "/" for f in tracked for i in range(1, f.count("/") + 1)}
    problems = []
    for path in tracked:
        if path.startswith(SKIPPED_PREFIXES) or path.endswith(SKIPPED_SUFFIXES):
            continue
        try:
            text = (ROOT / path).read_text()
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        for number, reference in references(path, text):
            why = unresolved(path, reference, files, folders)
            if why is not None:
                problems.append(f"{path}:{number}: {reference} {why}")
    assert not problems, "\n".join(problems)


def test_the_scanner_finds_a_missing_file_and_a_path_outside_the_repository() -> None:
    text = "# see python/worker/no_such_file.py and ../elsewhere/NOTES.md, not https://x.org/a/b.py\n"
    found = [reference for _, reference in references("scripts/example.sh", text)]
    assert found == ["python/worker/no_such_file.py", "../elsewhere/NOTES.md"]
    files = {"python/worker/native_ops.py"}
    assert unresolved("README.md", "worker/native_ops.py", files, set()) is None
    assert (
        unresolved("README.md", "python/worker/no_such_file.py", files, set())
        == "names no file of the repository"
    )
    assert unresolved("README.md", "../elsewhere/NOTES.md", files, set()) == "points outside the repository"
