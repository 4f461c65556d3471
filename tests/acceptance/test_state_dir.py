"""Black-box regression tests for issue 22, item 1: the state file's last mile.
Real server processes; a real file-size limit (``prlimit``), real links, real owners.

- a write cut short (RLIMIT_FSIZE: a short write, then EFBIG) must fail, not replace
  the good state file with a torn one: /readyz says so, ids stop past the reserved
  mark, and a restart starts from the good mark;
- a ``.tmp`` link planted in the state directory is never written through;
- a state directory that is not the server's own (a link, a file, writable by others,
  another user's), or a state file that is a link, is a configuration error (exit 2);
- the state directory of a Kubernetes volume under ``fsGroup`` is the server's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kazoo.client import KazooClient
from snowflake_thrift_client import UnavailableError, decompose

from tests.support.endpoints import take_ids
from tests.support.processes import ServerDidNotStart, ServerProcess, parse_metrics, start_server
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

STATEFULSET = Path(__file__).parents[2] / "deploy/kubernetes/base/statefulset.yaml"


def take(server: ServerProcess, rounds: int = 5) -> list[int]:
    return take_ids(server, rounds, 100, "state-dir")


def readyz(server: ServerProcess) -> tuple[int, dict[str, Any]]:
    status, body = server.http_get("/readyz")
    answer: dict[str, Any] = json.loads(body)
    return status, answer


def stored_mark(state_dir: Path) -> int:
    """The mark in worker 0's state file (which must parse: never torn)."""
    mark: int = json.loads((state_dir / "worker-0-0.json").read_text())["high_water_mark_ms"]
    return mark


def disk_writes(server: ServerProcess) -> float:
    return parse_metrics(server.metrics())['snowflake_state_writes_total{store="disk"}']


def prlimit_fsize(pid: int, limit: str) -> None:
    """Set the soft file-size limit of a running process (the hard one stays)."""
    subprocess.run(["prlimit", "--pid", str(pid), f"--fsize={limit}:"], check=True, timeout=10)


@pytest.mark.slow  # waits for a failing renewal, then restarts
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")
def test_a_write_cut_short_keeps_the_good_file_and_stops_the_ids(tmp_path: Path) -> None:
    """The finding: under ``prlimit --fsize=120`` the temporary file was cut at 120
    bytes and renamed over the good one; /readyz stayed 200 while no mark was stored,
    and the restart exited 3 ("state file ... unusable")."""
    state_dir = tmp_path / "state"
    server = start_server(state_dir=state_dir)
    try:
        before = take(server)
        # From now on every write of the server past byte 120 of a file fails: a whole
        # state record (about 200 bytes) never fits. Its log (a file too) is cut as well:
        # what it says shows in /readyz and the metrics.
        prlimit_fsize(server.process.pid, "120")
        wait_until(lambda: readyz(server)[0] == 503, "/readyz 503 once a write is cut short")
        reason = str(readyz(server)[1]["reason"])
        assert reason.startswith("the high-water mark cannot be written: "), reason
        assert "File too large" in reason and "the state file is unchanged" in reason, reason
        assert parse_metrics(server.metrics())['snowflake_state_write_errors_total{store="disk"}']
        good = (state_dir / "worker-0-0.json").read_bytes()
        assert stored_mark(state_dir) >= max(decompose(i).timestamp_ms for i in before)
        # Ids go on up to the mark already stored (at most 1 s ahead), then stop.
        client = server.client(agent="state-dir")
        during: list[int] = []

        def refused() -> bool:
            try:
                during.extend(client.next_ids(10))
            except UnavailableError as e:
                assert "File too large" in str(e), e
                return True
            return False

        wait_until(refused, "get_ids refused once the stored mark is passed", 10)
        assert max(decompose(i).timestamp_ms for i in before + during) <= stored_mark(state_dir)
        assert server.process.poll() is None, "SIGXFSZ is ignored: the write fails instead"
        # Its final write fails too; 120 is Python's own exit code when it cannot flush
        # stderr at exit (the log, a file here, is past the limit as well).
        assert server.stop() in (0, 120), server.log()
        assert (state_dir / "worker-0-0.json").read_bytes() == good, "the good file stays"
        assert not (state_dir / "worker-0-0.json.tmp").exists()
    finally:
        if server.process.poll() is None:
            server.stop()
    # Without the limit: starts from the good mark (no exit 3), above every id issued.
    again = start_server(state_dir=state_dir)
    try:
        after = take(again)
        assert min(after) > max(before + during)
    finally:
        assert again.stop() == 0, again.log()


