"""The server's package layers, as CONTRIBUTING.md states them, against every import.

CONTRIBUTING.md says the order once (its "**Layers.**" paragraph); this reads it, so
that moving a package to another layer is an edit of the docs only. Modules are
read with ``ast``, never imported. Every import counts: those under ``if
TYPE_CHECKING:`` too (a lower package that names an upper one's types knows about
it all the same; the type belongs lower, or behind a Protocol the lower package
owns), and those inside functions (a late import is still a dependency).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from tests.docs.render import ROOT

CONTRIBUTING = ROOT / "CONTRIBUTING.md"
PACKAGE = "snowflake_server"
TOP = "__init__"  # the layer name of the package's own __init__.py
_NAMES_IN_ONE_LAYER = re.compile(r"`([^`]+)`")


def layers(markdown: str) -> list[list[str]]:
    """The layers of the "**Layers.**" paragraph, lowest first: the paragraph after it
    that is only `names`, separated by "," within a layer and "<" between layers."""
    _, found, after = markdown.partition("**Layers.**")
    assert found, "CONTRIBUTING.md has no **Layers.** paragraph"
    for paragraph in after.split("\n\n"):
        text = " ".join(paragraph.split())
        if re.fullmatch(r"`[^`]+`(\s*[<,]\s*`[^`]+`)*", text):
            return [_NAMES_IN_ONE_LAYER.findall(layer) for layer in text.split("<")]
    raise AssertionError("no line of `names` separated by < under **Layers.** in CONTRIBUTING.md")


@dataclass(frozen=True)
class Import:
    importer: str  # the module's path from the root, e.g. snowflake_server/_thrift/server.py
    line: int
    imported: str  # the module imported, dotted: snowflake_server._http.connection


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path, modules: set[str]) -> list[Import]:
    """Every import of ``path`` (a module under ``root``) into ``PACKAGE``, resolved:
    ``from .. import _errors`` in ``_thrift/server.py`` is ``snowflake_server._errors``,
    ``from .. import Node`` is ``snowflake_server`` (its ``__init__``)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    where = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                found.append(Import(where, node.lineno, target))
    return sorted(set(found), key=lambda i: (i.line, i.imported))


def layer_of(module: str) -> str:
    """``snowflake_server._thrift.server`` -> ``_thrift``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else TOP


def violations(root: Path, order: list[list[str]]) -> list[str]:
    """What imports against ``order`` in the ``PACKAGE`` under ``root``, one line each."""
    rank = {name: i for i, layer in enumerate(order) for name in layer}
    files = sorted((root / PACKAGE).rglob("*.py"))
    modules = {module_name(path, root) for path in files}
    wrong = []
    for path in files:
        for found in imports_of(path, root, modules):
            mine, theirs = layer_of(module_name(path, root)), layer_of(found.imported)
            if mine == theirs or mine not in rank or theirs not in rank:
                continue  # one package; a package missing from the layers fails on its own
            if rank[theirs] > rank[mine]:
                why = f"{theirs} is a higher layer than {mine}"
            elif rank[theirs] == rank[mine]:
                why = f"{mine} and {theirs} are one layer: neither imports the other"
            else:
                continue
            wrong.append(f"{found.importer}:{found.line} imports {found.imported}: {why}")
    return wrong


def _order() -> list[list[str]]:
    return layers(CONTRIBUTING.read_text(encoding="utf-8"))


def test_every_package_has_a_layer_and_every_layer_a_package() -> None:
    named = [name for layer in _order() for name in layer]
    assert len(named) == len(set(named)), f"a name twice in the layers: {named}"
    top = ROOT / PACKAGE
    packages = {p.stem for p in top.glob("*.py")} | {
        p.name for p in top.iterdir() if (p / "__init__.py").is_file()
    }
    missing = sorted(packages - set(named))
    stale = sorted(set(named) - packages)
    assert missing == [], f"add to the **Layers.** line of CONTRIBUTING.md: {missing}"
    assert stale == [], f"remove from the **Layers.** line of CONTRIBUTING.md: {stale}"


def test_imports_only_go_down_the_layers() -> None:
    wrong = violations(ROOT, _order())
    assert wrong == [], (
        "imports against the layers of CONTRIBUTING.md (**Layers.**); move what is needed "
        "down, or hand it in from above:\n" + "\n".join(wrong)
    )


def test_the_check_resolves_relative_and_type_only_imports(tmp_path: Path) -> None:
    files = {
        "__init__.py": "from ._high.mod import thing\n",
        "_low/__init__.py": '"""low"""\n',
        "_low/a.py": (
            "from typing import TYPE_CHECKING\n"
            "from . import b\n"
            "from .. import _high\n"
            "if TYPE_CHECKING:\n"
            "    from .._side.x import X\n"
            "def late() -> None:\n"
            "    import snowflake_server._high.mod\n"
        ),
        "_low/b.py": "from snowflake_server import Node\n",
        "_side/__init__.py": "",
        "_side/x.py": "from .._other import y\nfrom .._low.a import late\n",
        "_other.py": "",
        "_high/__init__.py": "",
        "_high/mod.py": "from .._low import a\nfrom ..__init__ import thing\n",
    }
    for name, text in files.items():
        (tmp_path / PACKAGE / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PACKAGE / name).write_text(text)
    order = layers("**Layers.** the order:\n\n`_low` < `_side`, `_other` <\n`_high` < `__init__`\n")
    assert order == [["_low"], ["_side", "_other"], ["_high"], ["__init__"]]
    assert violations(tmp_path, order) == [
        f"{PACKAGE}/_high/mod.py:2 imports {PACKAGE}.__init__: "
        "__init__ is a higher layer than _high",
        f"{PACKAGE}/_low/a.py:3 imports {PACKAGE}._high: _high is a higher layer than _low",
        f"{PACKAGE}/_low/a.py:5 imports {PACKAGE}._side.x: _side is a higher layer than _low",
        f"{PACKAGE}/_low/a.py:7 imports {PACKAGE}._high.mod: _high is a higher layer than _low",
        f"{PACKAGE}/_low/b.py:1 imports {PACKAGE}: __init__ is a higher layer than _low",
        f"{PACKAGE}/_side/x.py:1 imports {PACKAGE}._other: _side and _other are one layer: "
        "neither imports the other",
    ]


# The parts of cluster mode that ``membership`` composes (CONTRIBUTING.md, "Cluster mode"):
# none of them imports another, or the orchestrator.
CLUSTER_PARTS = ("gate", "lease", "layout_record")


def test_the_parts_of_cluster_mode_never_import_each_other() -> None:
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    modules = {module_name(path, ROOT) for path in files}
    parts = {f"{PACKAGE}._cluster.{name}" for name in (*CLUSTER_PARTS, "membership")}
    wrong = [
        f"{found.importer}:{found.line} imports {found.imported}"
        for name in CLUSTER_PARTS
        for found in imports_of(ROOT / PACKAGE / "_cluster" / f"{name}.py", ROOT, modules)
        if found.imported in parts
    ]
    assert wrong == [], "the gate, the lease and the layout record meet only in membership.py"
    composer = imports_of(ROOT / PACKAGE / "_cluster" / "membership.py", ROOT, modules)
    assert parts - {f"{PACKAGE}._cluster.membership"} <= {i.imported for i in composer}
