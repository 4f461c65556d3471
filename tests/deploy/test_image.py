"""The container image of deploy/docker/Dockerfile, built and run on this machine.

No container runtime can start a container here, so the test does what one would:
debootstrap makes a Debian base (cached in ``.tools/``; its packages and their versions
must be the recorded ones of ``image_base_packages.txt``), podman builds the image on it by
the base's digest, as the Dockerfile names debian:bookworm-slim (chroot isolation, its
storage in the test's temporary folder), and the server runs from the image's root file
system under chroot, as the image's user, with the image's environment, in mount and PID
namespaces of its own: PID 1 as in a container, the root read only and the state directory
a separate mount, as Kubernetes runs it (readOnlyRootFilesystem and a persistent volume).
A second build without podman's cache must install the same files.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import pytest
from snowflake_thrift_client import SnowflakeClient

from snowflake_server import ServerSettings
from snowflake_server._app.ready import ReadyLine, parse_ready_line
from snowflake_server._config.options import OPTIONS
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

pytestmark = [
    pytest.mark.slow,
    # debootstrap (cold) and the build's apt-get and pip take minutes; the first test pays.
    pytest.mark.timeout(900),
]

REPO = Path(__file__).resolve().parents[2]
# The packages (name=version) of the debootstrapped base this test was last run on.
# snapshot.debian.org is out of this machine's reach, so the base cannot be debootstrapped
# from a fixed point in Debian's history: instead a base that differs from the record (a
# Debian point release or security update since) fails the test, and is recorded again
# (after a look at what changed) with SNOWFLAKE_RECORD_IMAGE_BASE=1.
BASE_PACKAGES = Path(__file__).with_name("image_base_packages.txt")
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
IGNOREFILE = REPO / "deploy" / "docker" / "Dockerfile.dockerignore"
SUITE = "bookworm"
BASE_CACHE = REPO / ".tools" / "debootstrap"
MIRROR = "http://deb.debian.org/debian"
# What the official debian:bookworm images list: without the security suite the image
# would get the point release's Python and OpenSSL.
DEBIAN_SOURCES = f"""\
Types: deb
URIs: {MIRROR}
Suites: {SUITE} {SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: {SUITE}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# The blob-info cache podman keeps for root whatever --root says; removed if the test made it.
PODMAN_SYSTEM_CACHE = Path("/var/lib/containers")
BASE_REF = f"localhost/snowflake-test-base:{SUITE}"
IMAGE_REF = "localhost/snowflake-server:test"
AGAIN_REF = "localhost/snowflake-server:again"
# Where the Dockerfile's build stage writes the SBOM (CycloneDX) of the image's venv.
SBOM = "opt/snowflake/sbom.cdx.json"
SITE_PACKAGES = "opt/snowflake/lib/python3.11/site-packages"
RUNTIME_LOCK = REPO / "requirements" / "runtime.txt"
# The project's home, until pyproject's [project.urls] names it (then that is the truth).
PROJECT_HOME = "https://github.com/snowflake-id/snowflake"
# The image's own layer: Python, the venv and the user on top of the base. A compiler or
# pip's caches left behind would be tens of MB more.
MAX_ADDED_MB = 120


def _run(command: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None,
         log: Path | None = None) -> str:  # fmt: skip
    """Run ``command``; its stdout, or ``AssertionError`` with its output's end."""
    if log is None:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
        output, stdout = done.stderr, done.stdout
    else:
        with log.open("w") as sink:
            done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout_s, env=env, check=False)  # fmt: skip
        output = stdout = log.read_text()
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(command[:6])} ... exited {done.returncode}:\n{output[-4000:]}"
        )
    return stdout


