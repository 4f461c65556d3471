"""The client is a distribution of its own: its wheel ships the IDL, installs alone in a
fresh virtual environment (on the oldest Python it supports too) and calls a real server
from there; the server's wheel depends on it instead of shipping it."""

from __future__ import annotations

import email
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from email.message import Message
from pathlib import Path

import pytest
import snowflake_thrift_client
from snowflake_thrift_client import decompose
from snowflake_thrift_client._idl import idl_text

import snowflake_server
from tests.client.helpers import counts
from tests.support.endpoints import free_port
from tests.support.inprocess import InProcessServer

ROOT = Path(__file__).parents[2]
VERSION = (ROOT / "clients/python/snowflake_thrift_client/VERSION").read_text().strip()
BUILD_TIMEOUT_S = 180
INSTALL_TIMEOUT_S = 300  # pip may download thriftpy2 from PyPI
RUN_TIMEOUT_S = 60

# Whichever test comes first builds the wheels it needs (module fixtures) in its own time.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S * 2 + INSTALL_TIMEOUT_S + RUN_TIMEOUT_S * 6)


def run(command: list[str], cwd: Path, timeout_s: float) -> str:
    """Run ``command`` to completion (bounded); its stdout. Fails the test, with the
    output, if it exits with an error."""
    # A PYTHONPATH, user site-packages or the repository as working directory would
    # let the fresh environment import what it must not have.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"{command} exited with {done.returncode}:\n{done.stderr}"
    return done.stdout


# -- the wheels -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the two projects are built from, as a fresh checkout has it: setuptools puts
    whatever an earlier build left in ``build/lib`` into the wheel, deleted modules too."""
    repo = tmp_path_factory.mktemp("checkout")
    for path in ROOT.iterdir():
        if path.is_file() and not path.name.startswith("."):
            shutil.copy2(path, repo / path.name)  # pyproject.toml, README.md...
    ignore = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".*")
    for part in ("idl", "snowflake_server", "clients/python"):
        shutil.copytree(ROOT / part, repo / part, symlinks=True, ignore=ignore)
    return repo


def build_wheel(project: Path, out: Path) -> Path:
    run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
         "--no-deps", "--no-build-isolation", "-w", str(out), str(project)],
        cwd=out, timeout_s=BUILD_TIMEOUT_S,
    )  # fmt: skip
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def client_wheel(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(checkout / "clients" / "python", tmp_path_factory.mktemp("client-wheel"))


@pytest.fixture(scope="module")
def server_wheel(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(checkout, tmp_path_factory.mktemp("server-wheel"))


def metadata(wheel: Path) -> Message:
    """The wheel's METADATA: fields as headers, the long description as the body."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_string(archive.read(name).decode())


def requirement_name(value: str) -> str:
    """The project a ``Requires-Dist`` names, normalized as PyPI compares names."""
    found = re.match(r"[A-Za-z0-9._-]+", value)
    assert found, value
    return re.sub(r"[-_.]+", "-", found[0]).lower()


def test_the_wheel_ships_the_idl(client_wheel: Path) -> None:
    with zipfile.ZipFile(client_wheel) as archive:
        shipped = archive.read("snowflake_thrift_client/idl/snowflake.thrift").decode()
        names = archive.namelist()
    assert shipped == idl_text()
    assert {"snowflake_thrift_client/py.typed", "snowflake_thrift_client/VERSION"} <= set(names)


def test_the_client_wheel_needs_only_thriftpy2(client_wheel: Path) -> None:
    fields = metadata(client_wheel)
    assert (fields["Name"], fields["Version"]) == ("snowflake-thrift-client", VERSION)
    assert fields["Requires-Python"] == ">=3.9"
    requires = fields.get_all("Requires-Dist", [])
    always = [requirement_name(r) for r in requires if "extra ==" not in r]
    assert always == ["thriftpy2"]
    optional = {
        requirement_name(r): r.split("extra ==")[1].strip() for r in requires if "extra ==" in r
    }
    assert optional == {"kazoo": '"zookeeper"'}
    readme = (ROOT / "clients" / "python" / "README.md").read_text(encoding="utf-8")
    assert fields["Description-Content-Type"] == "text/markdown"
    assert str(fields.get_payload()).strip() == readme.strip(), "the README, shown on PyPI"
    with zipfile.ZipFile(client_wheel) as archive:
        packages = {name.split("/")[0] for name in archive.namelist()}
    assert packages == {"snowflake_thrift_client", f"snowflake_thrift_client-{VERSION}.dist-info"}


@pytest.mark.slow
def test_the_server_wheel_depends_on_the_client_instead_of_shipping_it(
    checkout: Path, server_wheel: Path
) -> None:
    fields = metadata(server_wheel)
    assert (fields["Name"], fields["Version"]) == ("snowflake-server", VERSION)
    requires = [requirement_name(r) for r in fields.get_all("Requires-Dist", [])]
    assert "snowflake-thrift-client" in requires
    with zipfile.ZipFile(server_wheel) as archive:
        names = archive.namelist()
    assert not [name for name in names if name.startswith("snowflake_thrift_client")]
    modules = {name for name in names if name.endswith(".py")}
    source = checkout / "snowflake_server"
    expected = {p.relative_to(checkout).as_posix() for p in source.rglob("*.py")}
    assert modules == expected, "every module of the source, and nothing else"


