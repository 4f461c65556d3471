"""Each safety module (the Makefile's SAFETY_MODULES, held to the coverage floor) has a
test file named for it, ``test_<module>.py``, somewhere under tests/."""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs.render import ROOT


def safety_modules(makefile: str) -> list[str]:
    """The paths the Makefile's ``SAFETY_MODULES :=`` lists (continued lines too)."""
    found = re.search(r"^SAFETY_MODULES\s*:=((?:.*\\\n)*.*)$", makefile, re.MULTILINE)
    assert found, "the Makefile has no SAFETY_MODULES := line"
    return found.group(1).replace("\\\n", " ").split()


def test_the_list_is_read_whole() -> None:
    makefile = "X := 1\nSAFETY_MODULES := a/b.py \\\n\tc/_d.py\nNEXT := 2\n"
    assert safety_modules(makefile) == ["a/b.py", "c/_d.py"]


def files_named_for(module: str, tests: list[Path]) -> list[Path]:
    """The test files named for ``module``: ``test_<module>.py`` or
    ``test_<package>_<module>.py`` (``_thrift/protocol.py``: ``test_thrift_protocol.py``),
    but not a ``test_<module>.py`` in the folder of another package (tests/http's
    ``test_protocol.py`` is ``_http/protocol.py``'s)."""
    path = Path(module)
    stem, package = path.stem.lstrip("_"), path.parent.name.lstrip("_")
    packages = {p.name.lstrip("_") for p in (ROOT / "snowflake_server").iterdir() if p.is_dir()}
    return [
        test
        for test in tests
        if test.name == f"test_{package}_{stem}.py"
        or (
            test.name == f"test_{stem}.py"
            and not (test.parent.name in packages and test.parent.name != package)
        )
    ]


def test_every_safety_module_has_a_test_file_named_for_it() -> None:
    modules = safety_modules((ROOT / "Makefile").read_text(encoding="utf-8"))
    assert modules, "SAFETY_MODULES lists nothing"
    tests = sorted((ROOT / "tests").rglob("test_*.py"))
    missing = [m for m in modules if not files_named_for(m, tests)]
    assert not missing, "safety modules without a test_<module>.py: " + ", ".join(missing)
