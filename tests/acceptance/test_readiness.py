"""Readiness that tells the truth, against real processes: the Thrift port refuses
connections until the node can serve, and /readyz says 200 exactly when a get_id
would succeed (starting, registered, full disk, ZooKeeper stopped, draining).

Each answer is printed (``pytest -s -k readiness``) as ``READYZ <scenario>: ...``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from snowflake_thrift_client import UnavailableError

from tests.support.endpoints import free_port
from tests.support.processes import spawn_server, start_server
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

pytestmark = [pytest.mark.slow]

SESSION = "3"


def probe(metrics_port: int, path: str = "/readyz") -> tuple[int, dict[str, object]]:
    """The probe's status and body; (0, {}) while nothing listens."""
    url = f"http://127.0.0.1:{metrics_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())
    except urllib.error.URLError:
        return 0, {}


def show(scenario: str, answer: tuple[int, dict[str, object]]) -> tuple[int, dict[str, object]]:
    print(f"READYZ {scenario}: {answer[0]} {json.dumps(answer[1])}")
    return answer


def refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


@pytest.mark.zookeeper
def test_a_starting_node_refuses_connections_and_says_starting(
    zookeeper: ZooKeeper, zk_path: str
) -> None:
    flags = zookeeper.node_flags(zk_path, SESSION)
    holder = start_server(*flags, "--worker-id", "5")
    port, metrics_port = free_port(), free_port()
    # Refused worker 5, it retries twice 1 s apart (the holder might be its own ghost),
    # then exits: meanwhile nobody may take it for ready.
    process, stderr, _ = spawn_server(
        *flags, "--worker-id", "5", "--port", str(port), "--metrics-port", str(metrics_port)
    )
    try:
        wait_until(lambda: probe(metrics_port)[0] != 0, "the admin endpoint of the starting node")
        status, body = show("starting", probe(metrics_port))
        assert status == 503 and body["phase"] == "starting"
        assert body["reason"] == "starting: the node does not serve yet"
        assert probe(metrics_port, "/livez")[0] == 200
        assert refuses_connections(port), "the Thrift port must not accept before it can serve"
        assert process.wait(30) == 75, "a held static id: try again (its holder may be a ghost)"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stdout is not None
        process.stdout.close()
        stderr.close()
        holder.stop()


@pytest.mark.zookeeper
def test_a_registered_node_is_ready_and_says_where(zookeeper: ZooKeeper, zk_path: str) -> None:
    node = start_server(*zookeeper.node_flags(zk_path, SESSION), "--worker-id", "auto")
    try:
        status, body = show("registered", probe(node.metrics_port))
        assert status == 200 and body["phase"] == "serving"
        assert body["zookeeper"] == "CONNECTED"
        assert body["registered"] == f"{zk_path}/nodes/0/{body['worker_id']}"
        assert node.client(agent="readiness").next_id() > 0
    finally:
        node.stop()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs made for the test, unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "snowflake-test", str(mount)],
        check=True,
    )
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(directory: Path) -> None:
    """Take every free block of the file system holding ``directory``."""
    try:
        with open(directory / "filler", "ab") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC


def test_a_full_disk_makes_the_node_unready_until_space_returns(small_disk: Path) -> None:
    node = start_server(state_dir=small_disk)
    try:
        client = node.client(agent="readiness")
        assert show("disk with space", probe(node.metrics_port))[0] == 200

        def unready() -> bool:
            fill(small_disk)  # a write that freed a block (the old state file) gets it back
            return probe(node.metrics_port)[0] == 503

        wait_until(unready, "/readyz 503 once the state directory's disk is full")
        _, body = show("full disk", probe(node.metrics_port))
        reason = str(body["reason"])
        assert reason.startswith("the high-water mark cannot be written: ")
        assert "No space left on device" in reason
        assert probe(node.metrics_port, "/livez")[0] == 200, "full, not wedged"

        def refused() -> bool:
            fill(small_disk)
            try:
                client.next_id()
            except UnavailableError:
                return True
            return False

        wait_until(refused, "get_id refused once the reserved second is used up")
        (small_disk / "filler").unlink()
        wait_until(lambda: probe(node.metrics_port)[0] == 200, "ready again with space")
        show("space back", probe(node.metrics_port))
        assert client.next_id() > 0
    finally:
        node.stop()


@pytest.mark.zookeeper
def test_a_stopped_zookeeper_makes_the_node_unready_but_alive(
    own_zk: ZooKeeper, zk_path: str
) -> None:
    node = start_server(*own_zk.node_flags(zk_path, SESSION), "--worker-id", "auto")
    try:
        assert probe(node.metrics_port)[0] == 200
        own_zk.stop()
        wait_until(lambda: probe(node.metrics_port)[0] == 503, "/readyz 503 without ZooKeeper")
        _, body = show("zookeeper stopped", probe(node.metrics_port))
        # The session gate or the mark's write in ZooKeeper, whichever notices first.
        assert "zookeeper" in str(body["reason"]).lower()
        assert body["zookeeper"] != "CONNECTED"
        live = probe(node.metrics_port, "/livez")
        assert live[0] == 200, "a liveness probe must not restart a node for ZooKeeper's outage"
        client = node.client(agent="readiness")

        def refused() -> bool:
            try:
                client.next_id()
            except UnavailableError:
                return True
            return False

        # Unready first: calls go on within the margin already reserved, then stop.
        wait_until(refused, "get_id refused once the session is in doubt")
        own_zk.start()
        wait_until(lambda: probe(node.metrics_port)[0] == 200, "ready again with ZooKeeper", 60)
        show("zookeeper back", probe(node.metrics_port))
    finally:
        node.stop()


def test_draining_says_unready_at_once_and_serves_on_until_it_stops() -> None:
    node = start_server("--drain-seconds", "3")
    try:
        before = node.raw_client()
        assert before.get_id("drain") > 0
        signalled = time.monotonic()
        node.process.send_signal(signal.SIGTERM)
        wait_until(lambda: probe(node.metrics_port)[0] == 503, "/readyz 503 after SIGTERM")
        _, body = show("draining", probe(node.metrics_port))
        assert body["phase"] == "draining"
        assert before.get_id("drain") > 0, "an open connection is served on"
        assert node.raw_client().get_id("drain") > 0, "and so is a new one, until the drain ends"
        assert node.process.wait(15) == 0
        assert time.monotonic() - signalled >= 3
        assert refuses_connections(node.port)
    finally:
        node.stop()


def test_a_second_sigterm_stops_at_once() -> None:
    node = start_server("--drain-seconds", "60")
    try:
        node.process.send_signal(signal.SIGTERM)
        wait_until(lambda: probe(node.metrics_port)[0] == 503, "draining")
        node.process.send_signal(signal.SIGTERM)
        assert node.process.wait(10) == 0
        node.stop()
        assert "again: stopping now" in node.log()
    finally:
        node.stop()


def test_a_standalone_server_serves_the_default_process_metrics() -> None:
    node = start_server("--worker-id", "7", "--datacenter-id", "1")
    try:
        text = node.metrics()
        assert "process_open_fds " in text and "python_info{" in text
        assert (
            'snowflake_info{datacenter_id="1",worker_id="7",worker_id_source="number"} 1.0' in text
        )
        assert "snowflake_ready 1.0" in text
    finally:
        node.stop()