def test_a_planted_tmp_link_is_never_written_through(tmp_path: Path) -> None:
    """The finding: a ``worker-0-0.json.tmp`` link made the server (root) truncate and
    overwrite the file it pointed to."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    tmp = state_dir / "worker-0-0.json.tmp"
    tmp.symlink_to(victim)  # before the start
    server = start_server(state_dir=state_dir)
    try:
        take(server)
        tmp.symlink_to(victim)  # and while it runs, between two renewals
        writes = disk_writes(server)
        wait_until(lambda: disk_writes(server) >= writes + 2, "two more renewals of the mark")
        assert readyz(server)[0] == 200
    finally:
        assert server.stop() == 0, server.log()
    assert victim.read_text() == "precious\n"
    assert not tmp.is_symlink() and not tmp.exists()
    assert not (state_dir / "worker-0-0.json").is_symlink()
    assert stored_mark(state_dir) > 0


def _link_the_state_file(tmp_path: Path) -> tuple[Path, str]:
    """A state file that is a link to a good state file kept elsewhere."""
    state_dir = tmp_path / "state"
    first = start_server(state_dir=state_dir)
    assert first.stop() == 0, first.log()
    elsewhere = tmp_path / "elsewhere.json"
    (state_dir / "worker-0-0.json").rename(elsewhere)
    (state_dir / "worker-0-0.json").symlink_to(elsewhere)
    return state_dir, f"state file {state_dir / 'worker-0-0.json'} is a symbolic link"


def _link_the_state_dir(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "state").symlink_to(tmp_path / "real")
    return tmp_path / "state", f"state directory {tmp_path / 'state'} is a symbolic link"


def _world_writable(mode: int) -> Callable[[Path], tuple[Path, str]]:
    def make(tmp_path: Path) -> tuple[Path, str]:
        (tmp_path / "state").mkdir()
        (tmp_path / "state").chmod(mode)
        said = f"every user may write to it (owner uid 0, group gid 0, mode {mode:04o}"
        return tmp_path / "state", said

    return make


def _another_user_s(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "state").mkdir(mode=0o700)
    os.chown(tmp_path / "state", 10002, 10002)
    return tmp_path / "state", "it belongs to another user (uid 10002)"


def _a_file(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "state").write_text("")
    return tmp_path / "state", "a file is where a directory should be"


@pytest.mark.parametrize(
    "make",
    [
        _link_the_state_file,
        _link_the_state_dir,
        _world_writable(0o777),
        _world_writable(0o1777),  # sticky, as /tmp: others still create the names it uses
        _another_user_s,
        _a_file,
    ],
    ids=["linked-file", "linked-dir", "mode-777", "mode-1777", "another-user", "a-file"],
)
def test_a_state_dir_not_the_server_s_own_is_a_configuration_error(
    tmp_path: Path, make: Callable[[Path], tuple[Path, str]]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: a directory of another user, a server that may write anywhere")
    state_dir, said = make(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    try:
        server = start_server(state_dir=state_dir)
    except ServerDidNotStart as refused:
        assert refused.returncode == 2, refused.log
        assert "snowflake-server: error: " in refused.log and said in refused.log, refused.log
        assert "--state-dir" in refused.log or "cp --remove-destination" in refused.log
    else:
        server.stop()
        pytest.fail(f"it started with {state_dir}:\n{server.log()}")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "refused before any write"


def _pod_security() -> dict[str, int]:
    """The pod's runAsUser, runAsGroup and fsGroup in the shipped manifest."""
    documents = list(yaml.safe_load_all(STATEFULSET.read_text()))
    (statefulset,) = [d for d in documents if d["kind"] == "StatefulSet"]
    context: dict[str, int] = statefulset["spec"]["template"]["spec"]["securityContext"]
    return context


@pytest.fixture
def fs_group_volume() -> Iterator[Path]:
    """A volume root as the kubelet leaves it under the manifest's ``fsGroup``: owned by
    root, group-owned by fsGroup, mode 2775 (group-writable, setgid). Under a folder any
    user may traverse (pytest's own is root's only)."""
    base = Path(tempfile.mkdtemp(prefix="snowflake-fsgroup-"))
    try:
        base.chmod(0o755)
        volume = base / "volume"
        volume.mkdir()
        os.chown(volume, 0, _pod_security()["fsGroup"])
        volume.chmod(0o2775)
        yield volume
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_user(uid: int, gid: int) -> list[str]:
    """Run as ``uid``:``gid``, able to read and search everything (the checkout and its
    interpreter may sit where only root may enter: CI clones into such a folder) but
    to write only what that user may: for tests of what the server may *write*."""
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]  # fmt: skip


