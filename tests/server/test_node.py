"""The composition root: a whole server built from settings, in this process."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.security import make_digest_acl

from snowflake_server import (
    ConfigurationError,
    Layout,
    Node,
    ServerSettings,
    decompose,
)
from snowflake_server._app.node_id import WorkerIdOrigin
from snowflake_server._config.settings import FromMachine
from snowflake_server._errors import StartupDeferred
from tests.support.endpoints import free_port, unique_scope
from tests.support.inprocess import InProcessServer
from tests.support.zookeeper import ZooKeeper


def test_a_standalone_node_serves_and_stops_with_its_exact_mark(tmp_path: Path) -> None:
    settings = ServerSettings(datacenter_id=2, worker_id=9)
    with InProcessServer(settings, tmp_path) as server:
        ids = server.raw_client().get_ids("node", 10)
        assert {(decompose(i).datacenter_id, decompose(i).worker_id) for i in ids} == {(2, 9)}
        status, body = server.http_get("/health")
        assert status == 200 and json.loads(body)["worker_id"] == 9
    state = json.loads((tmp_path / "worker-2-9.json").read_text())
    assert state["high_water_mark_ms"] == decompose(ids[-1]).timestamp_ms, "exact, not reserved"


def test_readyz_says_where_the_worker_id_came_from(tmp_path: Path) -> None:
    with InProcessServer(ServerSettings(worker_id=4), tmp_path / "a") as server:
        body = json.loads(server.http_get("/readyz")[1])
        assert (body["worker_id_source"], body["worker_id_from"]) == ("number", "the settings")
    read = WorkerIdOrigin("ordinal", "the host name snowflake-4")
    with InProcessServer(ServerSettings(worker_id=4), tmp_path / "b", origin=read) as server:
        body = json.loads(server.http_get("/readyz")[1])
        assert body["worker_id"] == 4 and body["version"], "the fields it had stay"
        assert body["worker_id_source"] == "ordinal"
        assert body["worker_id_from"] == "the host name snowflake-4"
        assert 'worker_id="4",worker_id_source="ordinal"} 1.0' in server.metrics()


def test_a_node_needs_its_worker_id_read_from_the_machine_first(tmp_path: Path) -> None:
    unresolved = ServerSettings(worker_id=FromMachine.MAC, state_dir=str(tmp_path))
    with pytest.raises(ConfigurationError, match="worker_id mac is read from this machine"):
        Node(unresolved)


def test_a_port_in_use_is_a_configuration_error_and_nothing_stays_open(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = ServerSettings(
            port=port,
            metrics_port=0,  # never a default port: another server may hold it
            state_dir=str(tmp_path),
            first_start_wait=0,
            host_lock_scope=unique_scope(),
        )
        with pytest.raises(ConfigurationError, match=f"cannot listen on 127.0.0.1:{port}"):
            Node(settings).start()
    # The worker's lock was released: the same worker starts at once.
    with InProcessServer(ServerSettings(), tmp_path) as server:
        assert server.raw_client().get_id("after") > 0


def test_an_unreachable_zookeeper_is_a_refusal_and_releases_the_port(tmp_path: Path) -> None:
    settings = ServerSettings(
        zookeeper=f"127.0.0.1:{free_port()}",
        zk_connect_timeout=0.5,
        state_dir=str(tmp_path),
        port=free_port(),
        # The admin endpoint listens before ZooKeeper is dialled: never on the default
        # 9990, which a server running on this machine holds.
        metrics_port=0,
        first_start_wait=0,
        host_lock_scope=unique_scope(),
    )
    with pytest.raises(StartupDeferred, match="cannot reach ZooKeeper"):
        Node(settings).start()
    with socket.socket() as again:
        again.bind(("127.0.0.1", settings.port))  # closed on the way out


@pytest.mark.zookeeper
def test_a_cluster_node_audits_every_id_and_deregisters_with_its_mark(
    zookeeper: ZooKeeper, zk: KazooClient, zk_path: str, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    settings = ServerSettings(
        zookeeper=zookeeper.hosts,
        zk_path=zk_path,
        worker_id=-1,  # auto
        skip_sanity_checks=True,
        audit_log=str(audit),
    )
    with InProcessServer(settings, tmp_path / "state") as server:
        ids = server.raw_client().get_ids("cluster", 50)
        status, body = server.http_get("/health")
        assert status == 200 and json.loads(body)["registered"] == f"{zk_path}/nodes/0/0"
        assert zk.exists(f"{zk_path}/nodes/0/0") is not None
    assert zk.exists(f"{zk_path}/nodes/0/0") is None, "deregistered at shutdown"
    mark = json.loads(zk.get(f"{zk_path}/marks/0/0")[0])["mark_ms"]
    assert mark == decompose(ids[-1]).timestamp_ms, "the exact final mark"
    written = [int(json.loads(line)["id"]) for line in audit.read_text().splitlines()]
    assert written == ids, "the cluster closed before the audit trail: every id written"


@pytest.mark.zookeeper
def test_a_zk_path_whose_acl_keeps_the_node_out_is_a_configuration_error(
    zookeeper: ZooKeeper, zk: KazooClient, zk_path: str, tmp_path: Path
) -> None:
    """It never passes by itself: exit 2, not 75 (it was "try again", and a class name)."""
    zk.create(zk_path, acl=[make_digest_acl("someone", "else", all=True)], makepath=True)
    settings = ServerSettings(
        zookeeper=zookeeper.hosts,
        zk_path=zk_path,
        worker_id=1,
        skip_sanity_checks=True,
        state_dir=str(tmp_path),
        port=free_port(),
        metrics_port=0,
        first_start_wait=0,
        host_lock_scope=unique_scope(),
    )
    with pytest.raises(ConfigurationError) as info:
        Node(settings).start()
    assert str(info.value) == (
        "ZooKeeper refused this node during start-up: ZooKeeper denied access: a znode's "
        f"ACL does not let this node in; give the znodes under --zk-path {zk_path} an ACL "
        "that lets it in"
    )


class SteppableClock:
    """The node's wall clock in ms: real time plus an offset the test steps."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def __call__(self) -> int:
        return time.time_ns() // 1_000_000 + self.offset_ms


