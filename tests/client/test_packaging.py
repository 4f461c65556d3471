"""The client is a distribution of its own: its wheel ships the IDL, installs alone in a
fresh virtual environment (on the oldest Python it supports too) and calls a real server
from there; the server's wheel depends on it instead of shipping it. Installed from this
tree, the server takes the tree's client and never asks an index for our names (an
impostor served there stays out); an sdist, and the wheel built from it, name it."""

from __future__ import annotations

import base64
import email
import glob
import hashlib
import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import snowflake_thrift_client
from snowflake_thrift_client import decompose
from snowflake_thrift_client._idl import idl_text

import snowflake_server
from tests.client.helpers import counts
from tests.support.endpoints import free_port
from tests.support.inprocess import InProcessServer

ROOT = Path(__file__).parents[2]
VERSION = (ROOT / "VERSION").read_text().strip()
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
    requires = fields.get_all("Requires-Dist", [])
    # Built from a tree, it takes the client of that tree by its path, never by name
    # from an index (setup.py).
    client = (checkout / "clients" / "python").as_uri()
    assert [r for r in requires if requirement_name(r) in OUR_NAMES] == [
        f"snowflake-thrift-client @ {client}"
    ]
    with zipfile.ZipFile(server_wheel) as archive:
        names = archive.namelist()
    assert not [name for name in names if name.startswith("snowflake_thrift_client")]
    modules = {name for name in names if name.endswith(".py")}
    source = checkout / "snowflake_server"
    expected = {p.relative_to(checkout).as_posix() for p in source.rglob("*.py")}
    assert modules == expected, "every module of the source, and nothing else"


def setup_script() -> ModuleType:
    """The root ``setup.py`` as a module (its ``setup()`` call runs only as a script)."""
    spec = importlib.util.spec_from_file_location("snowflake_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_server_pins_the_client_of_its_own_version() -> None:
    """One version number: the server uses the client's private modules, so it accepts
    only the client released with it (in an sdist, by name: what an index would hold;
    from the tree, that tree's client), and reports the version they share."""
    setup = setup_script()
    assert setup.client_requirement(["setup.py", "sdist", "--formats", "gztar"]) == (
        f"snowflake-thrift-client=={VERSION}"
    )
    client = (ROOT / "clients" / "python").resolve().as_uri()
    for command in ("bdist_wheel", "editable_wheel", "dist_info", "egg_info"):
        assert setup.client_requirement(["setup.py", command]) == (
            f"snowflake-thrift-client @ {client}"
        )
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


# -- installed from the tree, with an index that has an impostor of our names ---------------

OUR_NAMES = ("snowflake-thrift-client", "snowflake-server")
PLANTED = "planted by the index"
# What pip's build isolation installs to build either project (both use setuptools).
BUILD_REQUIRES = ["setuptools>=77"]


def normalized(name: str) -> str:
    """A project name as an index compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def impostor_wheel(directory: Path) -> Path:
    """A ``snowflake-thrift-client`` of our version as a stranger could register it: the
    module it installs says so (``PLANTED``)."""
    package = "snowflake_thrift_client"
    dist_info = f"{package}-{VERSION}.dist-info"
    files = {
        f"{package}/__init__.py": f"PLANTED = {PLANTED!r}\n__version__ = {VERSION!r}\n",
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: snowflake-thrift-client\nVersion: {VERSION}\n"
        ),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: impostor\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [f"{name},{record_hash(data.encode())},{len(data)}" for name, data in files.items()]
    wheel = directory / f"{package}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist_info}/RECORD", "\n".join([*record, f"{dist_info}/RECORD,,"]))
    return wheel


@dataclass
class Index:
    """A simple repository (PEP 503) on 127.0.0.1, and every path pip asked it for."""

    url: str
    requested: list[str]

    def asked_for(self, name: str) -> list[str]:
        """The requests that named project ``name``: its page or one of its files."""
        wanted = normalized(name)
        return [path for path in self.requested if wanted in normalized(path)]


def html(body: str) -> str:
    return f"<!DOCTYPE html><html><body>{body}</body></html>"


def write_index(root: Path, wheels: list[Path]) -> None:
    """``root/simple/<project>/`` pages linking to ``root/files/<wheel>``."""
    files = root / "files"
    files.mkdir(parents=True)
    projects: dict[str, list[str]] = {}
    for wheel in wheels:
        shutil.copy2(wheel, files / wheel.name)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        link = f'<a href="../../files/{wheel.name}#sha256={digest}">{wheel.name}</a><br>'
        projects.setdefault(normalized(wheel.name.split("-")[0]), []).append(link)
    for project, links in projects.items():
        page = root / "simple" / project / "index.html"
        page.parent.mkdir(parents=True)
        page.write_text(html("".join(links)))
    listing = "".join(f'<a href="{p}/">{p}</a><br>' for p in sorted(projects))
    (root / "simple" / "index.html").write_text(html(listing))


@pytest.fixture(scope="module")
def wheelhouse(server_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels of the third-party distributions both projects need to build and run, as
    this machine's pip configuration finds them (PyPI, or a mirror): never ours."""
    requires = [
        r for r in metadata(server_wheel).get_all("Requires-Dist", []) if "extra ==" not in r
    ]
    third_party = [r for r in requires if requirement_name(r) not in OUR_NAMES]
    assert third_party and len(third_party) == len(requires) - 1
    out = tmp_path_factory.mktemp("wheelhouse")
    run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
         "--only-binary=:all:", "-d", str(out), *third_party, *BUILD_REQUIRES],
        cwd=out, timeout_s=INSTALL_TIMEOUT_S,
    )  # fmt: skip
    assert not [w for w in out.iterdir() if normalized(w.name.split("-")[0]) in OUR_NAMES]
    return out