# Root, but held to the permission bits like any user (no CAP_DAC_OVERRIDE or
# CAP_DAC_READ_SEARCH): for tests of what the server may *read*.
ROOT_WITHOUT_OVERRIDES = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


# Measuring coverage, the server would write its data file where this user may not.
NO_COVERAGE = {"COVERAGE_PROCESS_CONFIG": "", "COVERAGE_PROCESS_START": ""}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: to run the server as another user")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
def test_the_volume_of_a_kubernetes_pod_is_the_server_s_own(fs_group_volume: Path) -> None:
    pod = _pod_security()
    assert pod["fsGroup"] == pod["runAsGroup"], "the manifest this test stands for"
    user = as_user(pod["runAsUser"], pod["runAsGroup"])
    server = start_server(state_dir=fs_group_volume, wrapper=user, env=NO_COVERAGE)
    try:
        take(server)
    finally:
        assert server.stop() == 0, server.log()
    state = (fs_group_volume / "worker-0-0.json").stat()
    assert (state.st_uid, state.st_gid) == (pod["runAsUser"], pod["fsGroup"])
    assert stored_mark(fs_group_volume) > 0
    # A user outside the group may not rely on it: its members may write there.
    try:
        other = start_server(state_dir=fs_group_volume, wrapper=as_user(10002, 10002),
                             env=NO_COVERAGE)  # fmt: skip
    except ServerDidNotStart as refused:
        assert refused.returncode == 2, refused.log
        said = f"group {pod['fsGroup']} may write to it and this server's user is not in it"
        assert said in refused.log, refused.log
    else:
        other.stop()
        pytest.fail(f"a user outside group {pod['fsGroup']} started:\n{other.log()}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: to run the server as another user")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
def test_a_state_dir_the_server_may_not_write_is_a_configuration_error(
    fs_group_volume: Path,
) -> None:
    fs_group_volume.chmod(0o755)  # root's: the pod's user may not create its files
    pod = _pod_security()
    try:
        server = start_server(state_dir=fs_group_volume,
                              wrapper=as_user(pod["runAsUser"], pod["runAsGroup"]),
                              env=NO_COVERAGE)  # fmt: skip
    except ServerDidNotStart as refused:
        assert refused.returncode == 2, refused.log
        lock = fs_group_volume / "worker-0-0.lock"
        assert f"cannot open lock file {lock}: Permission denied" in refused.log, refused.log
        assert f"chown {pod['runAsUser']}:{pod['runAsGroup']} {fs_group_volume}" in refused.log
    else:
        server.stop()
        pytest.fail(f"it started:\n{server.log()}")


@pytest.mark.zookeeper
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a state directory of another user")
def test_worker_id_auto_does_not_skip_past_an_unsafe_state_dir(
    zookeeper: ZooKeeper, zk: KazooClient, zk_path: str, tmp_path: Path
) -> None:
    """``--worker-id auto`` skips a worker id whose mark it cannot honour (exit 3 causes);
    a state directory that is not the server's own is no such cause: no worker id would
    do, so it ends the start (exit 2) and gives back the id it leased."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    os.chown(state_dir, 10002, 10002)
    flags = ("--zookeeper", zookeeper.hosts, "--zk-path", zk_path, "--worker-id", "auto",
             "--zk-connect-timeout", "5", "--skip-sanity-checks")  # fmt: skip
    try:
        server = start_server(*flags, state_dir=state_dir)
    except ServerDidNotStart as refused:
        assert refused.returncode == 2, refused.log
        assert "it belongs to another user (uid 10002)" in refused.log, refused.log
        assert "skipping worker id" not in refused.log
    else:
        server.stop()
        pytest.fail(f"it started:\n{server.log()}")
    assert not zk.get_children(f"{zk_path}/nodes/0"), "the leased id is given back"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a file of another user")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
def test_a_state_file_the_server_may_not_read_is_a_setting_not_a_corrupt_file(
    tmp_path: Path,
) -> None:
    # Left by a start as another user: the mark is good, only its owner is wrong.
    # "Unusable, start with --discard-corrupt-state" would throw the mark away.
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    state = state_dir / "worker-0-0.json"
    state.write_text("{}\n")
    state.chmod(0o600)
    os.chown(state, 10001, 10001)
    try:
        server = start_server(state_dir=state_dir, wrapper=ROOT_WITHOUT_OVERRIDES)
    except ServerDidNotStart as refused:
        assert refused.returncode == 2, refused.log
        assert f"state file {state}: Permission denied" in refused.log, refused.log
        assert f"chown 0:0 {state}" in refused.log
        assert "--discard-corrupt-state" not in refused.log
    else:
        server.stop()
        pytest.fail(f"it started:\n{server.log()}")
