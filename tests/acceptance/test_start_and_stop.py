"""A clean stop in every phase of start-up and under load, and failures found before any wait.

Real server processes and real signals. A SIGTERM during a start-up wait ends the
wait at once: exit 0, nothing left behind, and no mark written by a node that had
not reserved (a mark written during the first-start wait would let the next start
skip the very wait that protects a lost state). A port in use fails before the
waits, not after them.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from thriftpy2.transport import TTransportException

from snowflake_server._ids.clocks import wall_clock_ms
from tests.support.endpoints import free_port
from tests.support.processes import Spawned, child_pids, spawned, start_server
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

# A stop must end start-up within this (the bound); the long waits below would
# take 60 s if it did not.
_STOP_WITHIN_S = 2.0
_LONG_WAIT = "60"
_EXIT_WITHIN_S = 15.0  # for a start that fails at once (it would wait 60 s otherwise)


def stopped(server: Spawned) -> int:
    """SIGTERM ``server``: its exit code, once it stopped within ``_STOP_WITHIN_S``."""
    code, took = server.end(_STOP_WITHIN_S + 8, signal.SIGTERM)
    assert took < _STOP_WITHIN_S, f"it took {took:.2f} s to stop\n{server.log()}"
    return code


def waits_first_start(server: Spawned, count: int = 1) -> None:
    wait_until(
        lambda: server.log().count("waiting --first-start-wait") == count,
        "the start waits --first-start-wait",
    )


def test_a_stop_during_the_first_start_wait_writes_no_mark_and_the_next_start_waits_again(
    tmp_path: Path,
) -> None:
    state_dir = tmp_path / "state"
    for attempt in ("first", "second"):
        with spawned(state_dir=state_dir, first_start_wait=_LONG_WAIT) as server:
            waits_first_start(server)
            assert stopped(server) == 0, f"{attempt} start: not a clean stop\n{server.log()}"
        assert "stopped while starting" in server.log()
        # Nothing reserved, nothing written: the next start cannot skip its wait.
        assert list(state_dir.glob("worker-*.json")) == [], "a mark was written while waiting"


def test_a_stop_during_the_clock_wait_leaves_the_mark_as_it_was(tmp_path: Path) -> None:
    first = start_server()
    first.raw_client().get_id("before")
    assert first.stop() == 0 and first.state_dir is not None
    state = next(first.state_dir.glob("worker-*.json"))
    # The mark a minute ahead of the clock: the next start waits for the clock.
    record = json.loads(state.read_text())
    record["high_water_mark_ms"] += 60_000
    state.write_text(json.dumps(record) + "\n")
    before = state.read_bytes()
    with spawned("--max-startup-wait", "120", state_dir=first.state_dir) as server:
        wait_until(lambda: "behind the high-water mark" in server.log(), "the clock wait")
        assert stopped(server) == 0, server.log()
    assert state.read_bytes() == before, "the mark was rewritten by a node that never reserved"


@pytest.mark.parametrize(
    ("port", "more"),
    [
        ("--port", ()),
        ("--metrics-port", ()),
        ("--http-port", ()),
        ("--metrics-port", ("--processes", "2")),  # the supervisor's own, before its processes
    ],
)
def test_a_port_in_use_fails_at_once_not_after_the_first_start_wait(
    port: str, more: tuple[str, ...]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        number = str(taken.getsockname()[1])
        with spawned(*more, port, number, first_start_wait=_LONG_WAIT) as server:
            code, _ = server.end(_EXIT_WITHIN_S)
    log = server.log()
    assert code == 2, f"exit {code}\n{log}"
    assert f"cannot listen on 127.0.0.1:{number}" in log
    assert "waiting --first-start-wait" not in log, "it waited before finding the port taken"


def test_a_stop_while_the_supervisor_s_processes_start_stops_them_all(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with spawned("--processes", "2", state_dir=state_dir, first_start_wait=_LONG_WAIT) as server:
        waits_first_start(server, count=2)
        children = child_pids(server.process.pid)
        assert stopped(server) == 0, server.log()
    assert len(children) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in children)
    assert list(state_dir.glob("worker-*.json")) == [], "a mark was written while waiting"


def test_the_supervisor_exits_as_a_process_that_did_not_start(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    with spawned("--processes", "2", state_dir=not_a_dir) as server:
        code, _ = server.end(_EXIT_WITHIN_S)
    # A setting the operator must fix (2), not "starting could repeat ids" (3).
    assert code == 2, f"exit {code}\n{server.log()}"
    assert "did not start (exit code 2)" in server.log()


def test_a_sighup_while_starting_tells_systemd_nothing(
    notify_socket: tuple[socket.socket, str], tmp_path: Path
) -> None:
    sock, path = notify_socket
    log_file = tmp_path / "server.log"
    flags = ("--log-file", str(log_file))
    with spawned(*flags, env={"NOTIFY_SOCKET": path}, first_start_wait=_LONG_WAIT) as server:
        wait_until(
            lambda: log_file.exists() and "waiting --first-start-wait" in log_file.read_text(),
            "the start waits --first-start-wait",
        )
        log_file.rename(tmp_path / "rotated.log")
        server.process.send_signal(signal.SIGHUP)
        # The log file is reopened (a rotation while starting), and that is all.
        wait_until(log_file.exists, "the log file reopened")
        assert stopped(server) == 0
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        # READY=1 (after RELOADING=1) would tell systemd the unit had started.
        sock.recv(4096)


# -- cluster mode: the same, and the registration removed -------------------------------


@pytest.mark.zookeeper
def test_a_stop_during_the_cluster_s_first_start_wait_deregisters_and_writes_no_mark(
    zookeeper: ZooKeeper, zk: KazooClient, zk_path: str, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    flags = zookeeper.node_flags(zk_path)
    for attempt in ("first", "second"):
        with spawned(*flags, state_dir=state_dir, first_start_wait=_LONG_WAIT) as server:
            waits_first_start(server)
            assert zk.get_children(f"{zk_path}/nodes/0") == ["0"], "registered while waiting"
            assert stopped(server) == 0, f"{attempt} start: not a clean stop\n{server.log()}"
        assert zk.get_children(f"{zk_path}/nodes/0") == [], "the registration stayed behind"
        assert zk.exists(f"{zk_path}/marks/0/0") is None, "a mark was written while waiting"
        assert list(state_dir.glob("worker-*.json")) == []


@pytest.mark.zookeeper
def test_a_stop_during_the_peer_checks_ends_them(
    zookeeper: ZooKeeper, zk: KazooClient, zk_path: str
) -> None:
    # A registered peer that hangs up on every connection: the checks keep asking it.
    with socket.socket() as peer:
        peer.bind(("127.0.0.1", 0))
        peer.listen()
        peer.settimeout(20)
        address = f"127.0.0.1:{peer.getsockname()[1]}"
        zk.create(f"{zk_path}/nodes/0/5", address.encode(), makepath=True)
        with spawned(*zookeeper.node_flags(zk_path), "--worker-id", "1") as server:
            for _ in range(2):  # asked, and asked again: in the checks
                peer.accept()[0].close()
            assert stopped(server) == 0, server.log()
    assert zk.get_children(f"{zk_path}/nodes/0") == ["5"], "only the peer's registration"


# -- a stop under load and failures before any wait (moved from tests/serving) --------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_within_2_seconds_and_lets_calls_finish(sig: int) -> None:
    server = start_server()
    idle = server.raw_client()
    idle.get_id("idle")
    busy = server.raw_client()
    results: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            try:
                results.extend(busy.get_ids("busy", 4096))
            except (TTransportException, OSError) as e:
                failures.append(e)
                return

    thread = threading.Thread(target=hammer)
    thread.start()
    wait_until(lambda: len(results) >= 4096 * 3, "three batches served")
    started = time.monotonic()
    server.process.send_signal(sig)
    code = server.process.wait(5)
    elapsed = time.monotonic() - started
    stop.set()
    thread.join(5)
    server.stop()
    assert code == 0, server.log()
    assert elapsed < 2.0
    # Every reply that arrived was whole: ids are unique and increasing.
    assert len(results) % 4096 == 0
    assert results == sorted(set(results))


def test_busy_port_is_a_clear_start_up_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AssertionError, match="cannot listen"):
            start_server("--port", str(port))


def test_epoch_in_the_future_is_a_clear_start_up_error() -> None:
    with pytest.raises(AssertionError, match="in the future"):
        start_server("--epoch", str(wall_clock_ms() + 3_600_000))