def _base_tarball() -> Path:
    """A Debian ``SUITE`` minbase root file system as a tar, made once and kept in
    ``.tools/`` (git-ignored): debootstrap takes about half a minute and the network."""
    arch = _run(["dpkg", "--print-architecture"], timeout_s=10).strip()
    tarball = BASE_CACHE / f"{SUITE}-minbase-{arch}.tar"
    if tarball.exists():
        return tarball
    BASE_CACHE.mkdir(parents=True, exist_ok=True)
    # On the cache's file system, so that the finished tar is renamed into place: a
    # run killed half-way leaves no tarball that looks complete.
    with tempfile.TemporaryDirectory(dir=BASE_CACHE, prefix="making-") as work:
        rootfs = Path(work) / "rootfs"
        # In a mount namespace of its own: the /proc and /sys debootstrap mounts in the
        # tree go with it, even if it is killed half-way.
        _run(["unshare", "--mount", "--", "debootstrap", "--variant=minbase", f"--arch={arch}",
              SUITE, str(rootfs), MIRROR],
             timeout_s=600, log=Path(work) / "debootstrap.log")  # fmt: skip
        (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
        (rootfs / "etc/apt/sources.list.d/debian.sources").write_text(DEBIAN_SOURCES)
        # As a slim image: no package lists or downloaded packages, and no device nodes
        # (a container runtime makes /dev).
        partial = Path(work) / "base.tar"
        _run(["tar", "-C", str(rootfs), "--numeric-owner", "--exclude=./dev/*",
              "--exclude=./var/cache/apt/archives/*.deb", "--exclude=./var/cache/apt/*.bin",
              "--exclude=./var/lib/apt/lists/*", "-cf", str(partial), "."],
             timeout_s=300)  # fmt: skip
        partial.replace(tarball)
    return tarball


def _base_packages(tarball: Path) -> list[str]:
    """The installed packages of a base tarball, ``name=version`` sorted, from dpkg's
    status file."""
    status = _run(["tar", "-xOf", str(tarball), "./var/lib/dpkg/status"], timeout_s=60)
    packages = []
    for stanza in status.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", stanza, re.MULTILINE))
        if fields.get("Status", "").endswith(" installed"):
            packages.append(f"{fields['Package']}={fields['Version']}")
    return sorted(packages)


def _check_base(tarball: Path) -> None:
    """The base is the recorded one (see BASE_PACKAGES), or the test stops here."""
    packages = _base_packages(tarball)
    if os.environ.get("SNOWFLAKE_RECORD_IMAGE_BASE") == "1":
        BASE_PACKAGES.write_text("".join(f"{line}\n" for line in packages))
    recorded = BASE_PACKAGES.read_text().split()
    gone, new = sorted(set(recorded) - set(packages)), sorted(set(packages) - set(recorded))
    assert not gone and not new, (
        f"the base {tarball} is not the recorded one ({BASE_PACKAGES.name}):\n"
        f"recorded, not in the base: {gone}\nin the base, not recorded: {new}\n"
        "Debian has moved on: check the changes, then record the new base with "
        "SNOWFLAKE_RECORD_IMAGE_BASE=1 (or remove the tarball to debootstrap again)."
    )


class Podman:
    """podman with every bit of its state under ``home``: storage (vfs: plain
    directories, no mounts), libpod's and the build's temporary files; its run-time
    state in ``run`` (podman refuses a path longer than 50 characters there)."""

    def __init__(self, home: Path, run: Path) -> None:
        self.home = home
        (home / "tmp").mkdir(parents=True)
        self.env = {**os.environ, "TMPDIR": str(home / "tmp")}
        self.command = [
            "podman", "--root", str(home / "storage"), "--runroot", str(run),
            "--tmpdir", str(home / "libpod"), "--storage-driver", "vfs",
            # No systemd here, and nothing of the host's journal or cgroups to touch.
            "--cgroup-manager", "cgroupfs", "--events-backend", "file",
        ]  # fmt: skip

    def __call__(self, *args: str, timeout_s: float = 120, log: Path | None = None) -> str:
        return _run([*self.command, *args], timeout_s=timeout_s, env=self.env, log=log)


@dataclass(frozen=True)
class Image:
    """The built image: its ``podman image inspect``, its root file system (a directory
    of podman's vfs storage: read it, never write it), and its size beyond the base."""

    inspect: dict[str, Any]
    root: Path
    added_bytes: int

    @property
    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = self.inspect["Config"]
        return config

    @property
    def env(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.config["Env"])

    @property
    def user(self) -> tuple[int, int]:
        uid, _, gid = self.config["User"].partition(":")
        return int(uid), int(gid)

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.config.get("Labels") or {}
        return labels


def _git(*args: str) -> str:
    return _run(["git", "-C", str(REPO), *args], timeout_s=30).strip()


@functools.cache
def _build_args() -> dict[str, str]:
    """What the release workflow passes: the VERSION file, the commit and its time (read
    once: every build and check of the run agrees, even if a commit lands meanwhile)."""
    return {
        "VERSION": (REPO / "VERSION").read_text().strip(),
        "REVISION": _git("rev-parse", "HEAD"),
        "CREATED": _git("log", "-1", "--format=%cI"),
        "SOURCE_DATE_EPOCH": _git("log", "-1", "--format=%ct"),
    }


@dataclass
class Builder:
    """podman, with the base loaded and known by its digest, building the image from
    the working tree as the release workflow does."""

    podman: Podman
    base_ref: str  # BASE_REF@sha256:...

    def build(self, tag: str, log_name: str) -> Image:
        build = ["build", "--isolation=chroot", "--format=docker", "--pull=never",
                 # One layer per stage: each commit copies the whole tree on vfs. No
                 # cache: each build starts from the base, as a release's does.
                 "--layers=false", "--no-cache",
                 "--file", str(DOCKERFILE), "--ignorefile", str(IGNOREFILE),
                 "--build-arg", f"BASE={self.base_ref}", "--tag", tag]  # fmt: skip
        for name, value in _build_args().items():
            build += ["--build-arg", f"{name}={value}"]
        if HOST_CA_BUNDLE.exists():
            # pip trusts what this host trusts: a network that re-signs TLS has its CA here.
            build += ["--volume", f"{HOST_CA_BUNDLE}:/run/pip-ca.pem:ro",
                      "--build-arg", "PIP_CERT=/run/pip-ca.pem"]  # fmt: skip
        self.podman(*build, str(REPO), timeout_s=600, log=self.podman.home / log_name)
        (inspect,) = json.loads(self.podman("image", "inspect", tag))
        (base,) = json.loads(self.podman("image", "inspect", self.base_ref))
        root = Path(self.podman("image", "mount", tag).strip())
        return Image(inspect, root, int(inspect["Size"]) - int(base["Size"]))


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builder]:
    """podman with the recorded debootstrapped base loaded, named by its digest."""
    if os.geteuid() != 0:
        pytest.skip("needs root: debootstrap, podman's storage, chroot and mounts")
    private = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if private.returncode != 0:
        # Inside a chroot / is not a mount point, so unshare cannot make the mounts
        # private from it (EINVAL): no mount namespace to build or run the image in.
        pytest.skip(f"needs a private mount namespace: {private.stderr.strip()}")
    for tool in ("podman", "debootstrap", "unshare", "chroot", "git"):
        assert shutil.which(tool), f"{tool} is missing (`make system-deps` installs it)"
    tarball = _base_tarball()
    _check_base(tarball)
    system_cache_existed = PODMAN_SYSTEM_CACHE.exists()
    home = tmp_path_factory.mktemp("podman")
    run = Path(tempfile.mkdtemp(prefix="sf-podman-", dir="/tmp"))
    podman = Podman(home, run)
    try:
        podman("import", str(tarball), BASE_REF, timeout_s=300)
        digest = podman("image", "inspect", "--format", "{{.Digest}}", BASE_REF).strip()
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), digest
        yield Builder(podman, f"{BASE_REF.rpartition(':')[0]}@{digest}")
    finally:
        with Path("/proc/self/mountinfo").open() as mounts:
            left = [line for line in mounts if str(home) in line]
        shutil.rmtree(home, ignore_errors=not left)  # never into a mount left behind
        shutil.rmtree(run, ignore_errors=True)
        if not system_cache_existed:
            shutil.rmtree(PODMAN_SYSTEM_CACHE, ignore_errors=True)
        assert not left, f"mounts left behind: {left}"


