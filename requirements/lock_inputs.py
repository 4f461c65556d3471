"""Writes the lock files' inputs (``runtime.in``, ``dev.in``, ``build.in``) from the ranges
the projects declare, so that a range is written in one place only; ``--check`` fails,
naming the file, where a written input differs from what the ranges make (``make lock``
rewrites them).

runtime.in: the server's third-party requirements (setup.py THIRD_PARTY), the client's
(clients/python/pyproject.toml, with its ``zookeeper`` extra, which the server needs) and
the build requirement both projects share, so that ours install from hashed files with
``--no-build-isolation``. dev.in: the same, constrained to the runtime lock's pins (a
``make test`` after a ``make run`` only adds packages), the server's ``test`` extra and the
tools of the make targets (tools.in). build.in: the build requirement alone, at the
runtime lock's pin, installed first: pure-sasl is published as an sdist only, and pip
would otherwise build it in an isolated environment filled from PyPI without hashes (or,
pip < 23.1, with the setuptools of the venv). Our own two distributions are never in a lock: pip
cannot hash a local tree, and they are installed after it, with ``--no-deps``.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HEADER = "# Written by `make lock` (requirements/lock_inputs.py) from {sources}: do not edit.\n"


def server_third_party() -> list[str]:
    """setup.py's THIRD_PARTY, read by importing setup.py (its guard keeps setup() off)."""
    spec = importlib.util.spec_from_file_location("_snowflake_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.THIRD_PARTY)


def project(path: Path) -> dict[str, object]:
    with path.open("rb") as file:
        return tomllib.load(file)


def inputs() -> dict[str, str]:
    """Each input file's name and the text the declared ranges make of it."""
    server = project(ROOT / "pyproject.toml")
    client = project(ROOT / "clients" / "python" / "pyproject.toml")
    client_project = client["project"]
    server_project = server["project"]
    assert isinstance(client_project, dict) and isinstance(server_project, dict)
    build = sorted(
        {*server["build-system"]["requires"], *client["build-system"]["requires"]}  # type: ignore[index]
    )
    runtime = [
        HEADER.format(sources="setup.py, clients/python/pyproject.toml, [build-system]"),
        "# the server (setup.py THIRD_PARTY)\n",
        *(f"{line}\n" for line in server_third_party()),
        "# the client (clients/python/pyproject.toml), with its zookeeper extra\n",
        *(f"{line}\n" for line in client_project["dependencies"]),
        *(f"{line}\n" for line in client_project["optional-dependencies"]["zookeeper"]),
        "# building ours: [build-system] requires of both projects\n",
        *(f"{line}\n" for line in build),
    ]
    dev = [
        HEADER.format(sources="pyproject.toml's test extra and tools.in"),
        "-c runtime.txt\n",
        "-r runtime.in\n",
        "# the server's test extra (pyproject.toml)\n",
        *(f"{line}\n" for line in server_project["optional-dependencies"]["test"]),
        "-r tools.in\n",
    ]
    tools = [
        HEADER.format(sources="[build-system]"),
        "-c runtime.txt\n",
        *(f"{line}\n" for line in build),
    ]
    return {"runtime.in": "".join(runtime), "dev.in": "".join(dev), "build.in": "".join(tools)}


def main(argv: list[str]) -> int:
    check = argv[1:] == ["--check"]
    stale = []
    for name, text in inputs().items():
        path = HERE / name
        if check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print(f"requirements/{', '.join(stale)} differ from the declared ranges: run make lock",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
