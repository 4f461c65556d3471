"""Checks what ``make dist`` built: exactly one sdist and one wheel of each of our two
distributions at the one VERSION, plus the server's platform wheel (its native core
compiled in), each wheel holding exactly the files of its package in the tree that git
tracks (no tests, no ``build/`` leftovers of deleted modules, no egg-info, no untracked
module, no C source; the platform wheel its extension too), its licence, and the server's
sdist holding VERSION (its setup.py reads it). Prints each archive's files; exits 1 naming
every stray or missing file.

Usage: python deploy/release/check_dist.py DIST [ROOT]   (ROOT: the tree, default this one)
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

DIST_INFO = {"METADATA", "WHEEL", "RECORD", "top_level.txt", "licenses/LICENSE"}
# (distribution, package directory in the tree, file suffixes of the package, extra
# dist-info files)
PROJECTS = {
    "snowflake_server": (
        Path("snowflake_server"),
        (".py", ".pyi", "py.typed"),
        {"entry_points.txt"},
    ),
    "snowflake_thrift_client": (
        Path("clients/python/snowflake_thrift_client"),
        (".py", "py.typed", "VERSION", ".thrift"),
        set(),
    ),
}
NATIVE = "snowflake_server/_native/_core"
"""The server's optional extension module, as a path inside a wheel (without its suffix)."""


def platform_tag() -> str:
    """The tag of a wheel with an extension built by this interpreter (cp311-cp311-linux_x86_64)."""
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"{python}-{python}-{platform}"


def untracked(root: Path, package: Path) -> set[Path]:
    """The files under ``package`` that git does not track (none outside a checkout): a
    module left in the tree by mistake must not count as one the wheel should ship."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "--others", "--exclude-standard", "-z",
             "--", str(package)],
            capture_output=True, check=True, timeout=60,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return set()
    return {root / name for name in listed.decode().split("\0") if name}


def package_files(root: Path, package: Path, suffixes: tuple[str, ...]) -> set[str]:
    """The files of ``package`` a wheel must ship, as paths inside the wheel (the IDL
    and VERSION are links in the tree: followed; files git does not track: left out)."""
    found = set()
    stray = untracked(root, package)
    for directory, subdirectories, files in os.walk(root / package, followlinks=True):
        subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
        for name in files:
            if name.endswith(suffixes) and Path(directory, name) not in stray:
                path = Path(directory, name).relative_to(root / package.parent)
                found.add(path.as_posix())
    return found


def wheel_problems(wheel: Path, root: Path, version: str) -> list[str]:
    """Each stray or missing file of ``wheel`` against the tree at ``root``."""
    distribution = wheel.name.split("-")[0]
    package, suffixes, extra_info = PROJECTS[distribution]
    info = f"{distribution}-{version}.dist-info"
    expected = package_files(root, package, suffixes) | {
        f"{info}/{name}" for name in DIST_INFO | extra_info
    }
    if not wheel.name.endswith("-py3-none-any.whl"):
        expected.add(NATIVE + sysconfig.get_config_var("EXT_SUFFIX"))
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    return [f"{wheel.name}: stray {name}" for name in sorted(shipped - expected)] + [
        f"{wheel.name}: missing {name}" for name in sorted(expected - shipped)
    ]


def sdist_problems(sdist: Path, version: str) -> list[str]:
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
    problems = [
        f"{sdist.name}: stray {name}"
        for name in sorted(names)
        if name.split("/")[1:2] in (["tests"], ["build"], ["dist"])
    ]
    needed = (
        f"{top}/VERSION"
        if top.startswith("snowflake_server-")
        else f"{top}/snowflake_thrift_client/VERSION"
    )
    if needed not in names:
        problems.append(f"{sdist.name}: missing {needed}")
    return problems


def check(dist: Path, root: Path) -> list[str]:
    """Every problem of the artifacts in ``dist``; [] when they are as intended."""
    version = (root / "VERSION").read_text(encoding="utf-8").strip()
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    expected_wheels = sorted(
        [f"{d}-{version}-py3-none-any.whl" for d in PROJECTS]
        + [f"snowflake_server-{version}-{platform_tag()}.whl"]
    )
    expected_sdists = [f"{d}-{version}.tar.gz" for d in sorted(PROJECTS)]
    problems = []
    if [w.name for w in wheels] != expected_wheels:
        problems.append(f"wheels {[w.name for w in wheels]}, expected {expected_wheels}")
    if [s.name for s in sdists] != expected_sdists:
        problems.append(f"sdists {[s.name for s in sdists]}, expected {expected_sdists}")
    for wheel in wheels:
        if wheel.name.split("-")[0] in PROJECTS:
            problems += wheel_problems(wheel, root, version)
    for sdist in sdists:
        problems += sdist_problems(sdist, version)
    return problems


def main(argv: list[str]) -> int:
    dist = Path(argv[1])
    root = Path(argv[2]) if len(argv) > 2 else Path(__file__).resolve().parents[2]
    for archive in sorted([*dist.glob("*.whl"), *dist.glob("*.tar.gz")]):
        print(f"{archive.name}  {archive.stat().st_size} bytes")
    problems = check(dist, root)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print("each wheel holds exactly its package's files; the sdists hold VERSION")
        print("the server's platform wheel holds its native core; the pure one does not")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