@pytest.fixture(scope="module")
def image(builder: Builder) -> Iterator[Image]:
    """The image built from the working tree on the debootstrapped base."""
    image = builder.build(IMAGE_REF, "build.log")
    try:
        yield image
    finally:
        builder.podman("image", "unmount", IMAGE_REF)


def test_image_config(image: Image) -> None:
    """User, volume, ports, health check and environment are what deploy/README.md says."""
    config = image.config
    uid, gid = image.user
    assert uid != 0 and gid != 0
    passwd = {line.split(":")[2]: line.split(":") for line in
              (image.root / "etc/passwd").read_text().splitlines()}  # fmt: skip
    assert passwd[str(uid)][0] == "snowflake"
    assert passwd[str(uid)][5] == "/var/lib/snowflake"
    state = image.root / "var/lib/snowflake"
    assert (state.stat().st_uid, state.stat().st_gid) == (uid, gid)

    assert set(config["Volumes"]) == {"/var/lib/snowflake"}
    defaults = ServerSettings()
    assert set(config["ExposedPorts"]) == {f"{defaults.port}/tcp", f"{defaults.metrics_port}/tcp"}
    assert config["Entrypoint"] == ["/opt/snowflake/bin/snowflake-server"]
    assert config.get("StopSignal") == "SIGTERM"

    health = image.inspect["Healthcheck"]
    assert health["Test"][0] == "CMD", "exec form: the image has no need of a shell for it"
    # Liveness, not readiness: see test_zookeeper_outage_leaves_the_container_healthy.
    assert "/livez" in " ".join(health["Test"]) and "/readyz" not in " ".join(health["Test"])
    assert 0 < health["Timeout"] < health["Interval"]

    env = image.env
    assert {k: env.get(k) for k in ("SNOWFLAKE_HOST", "SNOWFLAKE_METRICS_HOST",
                                    "SNOWFLAKE_STATE_DIR", "SNOWFLAKE_LOG_FORMAT")} == {
        "SNOWFLAKE_HOST": "0.0.0.0", "SNOWFLAKE_METRICS_HOST": "0.0.0.0",
        "SNOWFLAKE_STATE_DIR": "/var/lib/snowflake", "SNOWFLAKE_LOG_FORMAT": "json",
    }  # fmt: skip
    options = {option.env for option in OPTIONS}
    unknown = {k for k in env if k.startswith("SNOWFLAKE_")} - options
    assert not unknown, f"the image sets variables no option reads: {unknown}"