@pytest.mark.zookeeper
def test_a_cluster_node_writes_the_new_clock_sequence_to_zookeeper_before_using_it(
    zookeeper: ZooKeeper, zk: KazooClient, zk_path: str, tmp_path: Path
) -> None:
    clock = SteppableClock()
    layout = Layout(datacenter_id_bits=3, clock_sequence_bits=2)
    settings = ServerSettings(
        zookeeper=zookeeper.hosts,
        zk_path=zk_path,
        worker_id=-1,  # auto
        skip_sanity_checks=True,
        datacenter_id_bits=3,
        clock_sequence_bits=2,
    )
    with InProcessServer(settings, tmp_path / "state", clock=clock) as server:
        client = server.raw_client()
        before = client.get_ids("cluster", 10)
        clock.offset_ms = -60_000
        after = client.get_ids("cluster", 10)
        assert {layout.decompose(i).clock_sequence for i in after} == {1}
        record = json.loads(zk.get(f"{zk_path}/marks/0/0")[0])
        newest = max(layout.decompose(i).timestamp_ms for i in after)
        assert record["clock_sequence"] == 1 and record["marks_ms"][1] >= newest
        assert record["marks_ms"][0] >= max(layout.decompose(i).timestamp_ms for i in before)
        status, body = server.http_get("/readyz")
        assert status == 200, body
    assert len(set(before + after)) == 20
    record = json.loads(zk.get(f"{zk_path}/marks/0/0")[0])
    assert record["marks_ms"][1] == newest, "the exact final mark of the value in use"
