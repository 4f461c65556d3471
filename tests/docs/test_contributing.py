"""CONTRIBUTING.md's module map (the fenced block under "## The tree") against the tree.

Every module of the server, of the Python client and of the benchmark is listed once,
with what it is; no entry names a file that is gone. Each failure says the line to add
or to remove, so that fixing the map is all a move of modules asks of these tests.

An ``__init__.py`` that holds nothing but a docstring need not be listed: its
package's entries say what it holds. The two distributions' ``__init__.py`` are
their public surface, so those are listed whatever they hold, and so is any
``__init__.py`` with code in it.

The map's format: a path (a directory ends with ``/``), then its description; a line
indented under a directory without a description is a path inside it (``_thrift/
scanner.py`` under ``snowflake_server/``, or nested under ``_thrift/`` one level in);
a line indented to the description's column carries the description on;
``{a,b}`` in a path stands for both.
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from tests.docs.render import ROOT

CONTRIBUTING = ROOT / "CONTRIBUTING.md"
MAP_HEADING = "## The tree"
# Every module of these is listed: the two distributions' packages and the benchmark.
MAPPED_PACKAGES = ("snowflake_server/", "clients/python/snowflake_thrift_client/", "bench/")
PUBLIC_INITS = (
    "snowflake_server/__init__.py",
    "clients/python/snowflake_thrift_client/__init__.py",
)
TESTS = "tests/"


@dataclass(frozen=True)
class Entry:
    """One path the map names, with what the map says of it."""

    path: str  # from the repository's root; a directory ends with "/"
    description: str
    line: int  # in CONTRIBUTING.md
    parent: str  # the directory entry it is listed under ("" at the top)
    text: str  # the line as the map has it
    has_children: bool = False


def map_block(markdown: str) -> tuple[list[str], int]:
    """The lines of the first fenced block under "## The tree", and the line number
    (1-based, in ``markdown``) of its first line."""
    lines = markdown.splitlines()
    start = lines.index(MAP_HEADING)
    opening = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i].startswith("```"))
    return lines[opening + 1 : closing], opening + 2


def expand(path: str) -> list[str]:
    """``clients/{go,java}/`` -> ``clients/go/``, ``clients/java/``."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(chosen) for chosen in itertools.product(*choices)]


def parse_map(lines: list[str], first_line: int = 1) -> list[Entry]:
    """The entries of the map's ``lines``, each path expanded and made whole."""
    raw: list[dict[str, object]] = []
    open_dirs: list[tuple[int, str]] = []  # (indent, path) of the directories above
    continues_at: int | None = None  # the column the last entry's description starts at
    for number, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if continues_at is not None and indent >= continues_at and raw:
            raw[-1]["description"] = f"{raw[-1]['description']} {line.strip()}"
            continue
        token, _, description = line.strip().partition(" ")
        description = description.strip()
        while open_dirs and open_dirs[-1][0] >= indent:
            open_dirs.pop()
        parent = open_dirs[-1][1] if open_dirs else ""
        if open_dirs and raw and raw[-1]["path"] == parent:
            raw[-1]["has_children"] = True
        path = parent + token
        raw.append(
            {"path": path, "description": description, "line": number, "parent": parent,
             "text": line.strip()}
        )  # fmt: skip
        if token.endswith("/"):
            open_dirs.append((indent, path))
        continues_at = line.index(description, indent + len(token)) if description else None
    entries = []
    for item in raw:
        for path in expand(str(item["path"])):
            entries.append(
                Entry(
                    path=path,
                    description=str(item["description"]),
                    line=int(str(item["line"])),
                    parent=str(item["parent"]),
                    text=str(item["text"]),
                    has_children=bool(item.get("has_children", False)),
                )
            )
    return entries


def only_a_docstring(init: Path) -> bool:
    body = ast.parse(init.read_text(encoding="utf-8")).body
    return body == [] or (
        len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    )


def modules_to_list() -> list[str]:
    """Every .py file of the mapped packages that the map must name, from the root."""
    found = []
    for package in MAPPED_PACKAGES:
        for module in sorted((ROOT / package).rglob("*.py")):
            path = module.relative_to(ROOT).as_posix()
            if "__pycache__" in module.parts:
                continue
            if (
                module.name == "__init__.py"
                and path not in PUBLIC_INITS
                and only_a_docstring(module)
            ):
                continue
            found.append(path)
    return found


