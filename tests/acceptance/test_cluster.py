"""Cluster mode against a real ZooKeeper, with real server processes.

Every scenario runs under load from several clients and ends by counting
duplicate ids across the whole cluster: always zero.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from snowflake_thrift_client import NoServerAvailableError, SnowflakePool, ZooKeeperDiscovery
from snowflake_thrift_client._idl import snowflake_thrift

from snowflake_server import decompose
from snowflake_server._cli import main as cli_main
from tests.support.endpoints import Endpoints, free_port
from tests.support.fakes import SecondsClock
from tests.support.processes import (
    FakeTime,
    Load,
    ServerDidNotStart,
    ServerProcess,
    failures,
    parse_metrics,
    start_server,
)
from tests.support.waiting import wait_until
from tests.support.zookeeper import (
    KAZOO_TLS_SOCKETS,
    SECURITY,
    ZooKeeper,
    secured_zookeeper,
)

pytestmark = [
    pytest.mark.zookeeper,
    pytest.mark.slow,
    *map(pytest.mark.filterwarnings, KAZOO_TLS_SOCKETS),
]

thrift = snowflake_thrift()
SESSION = "3"  # seconds: short, so that expiry is quick to provoke; not so short that
# a missed heartbeat on a busy CI machine drops a healthy session


Start = Callable[..., ServerProcess]


@pytest.fixture(scope="module", params=SECURITY)
def security(request: pytest.FixtureRequest) -> str:
    """Every test of this module runs against a plain ZooKeeper and once more against a
    secured one: nodes log in by SASL and their znodes carry the service's ACL, over TLS
    with client certificates required. The test's own clients (playing operators and
    other nodes) log in as the service too."""
    return str(request.param)


@pytest.fixture(scope="module")
def zookeeper(security: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeper]:
    zk = secured_zookeeper(tmp_path_factory.mktemp("zk"), security)
    zk.start()
    yield zk
    zk.stop()


@pytest.fixture
def own_zk(security: str, tmp_path: Path) -> Iterator[ZooKeeper]:
    """A ZooKeeper this test may stop, restart or wipe."""
    zk = secured_zookeeper(tmp_path / "own-zk", security)
    zk.start()
    yield zk
    zk.stop()


@pytest.fixture
def cluster(zk_path: str) -> Iterator[Callable[..., Start]]:
    """``cluster(zk)(*flags)`` starts a node of a cluster on ``zk``; all are stopped after."""
    started: list[ServerProcess] = []

    def on(zk: ZooKeeper) -> Start:
        def start(*flags: str, **kwargs: object) -> ServerProcess:
            server = start_server(
                "--zookeeper", zk.hosts, "--zk-path", zk_path,
                "--zk-session-timeout", SESSION, "--zk-connect-timeout", "5",
                "--advertise-host", "127.0.0.1", *zk.access_flags(), *flags,
                **kwargs,  # type: ignore[arg-type]
            )  # fmt: skip
            started.append(server)
            return server

        return start

    yield on
    for server in started:
        if server.process.poll() is None:
            server.stop()


def serving(server: Endpoints) -> bool:
    return server.http_get("/health")[0] == 200


def metric(server: Endpoints, name: str) -> float:
    return parse_metrics(server.metrics())[name]


def test_three_auto_nodes_lease_distinct_ids(
    zookeeper: ZooKeeper, cluster: Callable[..., Start], zk_path: str
) -> None:
    start = cluster(zookeeper)
    nodes = [start("--worker-id", "auto") for _ in range(3)]
    workers = sorted(node.raw_client().get_worker_id() for node in nodes)
    assert workers == [0, 1, 2]
    zk = zookeeper.client()
    zk.start()
    try:
        registered = {
            worker: zk.get(f"{zk_path}/nodes/0/{worker}")[0].decode() for worker in workers
        }
        for worker in workers:  # secured: only the service may write them
            acl = zk.get_acls(f"{zk_path}/nodes/0/{worker}")[0]
            assert zookeeper.service is None or acl == zookeeper.service.acl(), acl
    finally:
        zk.stop()
        zk.close()
    assert sorted(registered.values()) == sorted(f"127.0.0.1:{n.port}" for n in nodes)
    with Load(nodes) as load:
        wait_until(lambda: load.count() > 20_000, "ids from all nodes", 30)
    assert load.duplicates() == 0 and not load.errors
    status, body = nodes[0].http_get("/health")
    assert status == 200 and json.loads(body)["registered"].startswith(f"{zk_path}/nodes/0/")
    assert metric(nodes[0], "snowflake_zookeeper_registered") == 1


def test_a_static_conflict_is_refused_naming_the_holder(
    zookeeper: ZooKeeper, cluster: Callable[..., Start]
) -> None:
    start = cluster(zookeeper)
    holder = start("--worker-id", "5")
    started = time.monotonic()
    with pytest.raises(ServerDidNotStart) as info:
        start("--worker-id", "5")
    assert time.monotonic() - started >= 2, "retried twice, 1 s apart"
    # Try again later: the holder may be a node that just crashed, its session alive.
    assert info.value.returncode == 75
    assert f"worker id 5 of datacenter 0 is registered by 127.0.0.1:{holder.port}" in info.value.log


def _fake_registration(zk: ZooKeeper, path: str, data: str) -> None:
    client = zk.client()
    client.start()
    try:
        client.create(path, data.encode(), makepath=True)
    finally:
        client.stop()
        client.close()


@pytest.mark.parametrize(
    ("in_cluster", "registered_as", "message"),
    [
        # A standalone node behind a registration that does not match it.
        (False, "0/7", "Worker id insanity: peer 127.0.0.1:{port} (registered as datacenter 0, "
                       "worker 7) says it is worker 5"),
        (False, "1/5", "Datacenter id insanity: peer 127.0.0.1:{port} (registered as "
                       "datacenter 1, worker 5) says it is in datacenter 0"),
        # A registered node (worker 5) with a second registration of its address that
        # claims an id it never answers as: not a node run with --processes.
        (True, "0/7", "Worker id insanity: peer 127.0.0.1:{port} (registered as datacenter 0, "
                      "worker 5, datacenter 0, worker 7) never answered as datacenter 0, "
                      "worker 7"),
    ],
)  # fmt: skip
def test_peer_id_insanity_refuses_start(
    zookeeper: ZooKeeper,
    cluster: Callable[..., Start],
    zk_path: str,
    in_cluster: bool,
    registered_as: str,
    message: str,
) -> None:
    start = cluster(zookeeper)
    peer = start("--worker-id", "5") if in_cluster else start_server("--worker-id", "5")
    try:
        _fake_registration(zookeeper, f"{zk_path}/nodes/{registered_as}", f"127.0.0.1:{peer.port}")
        with pytest.raises(ServerDidNotStart) as info:
            start("--worker-id", "6")
        assert info.value.returncode == 3
        assert message.format(port=peer.port) in info.value.log
    finally:
        if not in_cluster:
            assert peer.stop() == 0


def test_an_unreachable_peer_defers_start_unless_skipped(
    zookeeper: ZooKeeper, cluster: Callable[..., Start], zk_path: str
) -> None:
    start = cluster(zookeeper)
    dead = f"127.0.0.1:{free_port()}"
    _fake_registration(zookeeper, f"{zk_path}/nodes/0/9", dead)  # never expires
    with pytest.raises(ServerDidNotStart) as info:
        # A peer refusing connections is asked again for as long as a start may take:
        # --first-start-wait 0 + --max-startup-wait 1 + 5 s.
        start("--worker-id", "1", "--max-startup-wait", "1", timeout_s=30)
    # Issue 22, item 2: exit 75 (systemd restarts it), not 3 (systemd leaves it down).
    assert info.value.returncode == 75, info.value.log
    assert f"peer {dead} (registered as datacenter 0, worker 9) is unreachable" in info.value.log
    assert "it stayed registered and silent for the 6 s the peer checks wait" in info.value.log
    assert "--skip-sanity-checks" in info.value.log
    node = start("--worker-id", "1", "--skip-sanity-checks")
    assert node.raw_client().get_id("skip") > 0


def test_a_replacement_joins_as_soon_as_the_crashed_nodes_registration_expires(
    zookeeper: ZooKeeper, cluster: Callable[..., Start]
) -> None:
    """Issue 22, item 2: the replacement dialled the dead node's address until its
    bound (15 s here) although the registration expired after the session (3 s), then
    exited 3, which the systemd unit does not restart."""
    start = cluster(zookeeper)
    survivor, crashed = start("--worker-id", "auto"), start("--worker-id", "auto")
    assert crashed.raw_client().get_worker_id() == 1
    crashed.stop(signal.SIGKILL)
    started = time.monotonic()
    replacement = start("--worker-id", "auto", timeout_s=30)
    took = time.monotonic() - started
    log = replacement.log()
    assert f"peer 127.0.0.1:{crashed.port} (registered as datacenter 0, worker 1) does not " in log
    assert "is not registered any more: not a peer (a node gone, its session expired)" in log
    assert took < 15, f"joined {took:.1f} s after the crash"
    assert replacement.raw_client().get_worker_id() == 1, "the dead node's id, free again"
    with Load([survivor, replacement]) as load:
        wait_until(lambda: load.count() > 2000, "ids from both", 20)
    assert load.duplicates() == 0 and not load.errors


def test_a_clock_far_from_the_peers_refuses_start(
    zookeeper: ZooKeeper, cluster: Callable[..., Start], tmp_path: Path
) -> None:
    start = cluster(zookeeper)
    ahead = FakeTime(tmp_path)
    ahead.set("+30")
    start("--worker-id", "1", env=ahead.env)
    with pytest.raises(ServerDidNotStart) as info:
        start("--worker-id", "2")
    assert info.value.returncode == 75, "passes once the clocks are fixed"
    # 30 s behind, give or take the round trip of the peer's answer.
    assert re.search(
        r"our clock is (29|30)\d{3} ms behind the mean of 1 peers' clocks", (info.value.log)
    ), info.value.log
    start("--worker-id", "2", "--max-peer-skew", "40")  # within the allowed skew: starts


def test_unreachable_zookeeper_refuses_within_the_timeout() -> None:
    hosts = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ServerDidNotStart) as info:
        start_server("--zookeeper", hosts, "--zk-connect-timeout", "2", "--worker-id", "auto")
    assert time.monotonic() - started < 8
    assert info.value.returncode == 75
    assert f"cannot reach ZooKeeper at {hosts} within 2 s" in info.value.log


def test_sigterm_deletes_the_node_and_stores_the_exact_mark(
    zookeeper: ZooKeeper, cluster: Callable[..., Start], zk_path: str
) -> None:
    node = cluster(zookeeper)("--worker-id", "4")
    last = max(node.raw_client().get_ids("bye", 100))
    assert node.stop() == 0
    zk = zookeeper.client()
    zk.start()
    try:
        assert zk.exists(f"{zk_path}/nodes/0/4") is None, "deleted at once, not at expiry"
        mark = json.loads(zk.get(f"{zk_path}/marks/0/4")[0])["mark_ms"]
    finally:
        zk.stop()
        zk.close()
    assert mark == (last >> 22) + 1288834974657


def test_a_real_session_expiry_stops_ids_until_registered_again(
    zookeeper: ZooKeeper, cluster: Callable[..., Start]
) -> None:
    start = cluster(zookeeper)
    node, other = start("--worker-id", "3"), start("--worker-id", "auto")
    with Load([node, other]) as load:
        wait_until(lambda: load.count() > 2000, "load", 20)
        # Frozen past the session timeout: ZooKeeper itself expires the session.
        os.kill(node.process.pid, signal.SIGSTOP)
        time.sleep(float(SESSION) * 2.5)  # the thing under test: a real expiry, in real time
        os.kill(node.process.pid, signal.SIGCONT)
        registrations = "snowflake_zookeeper_registrations_total"
        wait_until(lambda: metric(node, registrations) == 2, "registering again", 20)
        wait_until(lambda: serving(node), "serving again", 10)
        before = load.count()
        wait_until(lambda: load.count() > before + 2000, "ids after registering again", 20)
    assert load.duplicates() == 0
    assert load.errors.get("UnavailableError", 0) >= 1, "refused while not registered"
    counts = parse_metrics(node.metrics())
    assert counts['snowflake_zookeeper_session_events_total{state="lost"}'] >= 1
    assert failures(counts, "unavailable") >= 1
    assert node.raw_client().get_worker_id() == 3, "a static id comes back"


def test_zookeeper_stopped_then_restarted(own_zk: ZooKeeper, cluster: Callable[..., Start]) -> None:
    start = cluster(own_zk)
    nodes = [start("--worker-id", "auto") for _ in range(2)]
    with Load(nodes) as load:
        wait_until(lambda: load.count() > 2000, "load", 20)
        own_zk.stop()
        # Without ZooKeeper a node serves only while its node is surely its own.
        # By the session gate (/readyz says 503 sooner: at the first failed mark write).
        wait_until(
            lambda: all(metric(n, "snowflake_serving") == 0 for n in nodes),
            "ids to stop",
            float(SESSION) + 5,
        )
        stopped = load.count()
        time.sleep(0.5)  # the thing under test: no ids during real time without ZooKeeper
        assert load.count() - stopped < 500, "nodes stop handing out ids"
        own_zk.start()
        wait_until(lambda: all(serving(n) for n in nodes), "serving again", 30)
        before = load.count()
        wait_until(lambda: load.count() > before + 2000, "ids after the restart", 20)
    assert load.duplicates() == 0
    assert metric(nodes[0], 'snowflake_zookeeper_session_events_total{state="suspended"}') >= 1


def test_a_zookeeper_that_comes_back_empty(
    own_zk: ZooKeeper, cluster: Callable[..., Start]
) -> None:
    start = cluster(own_zk)
    node = start("--worker-id", "7")
    with Load([node]) as load:
        wait_until(lambda: load.count() > 2000, "load", 20)
        own_zk.stop()
        own_zk.wipe()
        own_zk.start()
        # The old session is unknown to the new ZooKeeper: kazoo stays SUSPENDED;
        # the node must not serve on, and must register afresh.
        restarts = "snowflake_zookeeper_client_restarts_total"
        wait_until(lambda: metric(node, restarts) >= 1, "a new ZooKeeper client", 30)
        wait_until(lambda: serving(node), "serving again", 30)
        before = load.count()
        wait_until(lambda: load.count() > before + 2000, "ids after re-registering", 20)
    assert load.duplicates() == 0
    assert node.raw_client().get_worker_id() == 7


def test_a_recycled_worker_id_resumes_above_the_old_mark(
    zookeeper: ZooKeeper, cluster: Callable[..., Start], zk_path: str, tmp_path: Path
) -> None:
    start = cluster(zookeeper)
    first = start("--worker-id", "auto")
    assert first.raw_client().get_worker_id() == 0
    with Load([first]) as load:
        wait_until(lambda: load.count() > 5000, "load", 20)
    old_ids = list(load.ids)
    first.stop(signal.SIGKILL)  # dies holding id 0; its node expires with its session
    zk = zookeeper.client()
    zk.start()
    try:
        wait_until(lambda: zk.exists(f"{zk_path}/nodes/0/0") is None, "the session to expire", 20)
    finally:
        zk.stop()
        zk.close()
    # Another host (its own state dir), whose clock is 7 s behind, more than the
    # session takes to expire and the new node to start: without the mark kept in
    # ZooKeeper it would stamp ids with times the dead node already used.
    behind = FakeTime(tmp_path)
    behind.set("-7")
    second = start("--worker-id", "auto", env=behind.env, timeout_s=40)
    assert second.raw_client().get_worker_id() == 0, "the lowest free id: the dead node's"
    with Load([second]) as load:
        wait_until(lambda: load.count() > 5000, "load", 20)
    assert min(load.ids) > max(old_ids), "every id above every id of the previous holder"
    assert load.duplicates() == 0 and len(set(load.ids) & set(old_ids)) == 0
    # It waited for its clock to pass the dead node's mark: 7 s behind plus the mark's
    # 1 s ahead, less the time from the kill to this start (about 5 s; a busy machine
    # makes it longer, the wait shorter), within --max-startup-wait's 10 s.
    assert metric(second, "snowflake_startup_clock_wait_seconds") > 0.5


def test_clients_find_the_nodes_through_zookeeper(
    zookeeper: ZooKeeper, cluster: Callable[..., Start], zk_path: str
) -> None:
    start = cluster(zookeeper)
    nodes = [start("--worker-id", "auto") for _ in range(2)]
    with ZooKeeperDiscovery(zookeeper.hosts, zk_path, **zookeeper.discovery_options()) as discovery:
        assert sorted(discovery()) == sorted(f"127.0.0.1:{n.port}" for n in nodes)
        with SnowflakePool(
            discovery, agent="discovered", refresh_interval=0.2, pool_size=4
        ) as pool:
            ids = [i for _ in range(50) for i in pool.next_ids(10)]
            nodes[0].stop()  # deletes its registration; the pool drops it and fails over
            wait_until(lambda: len(discovery()) == 1, "the registration to go", 10)
            ids += [i for _ in range(50) for i in pool.next_ids(10)]
    assert len(set(ids)) == len(ids) == 1000
    assert {decompose(i).worker_id for i in ids[-100:]} == {1}


def test_snowflake_get_through_zookeeper(
    zookeeper: ZooKeeper,
    cluster: Callable[..., Start],
    zk_path: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    node = cluster(zookeeper)("--worker-id", "9")
    args = ["get", "--zookeeper", zookeeper.hosts, "--zk-path", zk_path, "--count", "3",
            *zookeeper.access_flags()]  # fmt: skip
    assert cli_main(args) == 0
    ids = [int(line) for line in capsys.readouterr().out.split()]
    assert len(ids) == 3 and {decompose(i).worker_id for i in ids} == {9}
    assert node.raw_client().get_worker_id() == 9


def test_out_of_worker_ids_is_a_clear_refusal(
    zookeeper: ZooKeeper, cluster: Callable[..., Start]
) -> None:
    start = cluster(zookeeper)
    narrow = ("--worker-id", "auto", "--worker-id-bits", "1", "--datacenter-id-bits", "9")
    held = sorted(start(*narrow).raw_client().get_worker_id() for _ in range(2))
    assert held == [0, 1]
    with pytest.raises(ServerDidNotStart) as info:
        start(*narrow)
    assert info.value.returncode == 75, "it may pass: a crashed node's id is freed"
    assert "all 2 worker ids of datacenter 0 are leased" in info.value.log


def test_processes_lease_their_own_ids(
    zookeeper: ZooKeeper, cluster: Callable[..., Start], zk_path: str
) -> None:
    node = cluster(zookeeper)("--worker-id", "auto", "--processes", "2")
    counts = parse_metrics(node.metrics())
    assert {
        counts['snowflake_worker_id{process="0"}'],
        counts['snowflake_worker_id{process="1"}'],
    } == {
        0.0,
        1.0,
    }
    with Load([node], per_server=4) as load:
        wait_until(lambda: load.count() > 5000, "load", 20)
    assert load.duplicates() == 0
    # 40 new connections: the kernel spreads them over both processes.
    assert {decompose(node.raw_client().get_id("spread")).worker_id for _ in range(40)} == {0, 1}
    assert node.stop() == 0
    zk = zookeeper.client()
    zk.start()
    try:
        assert zk.get_children(f"{zk_path}/nodes/0") == [], "both registrations deleted"
    finally:
        zk.stop()
        zk.close()


def test_discovery_gives_up_within_its_timeout_when_zookeeper_goes(
    own_zk: ZooKeeper, cluster: Callable[..., Start], capsys: pytest.CaptureFixture[str]
) -> None:
    node = cluster(own_zk)("--worker-id", "2")
    discovery = ZooKeeperDiscovery(
        own_zk.hosts, node_zk_path(node), timeout=1.0, **own_zk.discovery_options()
    )
    clock = SecondsClock()
    pool = SnowflakePool(discovery, refresh_interval=0.1, timeout=1.0, clock=clock)
    with discovery, pool:
        assert pool.next_id() > 0
        own_zk.stop()
        clock.advance(0.2)  # past refresh_interval: the next call asks ZooKeeper again
        started = time.monotonic()
        # Served from the last list, or refused by the node now unsure of its id.
        with contextlib.suppress(NoServerAvailableError):
            pool.next_id()
        assert time.monotonic() - started < 8, "no call waits for ZooKeeper to come back"
    assert (
        cli_main(["get", "--zookeeper", own_zk.hosts, "--timeout", "1", *own_zk.access_flags()])
        == 1
    )
    assert "snowflake get: server discovery failed" in capsys.readouterr().err


def node_zk_path(node: ServerProcess) -> str:
    """The --zk-path a node of the `cluster` fixture was started with."""
    args = node.process.args
    assert isinstance(args, list)
    return str(args[args.index("--zk-path") + 1])


def test_a_node_that_lost_its_id_cannot_touch_the_new_holders_mark(
    zookeeper: ZooKeeper, cluster: Callable[..., Start], zk_path: str, tmp_path: Path
) -> None:
    start = cluster(zookeeper)
    flags = ("--worker-id", "5", "--skip-sanity-checks")
    old = start(*flags)
    assert old.raw_client().get_id("old") > 0
    zk = zookeeper.client()
    zk.start()
    try:
        # Frozen past its session: ZooKeeper expires it and another node takes id 5.
        os.kill(old.process.pid, signal.SIGSTOP)
        wait_until(lambda: zk.exists(f"{zk_path}/nodes/0/5") is None, "the expiry", 20)
        new = start(*flags)
        with Load([new]) as load:
            wait_until(lambda: load.count() > 2000, "load on the new holder", 20)
            os.kill(old.process.pid, signal.SIGCONT)  # it wakes up with a stale worker
            deadline = time.monotonic() + float(SESSION) * 3
            while time.monotonic() < deadline:
                mark = json.loads(zk.get(f"{zk_path}/marks/0/5")[0])["mark_ms"]
                issued = load.ids[-1] if load.ids else 0
                assert mark >= decompose(issued).timestamp_ms, "the mark never drops below ids"
                time.sleep(0.005)  # sampling the mark through a real window of time
        new_ids = list(load.ids)
        new.stop(signal.SIGKILL)
        old.stop(signal.SIGKILL)
        wait_until(lambda: zk.exists(f"{zk_path}/nodes/0/5") is None, "the expiry", 20)
    finally:
        zk.stop()
        zk.close()
    behind = FakeTime(tmp_path)
    behind.set("-4")  # a replacement host whose clock is behind
    third = start(*flags, env=behind.env, timeout_s=40)
    with Load([third]) as load:
        wait_until(lambda: load.count() > 2000, "load on the third holder", 20)
    assert not set(load.ids) & set(new_ids), "no id of the previous holder is repeated"
    assert min(load.ids) > max(new_ids)


# -- issue 16: one layout per cluster; start-up bounded by --zk-connect-timeout --------

DEFAULT = "epoch 1288834974657 ms, bits 41/5/5/12 (timestamp/datacenter/worker/sequence)"
NARROW = "epoch 1288834974657 ms, bits 41/5/4/13 (timestamp/datacenter/worker/sequence)"


@pytest.mark.parametrize("checks", ["peer-checks", "skip-sanity-checks", "layout-znode-deleted"])
def test_a_node_of_another_layout_is_refused(
    zookeeper: ZooKeeper, cluster: Callable[..., Start], zk_path: str, checks: str
) -> None:
    """Worker 2 on 5/5/12 and worker 1 on 5/4/13 both started and issued the same ids.
    Refused by the peer checks (get_layout), and without them by the layout znode; with
    the znode deleted (issue 22, item 5), by the layout of the marks."""
    start = cluster(zookeeper)
    first = start("--worker-id", "2")
    skip = ["--skip-sanity-checks"] if checks != "peer-checks" else []
    recorded = [f"{zk_path}/layout"]
    if checks == "layout-znode-deleted":
        zk = zookeeper.client()
        zk.start()
        try:
            zk.delete(f"{zk_path}/layout")
        finally:
            zk.stop()
            zk.close()
        # From the marks; or, if worker 2's next tick came first, from the record it wrote
        # back as it last read it (its own layout): refused by the cluster's layout either way.
        recorded = [f"{zk_path}/layout, recorded from its marks", f"{zk_path}/layout"]
    with pytest.raises(ServerDidNotStart) as info:
        start("--worker-id", "1", "--worker-id-bits", "4", "--sequence-bits", "13", *skip)
    assert info.value.returncode == 3, info.value.log
    if skip:
        expected = [f"Layout insanity: this node would make ids with {NARROW}, but the cluster "
                    f"({where}) makes them with {DEFAULT}" for where in recorded]  # fmt: skip
    else:
        expected = [f"Layout insanity: peer 127.0.0.1:{first.port} (registered as datacenter 0, "
                    f"worker 2) makes ids with {DEFAULT}, this node would make them with "
                    f"{NARROW}"]  # fmt: skip
    assert any(each in info.value.log for each in expected), info.value.log
    assert first.raw_client().get_id("still") > 0


class FreezingProxy:
    """A TCP proxy to ``target`` that freezes ZooKeeper (SIGSTOP: it neither answers
    nor closes connections) the moment a connection reaches it, then forwards."""

    def __init__(self, target: int, zk: ZooKeeper) -> None:
        assert zk.pid is not None
        self._zk_pid = zk.pid
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.frozen_at: float | None = None
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                incoming, _ = self._listener.accept()
                if self.frozen_at is None:
                    os.kill(self._zk_pid, signal.SIGSTOP)
                    self.frozen_at = time.monotonic()
                outgoing = socket.create_connection(("127.0.0.1", self._target))
                self._sockets += [incoming, outgoing]
                for a, b in ((incoming, outgoing), (outgoing, incoming)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)

    def thaw(self) -> None:
        if self.frozen_at is not None:
            os.kill(self._zk_pid, signal.SIGCONT)
        for s in self._sockets:
            s.close()


def test_a_zookeeper_that_vanishes_during_start_up_is_refused_within_the_connect_timeout(
    own_zk: ZooKeeper, cluster: Callable[..., Start], zk_path: str
) -> None:
    """Issue 16, item 8: refused after 34 s instead of --zk-connect-timeout. ZooKeeper
    freezes while the node asks its peer, after it read the registrations and before
    it registers."""
    peer = start_server("--worker-id", "5")
    proxy = FreezingProxy(peer.port, own_zk)
    try:
        _fake_registration(own_zk, f"{zk_path}/nodes/0/5", f"127.0.0.1:{proxy.port}")
        with pytest.raises(ServerDidNotStart) as info:
            cluster(own_zk)("--worker-id", "6", "--zk-connect-timeout", "2", timeout_s=60)
        assert proxy.frozen_at is not None, info.value.log
        took = time.monotonic() - proxy.frozen_at
    finally:
        proxy.thaw()
        assert peer.stop() == 0
    assert info.value.returncode == 75, info.value.log
    assert "ZooKeeper did not answer within 2 s (--zk-connect-timeout) while" in info.value.log
    assert took < 2 + 4, f"refused {took:.1f} s after ZooKeeper froze"


# -- faults an adversarial review found (issue 15) ---------------------------------


def test_a_node_on_an_id_zookeeper_forgot_does_not_repeat_its_holders_ids(
    own_zk: ZooKeeper, cluster: Callable[..., Start], tmp_path: Path
) -> None:
    # Seen: ZooKeeper came back empty; B, whose clock is behind A's, leased A's worker
    # id before A registered again, and both handed out the same ids (6,600 of them).
    start = cluster(own_zk)
    # A's longer session keeps it away for 20 s (its client is replaced only after it):
    # B, started as soon as ZooKeeper is back, leases worker 0 first.
    a = start("--worker-id", "auto", "--zk-session-timeout", "20")
    assert a.raw_client().get_worker_id() == 0
    behind = FakeTime(tmp_path)
    behind.set("-12")  # within B's --max-peer-skew
    with Load([a]) as load_a:
        # A serves for longer than B's clock is behind: B's ids would fall among A's.
        first = decompose(a.raw_client().get_id("first")).timestamp_ms
        wait_until(
            lambda: decompose(a.raw_client().get_id("last")).timestamp_ms - first > 13_000,
            "A serving for 13 s",
            40,
        )
        own_zk.stop()
        own_zk.wipe()
        own_zk.start()
        # No --first-start-wait: the default, the session timeout + --max-peer-skew.
        b = start(
            "--worker-id", "auto", "--zk-session-timeout", "3", "--max-peer-skew", "15",
            env=behind.env, first_start_wait=None, timeout_s=60,
        )  # fmt: skip
        with Load([b]) as load_b:
            wait_until(lambda: load_b.count() > 5000, "ids from B", 30)
    from_a, from_b = set(load_a.ids), set(load_b.ids)
    repeated = from_a & from_b
    print(
        f"ZK-DATA-LOSS ids from A {len(from_a)}, from B {len(from_b)}, repeated {len(repeated)}, "
        f"errors A {load_a.errors} B {load_b.errors}"
    )
    assert not repeated
    assert b.raw_client().get_worker_id() == 0, "B leased A's id while A was away"
    assert "no high-water mark of worker id 0 in ZooKeeper" in b.log()
    # A comes back on another id. It put its marks back first unless B's were higher
    # already (B's clock is behind, but it waited): the log says which.
    wait_until(lambda: "registered again as worker 1" in a.log(), "A registered again", 45)
    assert a.raw_client().get_worker_id() == 1
    assert len(load_a.ids) == len(from_a) and len(load_b.ids) == len(from_b)
    newest_a = max(decompose(i).timestamp_ms for i in from_a if decompose(i).worker_id == 0)
    oldest_b = min(decompose(i).timestamp_ms for i in from_b)
    assert oldest_b > newest_a, "B's ids of worker 0 come after A's"


def test_auto_passes_over_an_id_that_a_clock_far_ahead_used(
    zookeeper: ZooKeeper, cluster: Callable[..., Start], tmp_path: Path
) -> None:
    # Seen: a node's clock stepped an hour ahead and back; the mark of its worker id
    # stayed an hour ahead and every new auto node refused to start (exit 3).
    start = cluster(zookeeper)
    ahead = FakeTime(tmp_path)
    ahead.set("+3600")
    jumped = start("--worker-id", "auto", env=ahead.env)
    assert jumped.raw_client().get_worker_id() == 0
    jumped.raw_client().get_id("ahead")
    assert jumped.stop() == 0  # its final mark, an hour ahead, stays in ZooKeeper
    node = start("--worker-id", "auto")
    assert node.raw_client().get_worker_id() == 1
    assert "skipping worker id 0: its high-water mark in zookeeper:" in node.log()
    counts = parse_metrics(node.metrics())
    assert counts['snowflake_zookeeper_worker_ids_skipped_total{reason="mark_ahead"}'] == 1
    assert decompose(node.raw_client().get_id("after")).worker_id == 1