@pytest.fixture
def index(wheelhouse: Path, tmp_path: Path) -> Iterator[Index]:
    """The third-party wheels and the impostor, served on 127.0.0.1 for one test."""
    root = tmp_path / "index"
    write_index(root, [*wheelhouse.glob("*.whl"), impostor_wheel(tmp_path)])
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self) -> None:
            requested.append(self.path)  # list.append is atomic: one thread per request
            super().do_GET()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # pip's requests are kept in ``requested``; stderr stays quiet

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as httpd:
        serving = threading.Thread(target=httpd.serve_forever, name="index", daemon=True)
        serving.start()
        try:
            yield Index(f"http://127.0.0.1:{httpd.server_address[1]}/simple/", requested)
        finally:
            httpd.shutdown()
            serving.join(timeout=RUN_TIMEOUT_S)


WHAT_WAS_INSTALLED = """
import json
from importlib.metadata import distribution
import snowflake_server, snowflake_thrift_client
client = distribution("snowflake-thrift-client")
print(json.dumps({
    "planted": getattr(snowflake_thrift_client, "PLANTED", None),
    "client_file": snowflake_thrift_client.__file__,
    "client_from": json.loads(client.read_text("direct_url.json") or "null"),
    "server_version": snowflake_server.__version__,
}))
"""


@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT_S + INSTALL_TIMEOUT_S * 2 + RUN_TIMEOUT_S * 2)
@pytest.mark.parametrize(
    "install",
    [
        pytest.param(["."], id="bare"),
        pytest.param(["-e", "."], id="editable"),
        pytest.param(["./clients/python", "."], id="both-paths"),
    ],
)
def test_installed_from_the_tree_no_index_is_asked_for_our_names(
    install: list[str], checkout: Path, index: Index, tmp_path: Path
) -> None:
    """A bare ``pip install .`` in a fresh venv whose only index serves an impostor
    ``snowflake-thrift-client`` of our version takes the client from the tree: pip never
    asks the index for either of our names (dependency confusion)."""
    tree = tmp_path / "tree"  # pip builds in place: a copy of the checkout of its own
    shutil.copytree(checkout, tree, symlinks=True)
    venv = tmp_path / "venv"
    run([sys.executable, "-I", "-m", "venv", str(venv)], tmp_path, RUN_TIMEOUT_S * 2)
    python = str(venv / "bin" / "python")
    # Nothing of this machine's pip configuration (its indexes, find-links, constraints):
    # the index below is the only place pip may look.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PYTHONNOUSERSITE": "1"}
    done = subprocess.run(
        [python, "-I", "-m", "pip", "install", "--disable-pip-version-check", "--no-cache-dir",
         "--index-url", index.url, *install],
        cwd=tree, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S * 2,
    )  # fmt: skip
    assert done.returncode == 0, f"pip exited with {done.returncode}:\n{done.stderr}"

    assert index.asked_for("thriftpy2"), "the index served the third-party dependencies"
    for name in OUR_NAMES:
        assert index.asked_for(name) == [], f"pip asked the index for {name}:\n{done.stdout}"
    installed = json.loads(run([python, "-I", "-c", WHAT_WAS_INSTALLED], tmp_path, RUN_TIMEOUT_S))
    assert installed["planted"] is None, "the impostor's module was installed"
    assert installed["client_from"]["url"] == (tree / "clients" / "python").as_uri()
    assert Path(installed["client_file"]).is_relative_to(venv), "built from the tree, installed"
    assert installed["server_version"] == VERSION


@pytest.mark.slow
def test_an_sdist_and_its_wheel_name_the_client_as_an_index_would_hold_it(
    checkout: Path, tmp_path: Path
) -> None:
    """What a release publishes (``python -m build``: the sdist, then the wheel built
    from it) requires the client by name and version: an index refuses a path."""
    tree = tmp_path / "tree"
    shutil.copytree(checkout, tree, symlinks=True)
    out = tmp_path / "sdist"
    out.mkdir()
    build_sdist = f"import setuptools.build_meta as b; print(b.build_sdist({str(out)!r}))"
    name = run([sys.executable, "-c", build_sdist], tree, BUILD_TIMEOUT_S).strip().splitlines()[-1]
    sdist = out / name
    with tarfile.open(sdist) as archive:
        member = archive.extractfile(f"snowflake_server-{VERSION}/PKG-INFO")
        assert member is not None
        pkg_info = email.message_from_bytes(member.read())
    wheel = build_wheel(sdist, tmp_path)
    for fields in (pkg_info, metadata(wheel)):
        requires = fields.get_all("Requires-Dist", [])
        assert [r for r in requires if requirement_name(r) in OUR_NAMES] == [
            f"snowflake-thrift-client=={VERSION}"
        ]
        assert not [r for r in requires if "@" in r], "no direct reference"
