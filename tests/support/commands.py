"""Outside tools the client tests call (node, npm, go, thrift): found on PATH or a
failure that names the Debian package `make test` installs, and run to completion."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

__all__ = ["run", "tool"]


def tool(name: str, package: str) -> str:
    """The path of ``name``; ``AssertionError`` naming Debian ``package`` if missing."""
    path = shutil.which(name)
    assert path, f"`{name}` is missing: `make test` installs it (Debian package {package})"
    return path


def run(
    command: list[str], cwd: Path, env: dict[str, str] | None = None, *, stderr: bool = False
) -> str:
    """``command``'s output (with its stderr after it if ``stderr``); ``AssertionError``
    with both if it exits non-zero or runs past 300 s."""
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (
        f"{command} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
    )
    return done.stdout + done.stderr if stderr else done.stdout