def test_the_server_pins_the_client_of_its_own_version() -> None:
    """One version number: the server uses the client's private modules, so it accepts
    only the client released with it, and reports the version they share."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(rf'"snowflake-thrift-client=={re.escape(VERSION)}"', pyproject)
    assert snowflake_server.__version__ == snowflake_thrift_client.__version__ == VERSION


# -- installed alone ------------------------------------------------------------------------


def oldest_supported_python() -> str | None:
    """A Python 3.9 that runs: ``python3.9`` on PATH, else one pyenv installed (pyenv's
    shim on PATH runs only where that version is selected)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [
        shutil.which("python3.9"),
        *sorted(glob.glob(f"{pyenv}/versions/3.9*/bin/python3.9")),
    ]
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            found = subprocess.run(
                [candidate, "-I", "-c", "import sys; assert sys.version_info[:2] == (3, 9)"],
                capture_output=True, timeout=RUN_TIMEOUT_S,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        if found.returncode == 0:
            return candidate
    return None


CHECK_IMPORTS = """
import importlib, json
found = {}
for name in ("kazoo", "prometheus_client", "snowflake_server", "snowflake_thrift_client"):
    try:
        importlib.import_module(name)
        found[name] = True
    except ImportError:
        found[name] = False
print(json.dumps(found))
"""

CALL_THE_SERVER = """
import json, sys
import snowflake_thrift_client
from snowflake_thrift_client import (
    ConfigurationError, InvalidUserAgentError, SnowflakeClient, SnowflakePool,
    ZooKeeperDiscovery, __version__, client_context, decompose, parse_server,
)

port, dead_port = int(sys.argv[1]), int(sys.argv[2])
with SnowflakePool(("127.0.0.1", port), agent="packaging", timeout=10) as pool:
    one = pool.next_id()
    batch = pool.next_ids(3)

# The rest of the client's code, run on this Python too: failover, prefetch, declared
# errors, the layout call, TLS contexts, addresses, the optional dependency's absence.
servers = [("127.0.0.1", dead_port), "127.0.0.1:%d" % port]
with SnowflakePool(servers, agent="more", timeout=10, prefetch=2, prefetch_max_age=60) as pool:
    more = [pool.next_id() for _ in range(3)]
with SnowflakeClient("127.0.0.1", port, agent="more", timeout=10) as client:
    layout, datacenter_id, worker_id = client.layout()
    try:
        client.next_id("1bad")
        refused = "no error"
    except InvalidUserAgentError as e:
        refused = type(e).__name__
client_context()
try:
    ZooKeeperDiscovery("127.0.0.1:1")
    without_kazoo = "no error"
except ConfigurationError as e:
    without_kazoo = str(e)
print(json.dumps({
    "python": list(sys.version_info[:2]),
    "file": snowflake_thrift_client.__file__,
    "version": __version__,
    "ids": [one] + batch,
    "json": decompose(one).to_json(),
    "more": more,
    "by_layout": layout.decompose(more[0]).worker_id == decompose(more[0]).worker_id,
    "server": [datacenter_id, worker_id],
    "refused": refused,
    "ipv6": list(parse_server("[::1]:7610")),
    "without_kazoo": without_kazoo,
}))
"""


@pytest.fixture(params=["running", "3.9"])
def interpreter(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "running":
        yield sys.executable
        return
    found = oldest_supported_python()
    if found is None:
        pytest.skip("no python3.9 on PATH (nor installed by pyenv): the oldest supported Python")
    yield found


@pytest.mark.slow
def test_the_client_wheel_installs_alone_and_calls_a_real_server(
    interpreter: str, client_wheel: Path, server: InProcessServer, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    run([interpreter, "-I", "-m", "venv", str(venv)], cwd=tmp_path, timeout_s=RUN_TIMEOUT_S * 2)
    python = str(venv / "bin" / "python")
    pip = [python, "-I", "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "install", "-q", str(client_wheel)], tmp_path, INSTALL_TIMEOUT_S)

    found = json.loads(run([python, "-I", "-c", CHECK_IMPORTS], tmp_path, RUN_TIMEOUT_S))
    assert found == {
        "kazoo": False,  # only with the zookeeper extra
        "prometheus_client": False,  # the server's
        "snowflake_server": False,
        "snowflake_thrift_client": True,
    }

    script = [python, "-I", "-c", CALL_THE_SERVER, str(server.port), str(free_port())]
    called = json.loads(run(script, tmp_path, RUN_TIMEOUT_S))
    if interpreter != sys.executable:
        assert called["python"] == [3, 9]
    assert Path(called["file"]).is_relative_to(venv), "the installed wheel, not the source"
    assert called["version"] == VERSION == snowflake_thrift_client.__version__
    ids = called["ids"]
    assert ids == sorted(set(ids)) and len(ids) == 4
    assert {decompose(i).worker_id for i in ids} == {0}
    assert called["json"] == decompose(ids[0]).to_json()
    assert counts(server)['snowflake_ids_by_agent_total{agent="packaging"}'] == 4
    more = called["more"]
    assert more == sorted(set(more)) and more[0] > ids[-1], "past the dead server"
    assert counts(server)['snowflake_ids_by_agent_total{agent="more"}'] == 4, "2 batches of 2"
    assert called["by_layout"] and called["server"] == [0, 0]
    assert called["refused"] == "InvalidUserAgentError" and called["ipv6"] == ["::1", 7610]
    assert "pip install 'snowflake-thrift-client[zookeeper]'" in called["without_kazoo"]


def test_the_public_surface_is_importable() -> None:
    for package in (snowflake_thrift_client, snowflake_server):
        missing = [name for name in package.__all__ if not hasattr(package, name)]
        assert missing == [], package
        for name in package.__all__:
            if name.endswith("Error"):
                assert issubclass(getattr(package, name), snowflake_thrift_client.SnowflakeError)