def test_image_is_small_and_has_no_build_tools(image: Image) -> None:
    """Only the runtime is left: no compiler, no pip, no apt lists."""
    assert image.added_bytes < MAX_ADDED_MB * 1_000_000, f"{image.added_bytes / 1e6:.0f} MB"
    tools = [p.name for p in (image.root / "usr/bin").iterdir()]
    assert not [t for t in tools if t in ("cc", "c++", "ld") or "gcc" in t or "clang" in t]
    for path in ("opt/snowflake/bin/pip", "usr/lib/python3/dist-packages/pip"):
        assert not (image.root / path).exists(), path
    assert not any((image.root / "var/lib/apt/lists").glob("*_Packages"))
    assert (image.root / "opt/snowflake/bin/snowflake-server").is_file()


def test_image_labels(image: Image) -> None:
    """The OCI labels say which release, commit and source the image is, and its
    licence: from the VERSION file, git and pyproject, as the release workflow passes them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    expected = {
        "org.opencontainers.image.version": (REPO / "VERSION").read_text().strip(),
        "org.opencontainers.image.revision": _build_args()["REVISION"],
        "org.opencontainers.image.created": _build_args()["CREATED"],
        "org.opencontainers.image.source": project.get("urls", {}).get("Source", PROJECT_HOME),
        "org.opencontainers.image.licenses": project["license"],
        "org.opencontainers.image.title": project["name"],
    }
    labels = image.labels
    assert {name: labels.get(name) for name in expected} == expected
    assert labels.get("org.opencontainers.image.description")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _venv_distributions(root: Path) -> dict[str, str]:
    """{canonical name: version} of every distribution installed in the image's venv."""
    found = {}
    for info in (root / SITE_PACKAGES).glob("*.dist-info"):
        metadata = (info / "METADATA").read_text(errors="replace")
        name = re.search(r"^Name: *(\S+)", metadata, re.MULTILINE)
        version = re.search(r"^Version: *(\S+)", metadata, re.MULTILINE)
        assert name and version, info
        found[_canonical(name[1])] = version[1]
    return found


def _locked(lock: Path) -> dict[str, str]:
    """{canonical name: version} of a pip-compile lock's pins."""
    pins = re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", lock.read_text(), re.MULTILINE)
    return {_canonical(name): version for name, version in pins}


