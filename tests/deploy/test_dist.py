"""The lock files against the ranges the projects declare, and ``make dist``: its
artifacts pass twine and the wheel-contents check, and install into a fresh venv with
no index (only the built files and the wheelhouse of locked wheels), where the
installed server answers get_id and reports the one VERSION. (tests/client/
test_packaging.py checks the wheels' metadata and installs from the tree.)"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement

from tests.client.test_packaging import INSTALL_TIMEOUT_S, RUN_TIMEOUT_S, VERSION, run
from tests.support.processes import parse_metrics, start_server

ROOT = Path(__file__).parents[2]
REQUIREMENTS = ROOT / "requirements"
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^\s;]+)(?:\s*;[^\\]*)?\s*\\$", re.MULTILINE)
DIST_TIMEOUT_S = 300


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins(lock: Path) -> dict[str, str]:
    """Each distribution the lock pins (normalized name) and its version."""
    text = lock.read_text(encoding="utf-8")
    return {re.sub(r"[-_.]+", "-", m[1]).lower(): m[2] for m in PIN.finditer(text)}


def requirements(path: Path) -> list[Requirement]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Requirement(line) for line in lines if line and not line.startswith(("#", "-"))]


# -- the lock files ---------------------------------------------------------------------------


def test_the_lock_inputs_are_the_declared_ranges() -> None:
    assert load(REQUIREMENTS / "lock_inputs.py").main(["lock_inputs.py", "--check"]) == 0


def test_a_range_changed_without_make_lock_is_caught(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    for name in ("setup.py", "pyproject.toml", "clients/python/pyproject.toml", "requirements"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, tree / name)
    setup = tree / "setup.py"
    setup.write_text(setup.read_text().replace('"pyyaml>=6,<7"', '"pyyaml>=6.1,<7"'))
    checked = subprocess.run(
        [sys.executable, str(tree / "requirements" / "lock_inputs.py"), "--check"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert checked.returncode == 1
    assert "requirements/runtime.in differ from the declared ranges" in checked.stderr


@pytest.mark.parametrize("lock", ["runtime", "dev"])
def test_each_lock_meets_its_inputs_with_hashes(lock: str) -> None:
    pinned = pins(REQUIREMENTS / f"{lock}.txt")
    inputs = requirements(REQUIREMENTS / "runtime.in")
    if lock == "dev":
        inputs += requirements(REQUIREMENTS / "dev.in") + requirements(REQUIREMENTS / "tools.in")
    unmet = [
        str(r) for r in inputs
        if not r.specifier.contains(pinned.get(re.sub(r"[-_.]+", "-", r.name).lower(), "0"))
    ]  # fmt: skip
    assert unmet == [], f"requirements/{lock}.txt does not meet these: run make lock"
    text = (REQUIREMENTS / f"{lock}.txt").read_text(encoding="utf-8")
    # Each pin is a block: the requirement line, then its hashes (a pin without is refused
    # by --require-hashes only when pip reaches it).
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    unhashed = [b.split()[0] for b in blocks if "==" in b.split()[0] and "--hash=sha256:" not in b]
    assert unhashed == [] and len(pinned) == sum("==" in b.split()[0] for b in blocks)
    assert not ({"snowflake-server", "snowflake-thrift-client"} & pinned.keys()), "never ours"


def test_make_test_after_make_run_only_adds() -> None:
    runtime, dev = pins(REQUIREMENTS / "runtime.txt"), pins(REQUIREMENTS / "dev.txt")
    assert {name: dev.get(name) for name in runtime} == runtime


# -- make dist ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make dist`` into a temp dir, with the running venv (``-o``: never reinstalled)."""
    out = tmp_path_factory.mktemp("dist")
    venv = Path(sys.prefix)
    done = subprocess.run(
        ["make", "--no-print-directory", "dist", f"VENV={venv}", f"DIST={out}",
         "-o", f"{venv}/.installed"],
        cwd=ROOT, capture_output=True, text=True, timeout=DIST_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, f"make dist failed:\n{done.stdout}\n{done.stderr}"
    assert "PASSED" in done.stdout and "each wheel holds exactly" in done.stdout
    return out


@pytest.mark.slow
@pytest.mark.timeout(DIST_TIMEOUT_S + INSTALL_TIMEOUT_S + RUN_TIMEOUT_S * 3)
def test_the_artifacts_install_with_no_index_and_serve(dist: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-I", "-m", "venv", str(venv)], tmp_path, RUN_TIMEOUT_S * 2)
    python = str(venv / "bin" / "python")
    run(
        [python, "-I", "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-cache-dir", "--no-index", "--find-links", str(dist),
         "--find-links", str(dist / "wheelhouse"), "snowflake-server", "snowflake-thrift-client"],
        tmp_path, INSTALL_TIMEOUT_S,
    )  # fmt: skip
    where = run(
        [python, "-I", "-c", "import snowflake_server as s, snowflake_thrift_client as c; "
         "print(s.__file__); print(c.__version__)"],
        tmp_path, RUN_TIMEOUT_S,
    ).split()  # fmt: skip
    assert Path(where[0]).is_relative_to(venv) and where[1] == VERSION
    # The venv's python, isolated (-I: not this checkout's package from the working dir).
    wrapper = ("sh", "-c", f'shift; exec {python} -I "$@"', "sh")
    server = start_server(wrapper=wrapper, timeout_s=RUN_TIMEOUT_S)
    try:
        ids = [server.raw_client().get_id("dist-test") for _ in range(3)]
        assert ids == sorted(set(ids))
        build = parse_metrics(server.metrics())
        (info,) = [k for k in build if k.startswith("snowflake_build_info")]
        assert f'version="{VERSION}"' in info
    finally:
        server.close_clients()
        server.stop()


@pytest.mark.slow
def test_a_stray_file_in_a_wheel_fails_the_check(dist: Path, tmp_path: Path) -> None:
    check = load(ROOT / "deploy" / "release" / "check_dist.py")
    assert check.check(dist, ROOT) == []
    copy = tmp_path / "dist"
    shutil.copytree(dist, copy, ignore=shutil.ignore_patterns("wheelhouse"))
    wheel = copy / f"snowflake_server-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "a") as archive:
        archive.writestr("tests/test_leftover.py", "")
        archive.writestr("snowflake_server/_removed_module.py", "")
    assert check.check(copy, ROOT) == [
        f"{wheel.name}: stray snowflake_server/_removed_module.py",
        f"{wheel.name}: stray tests/test_leftover.py",
    ]