def _entries() -> list[Entry]:
    lines, first_line = map_block(CONTRIBUTING.read_text(encoding="utf-8"))
    return parse_map(lines, first_line)


def _as_listed(path: str) -> str:
    """How the map would list ``path``: under the mapped package that holds it."""
    package = next((p for p in MAPPED_PACKAGES if path.startswith(p)), "")
    return f"under `{package}`: `  {path.removeprefix(package)}    <what it is>`"


def _where(entry: Entry) -> str:
    return f"CONTRIBUTING.md:{entry.line}"


# -- the parser ---------------------------------------------------------------------------


def test_the_map_reads_flat_and_nested_entries_and_carried_descriptions() -> None:
    text = (
        "top.thrift          the top\n"
        "pkg/\n"
        "  a.py              module a\n"
        "  _sub/b.py         module b, flat\n"
        "  _nested/          a nested package\n"
        "    c.py            module c\n"
        "    d.py\n"
        "  tail/             a directory whose description\n"
        "                    goes on here\n"
        "other/{x,y}/        two at once\n"
    )
    entries = parse_map(text.splitlines())
    assert [(e.path, e.description, e.line) for e in entries] == [
        ("top.thrift", "the top", 1),
        ("pkg/", "", 2),
        ("pkg/a.py", "module a", 3),
        ("pkg/_sub/b.py", "module b, flat", 4),
        ("pkg/_nested/", "a nested package", 5),
        ("pkg/_nested/c.py", "module c", 6),
        ("pkg/_nested/d.py", "", 7),
        ("pkg/tail/", "a directory whose description goes on here", 8),
        ("other/x/", "two at once", 10),
        ("other/y/", "two at once", 10),
    ]
    assert [e.path for e in entries if e.has_children] == ["pkg/", "pkg/_nested/"]


# -- the map against the tree ---------------------------------------------------------------


def test_every_module_is_in_the_map() -> None:
    listed = {entry.path for entry in _entries()}
    missing = [path for path in modules_to_list() if path not in listed]
    assert missing == [], "modules missing from CONTRIBUTING.md's map (## The tree); add:\n" + (
        "\n".join(_as_listed(path) for path in missing)
    )


def test_every_entry_of_the_map_exists() -> None:
    stale = []
    for entry in _entries():
        target = ROOT / entry.path
        if not target.exists() or (entry.path.endswith("/") and not target.is_dir()):
            stale.append(f"{_where(entry)}: remove `{entry.text}` ({entry.path} does not exist)")
    assert stale == [], "stale entries in CONTRIBUTING.md's map:\n" + "\n".join(stale)


def test_every_entry_is_listed_once() -> None:
    by_path: dict[str, list[Entry]] = {}
    for entry in _entries():
        by_path.setdefault(entry.path, []).append(entry)
    twice = [
        f"`{path}` on lines {', '.join(str(e.line) for e in entries)}: keep one"
        for path, entries in by_path.items()
        if len(entries) > 1
    ]
    assert twice == [], "entries listed more than once in CONTRIBUTING.md's map:\n" + (
        "\n".join(twice)
    )


def test_every_entry_says_what_it_is() -> None:
    bare = [
        f"{_where(entry)}: `{entry.path}` has no description: say what it holds"
        for entry in _entries()
        if not entry.description and not entry.has_children
    ]
    assert bare == [], "\n".join(bare)


def test_every_test_directory_is_in_the_map() -> None:
    listed = {entry.path for entry in _entries()}
    directories = sorted(
        f"{TESTS}{d.name}/"
        for d in (ROOT / TESTS).iterdir()
        if d.is_dir() and d.name != "__pycache__" and not d.name.startswith(".")
    )
    missing = [d for d in directories if d not in listed]
    assert missing == [], "test directories missing from CONTRIBUTING.md's map; add:\n" + (
        "\n".join(
            f"under `{TESTS}`: `  {d.removeprefix(TESTS)}    <what it tests>`" for d in missing
        )
    )