def test_venv_holds_the_locked_packages_and_the_sbom_lists_them(image: Image) -> None:
    """The venv holds exactly the lock's third-party packages at the locked versions and
    our two distributions at VERSION; the SBOM (CycloneDX) lists exactly that."""
    installed = _venv_distributions(image.root)
    version = (REPO / "VERSION").read_text().strip()
    ours = {"snowflake-server": version, "snowflake-thrift-client": version}
    # setuptools is locked to build ours (make run's editable install); the image builds
    # its wheels in the build stage, and leaves setuptools (and pip) out.
    locked = {name: v for name, v in _locked(RUNTIME_LOCK).items() if name != "setuptools"}
    assert installed == {**locked, **ours}, "pip, setuptools or a build tool left in?"

    sbom_path = image.root / SBOM
    sbom = json.loads(sbom_path.read_text())
    assert (sbom["bomFormat"], sbom["specVersion"]) == ("CycloneDX", "1.6")
    assert "serialNumber" not in sbom, "--output-reproducible: no random serial number"
    # Its time is SOURCE_DATE_EPOCH's: the commit's, as the created label's.
    created = datetime.fromisoformat(image.labels["org.opencontainers.image.created"])
    assert datetime.fromisoformat(sbom["metadata"]["timestamp"]) == created
    components = [(_canonical(c["name"]), c["version"]) for c in sbom["components"]]
    assert len(components) == len(set(components))
    assert dict(components) == installed


def _tree(root: Path, top: str = "opt/snowflake") -> dict[str, str]:
    """Every file, link and directory under ``top``: its content's sha256, its link's
    target, or "dir"."""
    entries = {}
    for directory, dirs, files in os.walk(root / top):
        for name in [*dirs, *files]:
            path = Path(directory, name)
            key = str(path.relative_to(root))
            if path.is_symlink():
                entries[key] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                entries[key] = "dir"
            else:
                entries[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entries


def test_two_builds_install_the_same_files(builder: Builder, image: Image) -> None:
    """Built again from the same inputs, without podman's cache: the same packages at the
    same versions, every file of /opt/snowflake the same, bytecode included (the build
    sets SOURCE_DATE_EPOCH: without it each .pyc holds its source's install time)."""
    first = _tree(image.root)
    again = builder.build(AGAIN_REF, "build-again.log")
    try:
        second = _tree(again.root)
        assert _venv_distributions(again.root) == _venv_distributions(image.root)
    finally:
        builder.podman("image", "unmount", AGAIN_REF)
        builder.podman("rmi", AGAIN_REF)
    differ = sorted(
        key for key in first.keys() | second.keys() if first.get(key) != second.get(key)
    )
    assert not differ, f"{len(differ)} of {len(first)} differ: {differ[:20]}"
    assert any(key.endswith(".pyc") for key in first), "the bytecode is compared too"


# Run from a private mount namespace, as PID 1 of a new PID namespace: the root read only
# and the state directory bound onto the volume's path, /proc of the new namespace and the
# devices a container runtime gives. The kernel undoes every mount when the namespace's
# last process exits, however it exits. The script runs in the host's /bin/sh; only the
# server runs in the image's root.
_CONTAINER = """\
set -eu
root=$1 state=$2 userspec=$3; shift 3
mount --bind "$root" "$root"
mount --bind "$state" "$root/var/lib/snowflake"
mount -o remount,bind,ro "$root"
mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
mount -t tmpfs -o nosuid,mode=0755,size=64k tmpfs "$root/dev"
for dev in null zero full random urandom; do
    touch "$root/dev/$dev" && mount --bind "/dev/$dev" "$root/dev/$dev"
done
exec chroot --userspec="$userspec" "$root" "$@"
"""


class Container:
    """``snowflake-server`` running from the image, started by :meth:`start`."""

    def __init__(
        self, image: Image, state: Path, env: Mapping[str, str], args: Sequence[str] = ()
    ) -> None:
        uid, gid = image.user
        self.image = image
        self.env = {**image.env, **env}
        self.command = [
            "unshare", "--mount", "--pid", "--fork", "--kill-child", "--",
            "sh", "-c", _CONTAINER, "container", str(image.root), str(state), f"{uid}:{gid}",
            *image.config["Entrypoint"], *args,
        ]  # fmt: skip
        self.stderr: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by kill()
        self.process: subprocess.Popen[str] | None = None

    def start(self, timeout_s: float = 30) -> ReadyLine:
        """Start it, and return its ready line's addresses once it prints it."""
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                                        stderr=self.stderr, text=True, env=self.env)  # fmt: skip
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while selector.select(max(0.0, deadline - time.monotonic())):
                line = self.process.stdout.readline()
                if not line:
                    break
                ready = parse_ready_line(line.strip())
                if ready is not None:
                    return ready
        raise AssertionError(
            f"no ready line within {timeout_s} s (rc={self.process.poll()}):\n{self.log()}"
        )

    @property
    def server_pid(self) -> int:
        """The server's PID as this namespace sees it: unshare's one child."""
        assert self.process is not None
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        (pid,) = children.read_text().split()
        return int(pid)

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def healthcheck(self, metrics_port: int) -> int:
        """The image's HEALTHCHECK command, run in its root as its user; its exit code.

        The server listens on a free port here: the command is given it as a
        container's environment would (SNOWFLAKE_METRICS_PORT)."""
        uid, gid = self.image.user
        test = self.image.inspect["Healthcheck"]["Test"]
        env = {**self.env, "SNOWFLAKE_METRICS_PORT": str(metrics_port)}
        return subprocess.run(
            ["chroot", f"--userspec={uid}:{gid}", str(self.image.root), *test[1:]],
            env=env,
            capture_output=True,
            timeout=30,
            check=False,
        ).returncode

    def terminate(self) -> None:
        """SIGTERM to the server, PID 1 of its namespace, as a runtime stops a container."""
        os.kill(self.server_pid, signal.SIGTERM)

    def wait(self, timeout_s: float = 30) -> int:
        """The server's exit code, once it has exited."""
        assert self.process is not None
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        """However the test went: no process of it left (killing PID 1 of a PID
        namespace kills the namespace), stdout and stderr closed."""
        if self.process is not None:
            if self.process.poll() is None:
                with contextlib.suppress(ValueError, OSError):
                    os.kill(self.server_pid, signal.SIGKILL)
                self.process.kill()
                self.process.wait(10)
            assert self.process.stdout is not None
            self.process.stdout.close()
        self.stderr.close()


