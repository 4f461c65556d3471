"""docs/security.md names a test for every defence: each named test exists.

A reference is ``tests/<path>.py::<test name>``; the test is a function (or a class, for
a state machine's test case) defined in that file, found with ``ast``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.docs.render import ROOT

SECURITY = ROOT / "docs" / "security.md"
_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):  # test_x = SomeMachine.TestCase
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def references(markdown: str) -> list[tuple[str, str]]:
    return _REFERENCE.findall(markdown)


def test_every_defence_names_a_test_that_exists() -> None:
    found = references(SECURITY.read_text(encoding="utf-8"))
    assert len(found) >= 30, "the threat model names its tests"
    missing = [
        f"{path}::{name}"
        for path, name in found
        if not (ROOT / path).is_file() or name not in _defined(ROOT / path)
    ]
    assert missing == [], f"docs/security.md names tests that do not exist: {missing}"


def test_a_reference_to_no_test_is_caught(tmp_path: Path) -> None:
    assert references("`tests/a/b.py::test_c` and `tests/d.py::test_e`") == [
        ("tests/a/b.py", "test_c"),
        ("tests/d.py", "test_e"),
    ]
    (tmp_path / "m.py").write_text("def test_here() -> None: ...\nt = X.TestCase\n")
    assert _defined(tmp_path / "m.py") == {"test_here", "t"}