@pytest.fixture
def container_env() -> dict[str, str]:
    """Loopback only, free ports, and a host lock of its own (the server shares this
    host's network namespace, where other tests' servers hold worker 0's lock)."""
    return {
        "SNOWFLAKE_HOST": "127.0.0.1",
        "SNOWFLAKE_METRICS_HOST": "127.0.0.1",
        "SNOWFLAKE_PORT": "0",
        "SNOWFLAKE_METRICS_PORT": "0",
        "SNOWFLAKE_HOST_LOCK_SCOPE": f"test-{uuid.uuid4().hex[:12]}",
        # Long enough to see the drain from outside on a busy machine.
        "SNOWFLAKE_DRAIN_SECONDS": "5",
    }


@pytest.fixture
def volume(image: Image, tmp_path: Path) -> Path:
    """An empty volume for the state directory, owned by the image's user (as
    Kubernetes' fsGroup, or Docker copying the image's directory, leaves it)."""
    path = tmp_path / "volume"
    path.mkdir(mode=0o700)
    os.chown(path, *image.user)
    return path


def _http_get(address: tuple[str, int], path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def test_server_runs_from_the_image(
    image: Image, volume: Path, container_env: dict[str, str]
) -> None:
    """As the image's user, read-only root, state in the volume: serves ids, is ready,
    passes its HEALTHCHECK, still passes it while draining after SIGTERM (not ready, but
    alive), fails it once exited 0; a second
    start on the same volume finds the high-water mark and goes on above the first's ids."""
    container = Container(image, volume, container_env)
    try:
        ready = container.start()
        assert ready.thrift[0] == "127.0.0.1" and ready.metrics[0] == "127.0.0.1"
        with SnowflakeClient(*ready.thrift, agent="image-test") as client:
            issued = [client.next_id(), *client.next_ids(100)]
            assert issued == sorted(set(issued))
            assert client.worker_id() == 0
        assert _http_get(ready.metrics, "/readyz")[0] == 200
        assert _http_get(ready.metrics, "/livez")[0] == 200
        assert container.healthcheck(ready.metrics[1]) == 0

        status = dict(
            line.split(":", 1)
            for line in Path(f"/proc/{container.server_pid}/status").read_text().splitlines()
        )
        assert status["Uid"].split()[:2] == [str(image.user[0])] * 2, "the image's user"
        assert status["NSpid"].split()[-1] == "1", "PID 1 of its namespace, as in a container"

        container.terminate()
        wait_until(lambda: _http_get(ready.metrics, "/readyz")[0] == 503,
                   "/readyz 503 after SIGTERM (draining)")  # fmt: skip
        # Draining is no ill health: a runtime must not kill it for that.
        assert container.healthcheck(ready.metrics[1]) == 0
        # Still draining: ids are still served (SNOWFLAKE_DRAIN_SECONDS).
        with SnowflakeClient(*ready.thrift, agent="image-test") as client:
            issued.append(client.next_id())
        assert container.wait() == 0, container.log()
        assert container.healthcheck(ready.metrics[1]) != 0
        log = container.log()
    finally:
        container.kill()
    lines = [line for line in log.splitlines() if line.strip()]
    assert lines and all(isinstance(json.loads(line), dict) for line in lines), log

    marks = list(volume.iterdir())
    assert marks, "the high-water mark is kept in the volume"
    assert all(mark.stat().st_uid == image.user[0] for mark in marks)

    again = Container(image, volume, {**container_env, "SNOWFLAKE_DRAIN_SECONDS": "0"})
    try:
        ready = again.start()
        with SnowflakeClient(*ready.thrift, agent="image-test") as client:
            assert client.next_id() > issued[-1]
        status_code, metrics = _http_get(ready.metrics, "/metrics")
        assert status_code == 200
        assert "snowflake_first_starts_total 0.0" in metrics, "the mark was found"
        again.terminate()
        assert again.wait() == 0, again.log()
    finally:
        again.kill()


def test_zookeeper_outage_leaves_the_container_healthy(
    image: Image, volume: Path, container_env: dict[str, str], zookeeper: ZooKeeper
) -> None:
    """A cluster node that loses ZooKeeper is not ready (/readyz 503) but alive: its
    HEALTHCHECK passes, so a runtime does not restart it (that would only lose its worker
    id); it is ready again once ZooKeeper is back. ZooKeeper is this module's own."""
    flags = zookeeper.node_flags(f"/image-test-{uuid.uuid4().hex[:8]}")
    container = Container(image, volume, {**container_env, "SNOWFLAKE_DRAIN_SECONDS": "0"},
                          args=flags)  # fmt: skip
    try:
        ready = container.start()
        assert _http_get(ready.metrics, "/readyz")[0] == 200
        assert container.healthcheck(ready.metrics[1]) == 0
        zookeeper.stop()
        wait_until(lambda: _http_get(ready.metrics, "/readyz")[0] == 503,
                   "/readyz 503 with ZooKeeper gone")  # fmt: skip
        assert container.healthcheck(ready.metrics[1]) == 0, container.log()
        zookeeper.start()
        wait_until(lambda: _http_get(ready.metrics, "/readyz")[0] == 200,
                   "/readyz 200 with ZooKeeper back", timeout_s=30)  # fmt: skip
        container.terminate()
        assert container.wait() == 0, container.log()
    finally:
        container.kill()


def test_build_tools_lock_agrees_with_the_dev_lock() -> None:
    """deploy/docker/build-tools.txt pins what requirements/dev.txt also pins at the same
    versions: `make image-lock` after `make lock`, or one of them is stale."""
    tools = _locked(REPO / "deploy" / "docker" / "build-tools.txt")
    dev = _locked(REPO / "requirements" / "dev.txt")
    stale = {name: (v, dev[name]) for name, v in tools.items() if name in dev and dev[name] != v}
    assert not stale, f"build-tools.txt vs dev.txt: {stale}"
    assert {"setuptools", "cyclonedx-bom"} <= tools.keys() & dev.keys()
