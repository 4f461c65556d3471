"""Cluster membership in this process, against a real ZooKeeper.

Session states are driven as kazoo's own test harness drives them (a forced
session expiry, a dropped connection) or by stopping ZooKeeper; the session
gate runs on a fake clock the tests move; the supervision thread's checks
(``tick``) are called by the tests, so nothing waits for time to pass.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient, KazooState
from kazoo.protocol.connection import _CONNECTION_DROP, _SESSION_EXPIRED
from kazoo.security import make_acl, make_digest_acl

from snowflake_server import (
    Layout,
    ServerSettings,
    StartupRefused,
    UnavailableError,
    decompose,
)
from snowflake_server._cluster.gate import SessionGate
from snowflake_server._cluster.layout_record import LayoutRecord, Stage
from snowflake_server._cluster.membership import Cluster, advertised_address
from snowflake_server._cluster.slot import WorkerSlot
from snowflake_server._cluster.zkmarks import ZkMarkStore
from snowflake_server._errors import ClockBehindMark, StartupDeferred, StartupInterrupted
from snowflake_server._ids.layouts import layout_to_json
from snowflake_server._native import native_core
from snowflake_server._state.reservation import MarkStore
from snowflake_server._state.worker import Worker
from tests.support.endpoints import free_port, unique_scope
from tests.support.fakes import FakeClock, SecondsClock
from tests.support.waiting import run_in_thread, wait_until
from tests.support.zookeeper import ZooKeeper

pytestmark = pytest.mark.zookeeper

T0 = 1_700_000_000_000  # the ids' clock (fake), in whole seconds
SESSION = 4.0  # s: --zk-session-timeout
OPEN_FOR = 0.9 * SESSION  # how long a heartbeat lets the node serve
UNREACHABLE = "ZooKeeper unreachable for longer than the session allows"


# -- fakes and observers --------------------------------------------------------


class States:
    """The session states a client entered, awaited without sleeping."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._from = 0
        self._changed = threading.Condition()

    def saw(self, state: str) -> None:
        with self._changed:
            self.seen.append(state)
            self._changed.notify_all()

    def wait_for(self, *expected: str, timeout_s: float = 10.0) -> None:
        """Until ``expected`` were entered in this order (since the last wait)."""

        def found() -> bool:
            rest = iter(self.seen[self._from :])
            return all(any(state == want for state in rest) for want in expected)

        with self._changed:
            assert self._changed.wait_for(found, timeout_s), (
                f"expected {expected}, saw {self.seen[self._from :]}"
            )
            self._from = len(self.seen)


class WatchedClient(KazooClient):  # type: ignore[misc]
    """A real kazoo client that tells the test each state it enters, once every
    listener (the cluster's among them) has been told: kazoo keeps its listeners
    in a set, so a listener of the test's own could run before the cluster's."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.states = States()

    def _make_state_change(self, state: str) -> None:
        changed = state != self.state
        super()._make_state_change(state)
        if changed:
            self.states.saw(state)


class LogEvents(logging.Handler):
    """Log messages of the cluster, awaited from the supervision thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self._logged = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._logged:
            self.messages.append(record.getMessage())
            self._logged.notify_all()

    def wait_for(self, text: str, timeout_s: float = 10.0) -> str:
        def match() -> str | None:
            return next((m for m in self.messages if text in m), None)

        with self._logged:
            found = self._logged.wait_for(match, timeout_s)
        assert found, f"no log message with {text!r} in {timeout_s:g} s: {self.messages}"
        return found


@dataclass
class Member:
    """One cluster node in this process: its ``Cluster``, slot and fakes."""

    cluster: Cluster
    slot: WorkerSlot
    gate: SecondsClock
    clock: FakeClock
    address: str
    clients: list[WatchedClient] = field(default_factory=list)
    sleeps: list[float] = field(default_factory=list)

    @property
    def client(self) -> WatchedClient:
        """The client made last (the cluster's, unless it failed to connect)."""
        return self.clients[-1]

    @property
    def worker_id(self) -> int | None:
        worker = self.slot.worker
        return None if worker is None else worker.worker_id

    def join(self) -> Member:
        """What the node does once its port is bound: connect and register (the peer
        checks have tests of their own; the addresses here do not answer)."""
        self.cluster.connect()
        self.cluster.register()
        return self

    def tick(self) -> None:
        """One check of the supervision thread."""
        self.cluster.tick()


Make = Callable[..., Member]
OwnZooKeeper = Callable[..., ZooKeeper]


# -- fixtures -------------------------------------------------------------------


@pytest.fixture
def member(zookeeper: ZooKeeper, zk_path: str, tmp_path: Path) -> Iterator[Make]:
    """``member(**settings)``: a node built as ``clustered()`` builds one, each with
    its own state directory (its own host); all closed after the test."""
    made: list[Member] = []

    def make(
        *,
        hosts: str | None = None,
        supervise_every: float = 3600.0,
        clock_ms: int = T0,
        on_sleep: Callable[[float], object] | None = None,
        stop_ends_waits: bool = False,
        after_open: Callable[[], object] | None = None,
        **overrides: Any,
    ) -> Member:
        defaults: dict[str, Any] = {
            "zookeeper": hosts or zookeeper.hosts,
            "zk_path": zk_path,
            "state_dir": str(tmp_path / f"host{len(made)}"),
            "zk_session_timeout": SESSION,
            "zk_connect_timeout": 5.0,
            "first_start_wait": 0.0,  # the marks in ZooKeeper are under test here
            "host_lock_scope": unique_scope(),  # its own host, as its own state dir
        }
        settings = ServerSettings(**{**defaults, **overrides})
        gate, clock = SecondsClock(), FakeClock(clock_ms)
        slot = WorkerSlot(settings.ids, SessionGate(gate))

        def open_worker(
            worker_id: int,
            remote: tuple[MarkStore, int],
            waited: float | None,
            *,
            before_first_write: Callable[[], None] | None = None,
        ) -> Worker:
            worker = Worker.open(
                settings.worker, worker_id, clock=clock, sleep=clock.sleep, remote=remote,
                first_start_waited=waited, before_first_write=before_first_write,
            )  # fmt: skip
            if after_open is not None:
                after_open()  # what happens on other threads once the worker is open
            return worker

        clients: list[WatchedClient] = []
        sleeps: list[float] = []

        def sleep(seconds: float) -> None:
            sleeps.append(seconds)
            if on_sleep is not None:
                on_sleep(seconds)  # what happens elsewhere meanwhile

        def client_factory(**kwargs: Any) -> WatchedClient:
            client = WatchedClient(**kwargs)
            clients.append(client)
            return client

        address = f"127.0.0.1:{free_port()}"
        cluster = Cluster(
            settings.cluster,
            slot,
            clock,
            address,
            open_worker=open_worker,
            client_factory=client_factory,
            gate_clock=gate,
            sleep=None if stop_ends_waits else sleep,
            supervise_every=supervise_every,
        )
        node = Member(cluster, slot, gate, clock, address, clients, sleeps)
        made.append(node)
        return node

    yield make
    for node in made:
        node.cluster.close()
        for client in node.clients:
            client.stop()
            client.close()


@pytest.fixture
def own_zookeeper(tmp_path: Path) -> Iterator[OwnZooKeeper]:
    """``own_zookeeper(**options)``: a started ZooKeeper of the test's own, to stop, wipe
    and start again (the shared one stays up for the other tests); stopped after it.
    Ask for it after ``member``, so that it stops before the nodes are closed."""
    started: list[ZooKeeper] = []

    def make(**options: Any) -> ZooKeeper:
        own = ZooKeeper(tmp_path / "zk", **options)
        own.start()
        started.append(own)
        return own

    yield make
    for own in started:
        own.stop()


# -- helpers --------------------------------------------------------------------


def hold(zk: KazooClient, path: str, address: str = "10.0.0.9:7609") -> None:
    """Register ``path`` as another node's (ephemeral, in ``zk``'s session)."""
    zk.create(path, address.encode(), ephemeral=True, makepath=True)


def owner(zk: KazooClient, path: str) -> int | None:
    stat = zk.exists(path)
    return None if stat is None else int(stat.ephemeralOwner)


def session_of(node: Member) -> int:
    return int(node.client.client_id[0])


def mark(zk: KazooClient, path: str) -> int:
    value = json.loads(zk.get(path)[0].decode())
    return int(value if isinstance(value, int) else value["mark_ms"])


def end_session(zookeeper: ZooKeeper, client_id: tuple[int, bytes]) -> None:
    """What ZooKeeper does once a session left behind times out, done now: open
    that session from another client, then close it (its nodes go with it)."""
    twin = KazooClient(hosts=zookeeper.hosts, client_id=client_id, timeout=SESSION)
    twin.start(timeout=10)
    twin.stop()
    twin.close()


def expire(node: Member) -> tuple[int, bytes]:
    """Expire the node's session as kazoo's test harness does (LOST, then a new
    session); returns the old session, which ZooKeeper keeps until it times out."""
    old: tuple[int, bytes] = node.client.client_id
    node.client._call(_SESSION_EXPIRED, None)
    node.client.states.wait_for(KazooState.LOST, KazooState.CONNECTED)
    return old


def samples(cluster: Cluster) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in cluster.collect():
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def events(cluster: Cluster) -> dict[str, float]:
    counts = samples(cluster)
    return {
        state: counts[f'snowflake_zookeeper_session_events_total{{state="{state}"}}']
        for state in ("connected", "suspended", "lost")
    }


@pytest.fixture
def log_events() -> Iterator[LogEvents]:
    handler = LogEvents()
    logger = logging.getLogger("snowflake_server._cluster")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


# -- registration ---------------------------------------------------------------


def test_a_static_id_is_registered_and_served(member: Make, zk: KazooClient, zk_path: str) -> None:
    node = member(worker_id=3)
    node.cluster.connect()
    node.cluster.check_peers()  # nobody registered yet
    node.cluster.register()
    path = f"{zk_path}/nodes/0/3"
    data, stat = zk.get(path)
    assert data.decode() == node.address
    assert stat.ephemeralOwner == session_of(node)
    assert mark(zk, f"{zk_path}/marks/0/3") == T0 + 2000, "reserved ahead in ZooKeeper too"
    assert node.slot.serving and node.slot.gate.open_until == node.gate.now + OPEN_FOR
    assert decompose(node.slot.next_id()).worker_id == 3
    assert node.sleeps == [] and node.cluster.registrations == 1
    assert node.cluster.details() == {
        "zookeeper": "CONNECTED",
        "registered": path,
        "session_timeout_s": SESSION,
    }
    assert node.slot.unavailable_reason() is None
    counts = samples(node.cluster)
    assert counts["snowflake_zookeeper_registered"] == 1
    assert counts["snowflake_serving"] == 1
    assert counts["snowflake_zookeeper_last_contact_age_seconds"] == 0
    assert counts["snowflake_zookeeper_registrations_total"] == 1
    assert counts["snowflake_zookeeper_client_restarts_total"] == 0
    assert events(node.cluster) == {"connected": 1, "suspended": 0, "lost": 0}


def test_free_worker_ids_are_counted_from_the_registrations_read_every_30_s(
    member: Make,
    zk: KazooClient,
    zk_path: str,
    log_events: LogEvents,
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = member(worker_id=-1)
    worker_ids = node.slot.settings.layout.max_worker_id + 1
    # Registrations at our own address (sibling processes) are read but never dialled.
    hold(zk, f"{zk_path}/nodes/0/0", node.address)
    hold(zk, f"{zk_path}/nodes/0/1", node.address)
    hold(zk, f"{zk_path}/nodes/1/2", node.address)  # another datacenter's: not ours
    node.cluster.connect()
    assert "snowflake_zookeeper_free_worker_ids" not in samples(node.cluster)  # nothing read yet
    node.cluster.check_peers()
    assert samples(node.cluster)["snowflake_zookeeper_free_worker_ids"] == worker_ids - 2
    node.cluster.register()
    assert node.worker_id == 2
    assert samples(node.cluster)["snowflake_zookeeper_free_worker_ids"] == worker_ids - 3
    # Counted from what was read, not read again at each scrape nor at each tick...
    zk.delete(f"{zk_path}/nodes/0/0")
    zk.delete(f"{zk_path}/nodes/0/1")
    hold(zk, f"{zk_path}/nodes/0/²", node.address)  # a name int() would refuse: ignored
    node.gate.advance(29.0)
    node.tick()
    assert samples(node.cluster)["snowflake_zookeeper_free_worker_ids"] == worker_ids - 3
    # ...but every 30 s: asked for after a heartbeat, taken at a later tick (never waited
    # for on the supervision thread). Two nodes left.
    node.gate.advance(1.0)

    def counted() -> object:
        node.tick()
        return samples(node.cluster)["snowflake_zookeeper_free_worker_ids"] == worker_ids - 1

    wait_until(counted, "the registrations read again")
    # A read that fails (here refused: nobody may list nodes/0 any more) leaves the last
    # count standing and costs the supervision nothing: it keeps registered and serving.
    hold(zk, f"{zk_path}/nodes/0/7", node.address)  # not seen: the read is refused
    zk.set_acls(f"{zk_path}/nodes/0", [make_digest_acl("someone", "else", all=True)])
    caplog.set_level(logging.DEBUG, logger="snowflake_server._cluster.membership")
    node.gate.advance(30.0)
    node.tick()  # asks

    def refused() -> object:
        node.tick()  # takes the answer once it is there
        return any(m.startswith("free worker ids: ") for m in log_events.messages)

    wait_until(refused, "the refused read taken")
    assert samples(node.cluster)["snowflake_zookeeper_free_worker_ids"] == worker_ids - 1
    assert node.slot.serving


def test_no_free_worker_ids_gauge_without_the_peer_checks(member: Make) -> None:
    node = member(worker_id=3, skip_sanity_checks=True)
    node.cluster.connect()
    node.cluster.check_peers()  # --skip-sanity-checks: nothing listed
    node.cluster.register()
    assert "snowflake_zookeeper_free_worker_ids" not in samples(node.cluster)


def test_auto_takes_the_lowest_free_id(member: Make, zk: KazooClient, zk_path: str) -> None:
    hold(zk, f"{zk_path}/nodes/0/0")
    hold(zk, f"{zk_path}/nodes/0/2")
    first = member(worker_id=-1).join()
    second = member(worker_id=-1).join()
    assert (first.worker_id, second.worker_id) == (1, 3)
    assert decompose(second.slot.next_id()).worker_id == 3
    assert zk.get(f"{zk_path}/nodes/0/1")[0].decode() == first.address


def test_a_held_static_id_is_refused_after_two_retries(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    hold(zk, f"{zk_path}/nodes/0/5", "10.0.0.9:7609")
    node = member(worker_id=5)
    with pytest.raises(StartupDeferred) as info:
        node.join()
    assert str(info.value).startswith(
        f"worker id 5 of datacenter 0 is registered by 10.0.0.9:7609 ({zk_path}/nodes/0/5); "
        "two nodes with one worker id would hand out the same ids"
    )
    assert node.sleeps == [1.0, 1.0], "Twitter's two retries, 1 s apart (our own ghost?)"
    assert not node.slot.serving and node.worker_id is None


def test_a_holder_we_may_not_read_is_named_another_node(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    zk.ensure_path(f"{zk_path}/nodes/0")
    secret = [make_digest_acl("someone", "else", all=True)]
    zk.create(f"{zk_path}/nodes/0/5", b"10.0.0.9:7609", acl=secret, ephemeral=True)
    with pytest.raises(StartupDeferred, match="is registered by another node"):
        member(worker_id=5).join()


def test_our_own_node_from_a_create_whose_reply_was_lost_counts_as_taken(
    member: Make, zk_path: str
) -> None:
    node = member(worker_id=4)
    node.cluster.connect()
    # The create reached ZooKeeper but its reply did not reach us: the retry finds it.
    node.client.create(f"{zk_path}/nodes/0/4", b"", ephemeral=True, makepath=True)
    node.cluster.register()
    assert node.worker_id == 4 and node.slot.serving and node.sleeps == []


def test_a_mark_that_is_not_a_number_refuses_and_leaves_no_node(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    zk.create(f"{zk_path}/marks/0/3", b"garbage", makepath=True)
    node = member(worker_id=3)
    with pytest.raises(StartupRefused, match="is not a number"):
        node.join()
    assert zk.exists(f"{zk_path}/nodes/0/3") is None, "the registration was taken back"
    assert not node.slot.serving


def test_unreachable_zookeeper_is_refused_within_the_connect_timeout(member: Make) -> None:
    hosts = f"127.0.0.1:{free_port()}"
    node = member(hosts=hosts, zk_connect_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(StartupDeferred) as info:
        node.cluster.connect()
    assert time.monotonic() - started < 5
    assert str(info.value).startswith(
        f"cannot reach ZooKeeper at {hosts} within 0.5 s (--zk-connect-timeout)"
    )
    assert node.cluster.client is None and not node.client.connected, "stopped, not left trying"
    assert node.cluster.details() == {
        "zookeeper": "NONE",
        "registered": None,
        "session_timeout_s": SESSION,
    }
    assert node.slot.unavailable_reason() == "this node is not handing out ids: not registered yet"
    counts = samples(node.cluster)
    assert counts["snowflake_zookeeper_registered"] == 0
    assert counts["snowflake_zookeeper_last_contact_age_seconds"] == float("inf")
    node.cluster.close()  # nothing to close


def test_the_advertised_address() -> None:
    def address(bound_port: int, **overrides: Any) -> str:
        settings = ServerSettings(zookeeper="127.0.0.1:2181", **overrides)
        return advertised_address(settings.cluster, bound_port)

    assert address(7609) == "127.0.0.1:7609"
    assert address(7609, advertise_host="ids.example", advertise_port=443) == "ids.example:443"
    assert address(7000, host="0.0.0.0") == f"{socket.getfqdn()}:7000"


# -- keeping it safe ------------------------------------------------------------


def test_the_gate_closes_without_a_heartbeat_and_opens_with_one(member: Make) -> None:
    node = member(worker_id=2).join()
    node.gate.advance(OPEN_FOR)
    assert node.slot.serving, "up to the deadline"
    node.gate.advance(0.001)
    assert not node.slot.serving
    with pytest.raises(UnavailableError, match=UNREACHABLE):
        node.slot.next_id()
    assert node.slot.unavailable_reason() == f"this node is not handing out ids: {UNREACHABLE}"
    counts = samples(node.cluster)
    assert counts["snowflake_serving"] == 0
    assert counts["snowflake_zookeeper_registered"] == 1, "still registered, just not proven"
    assert counts["snowflake_zookeeper_last_contact_age_seconds"] == pytest.approx(OPEN_FOR + 0.001)
    node.tick()  # a heartbeat: ZooKeeper confirms the node is ours
    assert node.slot.serving and node.slot.gate.open_until == node.gate.now + OPEN_FOR
    assert samples(node.cluster)["snowflake_zookeeper_last_contact_age_seconds"] == 0


def test_a_lost_session_stops_ids_at_once_and_the_id_is_registered_again(
    member: Make, zookeeper: ZooKeeper, zk: KazooClient, zk_path: str
) -> None:
    node = member(worker_id=3).join()
    path = f"{zk_path}/nodes/0/3"
    old = expire(node)
    assert not node.slot.serving, "at once, however long the gate had left"
    with pytest.raises(UnavailableError, match="the ZooKeeper session was lost; registering"):
        node.slot.next_id()
    # ZooKeeper keeps the old session, and our node, until the session times out.
    assert owner(zk, path) == old[0] != session_of(node)
    with pytest.raises(StartupDeferred, match=re.escape(f"registered by {node.address}")):
        node.tick()
    assert node.worker_id is None, "the old worker was retired and closed"
    assert node.sleeps == [], "no retries once serving: the next tick tries again"
    end_session(zookeeper, old)
    node.tick()
    assert node.worker_id == 3 and node.slot.serving
    assert owner(zk, path) == session_of(node)
    # The old worker could not write its final mark (its session was gone): the
    # reserved one stood, and the new worker waited for the clock to pass it.
    assert sum(node.clock.sleeps) > 1.9
    assert decompose(node.slot.next_id()).timestamp_ms > T0 + 2000
    assert node.cluster.registrations == 2
    assert events(node.cluster) == {"connected": 2, "suspended": 0, "lost": 1}


def test_after_a_lost_session_auto_takes_another_id_while_its_old_node_lingers(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    node = member(worker_id=-1).join()
    assert node.worker_id == 0
    old = expire(node)
    node.tick()
    assert node.worker_id == 1 and node.slot.serving
    assert owner(zk, f"{zk_path}/nodes/0/0") == old[0], "until the old session times out"
    assert owner(zk, f"{zk_path}/nodes/0/1") == session_of(node)


def test_an_auto_node_takes_its_id_back_when_it_is_free(
    member: Make, zookeeper: ZooKeeper, zk: KazooClient, zk_path: str
) -> None:
    hold(zk, f"{zk_path}/nodes/0/0")
    node = member(worker_id=-1).join()
    assert node.worker_id == 1
    zk.delete(f"{zk_path}/nodes/0/0")
    end_session(zookeeper, expire(node))
    node.tick()
    assert node.worker_id == 1, "the id it had, although 0 is free and lower"


def test_a_dropped_connection_suspends_and_reconnects_to_the_same_session(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    node = member(worker_id=2).join()
    session = session_of(node)
    node.client._call(_CONNECTION_DROP, None)
    node.client.states.wait_for(KazooState.SUSPENDED, KazooState.CONNECTED)
    assert node.slot.serving, "the gate decides, not the state: the node is still proven ours"
    node.gate.advance(1.0)
    node.tick()
    assert node.slot.gate.open_until == node.gate.now + OPEN_FOR
    assert session_of(node) == session and owner(zk, f"{zk_path}/nodes/0/2") == session
    assert node.cluster.registrations == 1
    assert events(node.cluster) == {"connected": 2, "suspended": 1, "lost": 0}


def lose_registration(member: Make, zk: KazooClient, zk_path: str, holder: str = "") -> Member:
    """A node serving worker 6 whose registration is deleted (and taken by ``holder``,
    if given) behind its back; after its next tick it no longer serves."""
    node = member(worker_id=6).join()
    path = f"{zk_path}/nodes/0/6"
    zk.delete(path)
    if holder:
        hold(zk, path, holder)
    node.tick()
    assert not node.slot.serving
    return node


def test_a_deleted_registration_is_noticed_and_taken_again(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    node = lose_registration(member, zk, zk_path)
    path = f"{zk_path}/nodes/0/6"
    with pytest.raises(
        UnavailableError, match=re.escape(f"registration {path} lost; registering again")
    ):
        node.slot.next_id()
    node.tick()
    assert node.worker_id == 6 and node.slot.serving
    assert owner(zk, path) == session_of(node)
    assert node.cluster.registrations == 2


def test_a_registration_another_session_took_over_is_left_to_it(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    node = lose_registration(member, zk, zk_path, holder="10.0.0.9:7609")
    path = f"{zk_path}/nodes/0/6"
    with pytest.raises(StartupDeferred, match=re.escape("registered by 10.0.0.9:7609")):
        node.tick()
    assert owner(zk, path) == zk.client_id[0], "not ours to delete"
    zk.delete(path)
    node.tick()
    assert node.worker_id == 6 and node.slot.serving


def test_a_mark_moved_by_another_node_stops_ids_and_registers_again(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    node = member(worker_id=6).join()
    marks = f"{zk_path}/marks/0/6"
    zk.set(marks, str(T0 + 8000).encode())  # another holder of id 6 got this far
    node.clock.now += 3000  # past the reserved mark: the next id must move it
    with pytest.raises(UnavailableError):
        node.slot.next_id()
    assert node.slot.gate.reason == (
        f"worker id lost: {marks} was changed by another node; registering again"
    )
    assert mark(zk, marks) == T0 + 8000, "the other node's mark stands"
    node.tick()
    assert node.worker_id == 6 and node.slot.serving
    assert decompose(node.slot.next_id()).timestamp_ms > T0 + 8000, "after the other's mark"


def test_a_client_stuck_suspended_is_replaced(member: Make, own_zookeeper: OwnZooKeeper) -> None:
    own = own_zookeeper()
    node = member(hosts=own.hosts, worker_id=7, zk_connect_timeout=0.5).join()
    stuck = node.client
    own.stop()
    stuck.states.wait_for(KazooState.SUSPENDED)
    node.tick()  # within the session: nothing to do but wait
    assert node.cluster.client is stuck and node.slot.serving
    node.gate.advance(OPEN_FOR + 0.001)
    assert not node.slot.serving
    with pytest.raises(UnavailableError, match=UNREACHABLE):
        node.slot.next_id()
    node.gate.advance(SESSION - OPEN_FOR)  # past the session timeout, still SUSPENDED
    node.tick()  # a new client: it cannot connect either, within its 0.5 s
    assert not stuck.connected and len(node.clients) == 2
    assert node.cluster.client is None and node.cluster.client_restarts == 1
    assert node.cluster.details()["zookeeper"] == "NONE"
    own.wipe()  # it comes back empty: the old session is unknown there
    own.start()
    node.tick()  # another new client: connected
    assert node.cluster.client is node.client and node.client.connected
    assert node.cluster.client_restarts == 2 and not node.slot.serving
    node.tick()  # registered afresh
    assert node.worker_id == 7 and node.slot.serving
    assert node.cluster.registrations == 2
    counts = samples(node.cluster)
    assert counts["snowflake_zookeeper_client_restarts_total"] == 2
    assert events(node.cluster)["suspended"] == 1
    node.cluster.close()


# -- the supervision thread -------------------------------------------------------


def test_the_supervision_thread_registers_again_on_its_own(
    member: Make,
    zookeeper: ZooKeeper,
    zk: KazooClient,
    zk_path: str,
    log_events: LogEvents,
) -> None:
    node = member(worker_id=3, supervise_every=0.01).join()
    old = expire(node)
    log_events.wait_for("cannot register again yet: worker id 3 of datacenter 0 is registered")
    end_session(zookeeper, old)
    log_events.wait_for("registered again as worker 3")
    # A failure that is not a refusal is logged and retried as well.
    zk.set_acls(f"{zk_path}/marks/0/3", [make_digest_acl("someone", "else", all=True)])
    zk.delete(f"{zk_path}/nodes/0/3")
    log_events.wait_for("ZooKeeper supervision: ZooKeeper denied access: a znode's ACL does not")
    assert not node.slot.serving


# -- shutdown -------------------------------------------------------------------


def test_close_deletes_the_node_and_stores_the_exact_mark(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    node = member(worker_id=4).join()
    node.clock.now += 1234
    last = max(node.slot.next_ids(10))
    node.cluster.close()
    assert zk.exists(f"{zk_path}/nodes/0/4") is None, "deleted at once, not at expiry"
    assert mark(zk, f"{zk_path}/marks/0/4") == decompose(last).timestamp_ms == T0 + 1234
    assert not node.client.connected
    with pytest.raises(UnavailableError, match="this node is stopping"):
        node.slot.next_id()


def test_close_leaves_a_node_it_may_not_delete_to_its_session(
    member: Make, zk: KazooClient, zk_path: str, log_events: LogEvents
) -> None:
    everything_but_delete = make_acl(
        "world", "anyone", read=True, write=True, create=True, admin=True
    )
    zk.create(f"{zk_path}/nodes/0", acl=[everything_but_delete], makepath=True)
    node = member(worker_id=1).join()
    node.cluster.close()
    assert "it expires with the session" in log_events.wait_for(f"could not delete {zk_path}")
    assert zk.exists(f"{zk_path}/nodes/0/1") is None, "gone with the session, closed"


# -- the layout -------------------------------------------------------------------

DEFAULT = "epoch 1288834974657 ms, bits 41/5/5/12 (timestamp/datacenter/worker/sequence)"
NARROW = "epoch 1288834974657 ms, bits 41/5/4/13 (timestamp/datacenter/worker/sequence)"
OTHER_LAYOUT = {"worker_id_bits": 4, "sequence_bits": 13}


def other_layouts_mark(ms: int, epoch_ms: int = 1288834974657 + 1000, **bits: int) -> bytes:
    """A mark recorded under another layout: another epoch, and Twitter's widths but for
    those given (``worker_id_bits=4``...)."""
    layout = {"epoch_ms": epoch_ms, "timestamp_bits": 41, "datacenter_id_bits": 5,
              "worker_id_bits": 5, "sequence_bits": 12, **bits}  # fmt: skip
    return json.dumps({"mark_ms": ms, "layout": layout}).encode()


def record_layout(zk: KazooClient, zk_path: str, **bits: int) -> None:
    """The cluster's layout recorded (ours, but for ``bits``), as its nodes would have:
    the marks of another layout below are leftovers the layout znode does not speak for
    (without it, the layout of the marks would be recorded and ours refused)."""
    data = json.dumps(layout_to_json(Layout(**bits)), sort_keys=True).encode()
    zk.create(f"{zk_path}/layout", data, makepath=True)


def test_auto_refuses_a_mark_of_other_field_widths_instead_of_skipping_it(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    """Ids of other widths collide with ours of other worker ids: no id is safe."""
    record_layout(zk, zk_path)
    zk.create(
        f"{zk_path}/marks/0/0", other_layouts_mark(T0, worker_id_bits=4, sequence_bits=13),
        makepath=True,
    )  # fmt: skip
    with pytest.raises(StartupRefused, match="recorded under another layout"):
        member(worker_id=-1).join()
    assert zk.exists(f"{zk_path}/nodes/0/0") is None and zk.exists(f"{zk_path}/nodes/0/1") is None


def test_the_first_node_records_the_layout_and_another_layout_is_refused(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    """Issue 16, item 3: nodes of two layouts in one cluster issued the same ids."""
    first = member(worker_id=2).join()
    assert json.loads(zk.get(f"{zk_path}/layout")[0]) == {
        "epoch_ms": 1288834974657,
        "timestamp_bits": 41,
        "datacenter_id_bits": 5,
        "worker_id_bits": 5,
        "sequence_bits": 12,
    }
    assert zk.get(f"{zk_path}/nodes/0/2")[0].decode() == first.address, "still host:port"
    second = member(worker_id=1, **OTHER_LAYOUT)
    with pytest.raises(StartupRefused) as info:
        second.join()
    assert str(info.value) == (
        f"Layout insanity: this node would make ids with {NARROW}, but the cluster "
        f"({zk_path}/layout) makes them with {DEFAULT}; two layouts in one cluster hand out "
        "the same ids: start with the cluster's --epoch and --*-bits"
    )
    assert zk.exists(f"{zk_path}/nodes/0/1") is None and not second.slot.serving
    member(worker_id=3).join()  # the same layout joins


def test_a_layout_znode_that_is_not_a_layout_refuses(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    zk.create(f"{zk_path}/layout", b"41/5/5/12", makepath=True)
    with pytest.raises(StartupRefused, match=r"layout in ZooKeeper .* is not a layout"):
        member(worker_id=2).join()


def layout_of(zk: KazooClient, zk_path: str) -> Layout:
    return Layout(**json.loads(zk.get(f"{zk_path}/layout")[0]))


def test_a_missing_layout_is_recorded_from_the_marks_not_from_the_newcomer(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    """Issue 22, item 5: with the layout znode deleted, a node of other widths and
    --skip-sanity-checks recorded its own layout, started and served beside the others."""
    first = member(worker_id=2).join()
    zk.delete(f"{zk_path}/layout")
    second = member(worker_id=1, skip_sanity_checks=True, **OTHER_LAYOUT)
    with pytest.raises(StartupRefused) as info:
        second.join()
    assert str(info.value).startswith(
        f"Layout insanity: this node would make ids with {NARROW}, but the cluster "
        f"({zk_path}/layout, recorded from its marks) makes them with {DEFAULT}"
    )
    assert layout_of(zk, zk_path) == Layout(), "recorded again: the marks' layout"
    assert zk.exists(f"{zk_path}/nodes/0/1") is None and not second.slot.serving
    assert first.slot.serving


def test_marks_of_two_layouts_and_no_layout_znode_refuse_naming_them(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    zk.create(f"{zk_path}/marks/0/0", other_layouts_mark(T0, 1288834974657), makepath=True)
    zk.create(f"{zk_path}/marks/1/3", other_layouts_mark(T0, 1288834974657, worker_id_bits=4),
              makepath=True)  # fmt: skip
    zk.create(f"{zk_path}/marks/1/4", str(T0).encode())  # 0.1.0's: no layout, not counted
    with pytest.raises(StartupRefused) as info:
        member(worker_id=2).join()
    assert str(info.value) == (
        f"the cluster's layout znode {zk_path}/layout is missing and the high-water marks "
        f"were made under 2 layouts ({DEFAULT}: marks/0/0; epoch 1288834974657 ms, bits "
        "41/5/4/12 (timestamp/datacenter/worker/sequence): marks/1/3); two layouts in one "
        f"cluster hand out the same ids: repair it by hand (record the cluster's layout in "
        f"{zk_path}/layout)"
    )
    assert zk.exists(f"{zk_path}/layout") is None


def test_a_layout_recorded_by_another_node_meanwhile_counts(
    member: Make, zk: KazooClient, zk_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two first nodes at once: the one that records its layout second reads the other's."""
    read_marks = LayoutRecord.marks_layouts

    def others_first(self: LayoutRecord) -> dict[Layout, list[str]]:
        found = read_marks(self)
        record_layout(zk, zk_path, **OTHER_LAYOUT)  # the other first node, meanwhile
        return found

    monkeypatch.setattr(LayoutRecord, "marks_layouts", others_first)
    with pytest.raises(StartupRefused, match=f"makes them with {re.escape(NARROW)}"):
        member(worker_id=2).join()


def test_a_running_node_records_a_deleted_layout_again(
    member: Make, zk: KazooClient, zk_path: str, log_events: LogEvents
) -> None:
    node = member(worker_id=2).join()
    zk.delete(f"{zk_path}/layout")
    node.tick()
    assert layout_of(zk, zk_path) == Layout()
    log_events.wait_for(f"the cluster's layout znode {zk_path}/layout was gone: recorded it")
    assert node.slot.serving


def test_only_a_node_whose_layout_is_not_the_recorded_one_stops_issuing(
    member: Make, zk: KazooClient, zk_path: str, log_events: LogEvents
) -> None:
    """Two layouts running (the guard had holes): the record decides which one stops."""
    narrow = member(worker_id=3, **OTHER_LAYOUT).join()  # the first: its layout recorded
    record = f"{zk_path}/layout"
    zk.set(record, json.dumps(layout_to_json(Layout())).encode())
    default = member(worker_id=2).join()  # the layout recorded now: it starts
    narrow.tick()
    reason = (
        f"this node's layout ({NARROW}) is not the cluster's, recorded in {record} "
        f"({DEFAULT}); two layouts in one cluster hand out the same ids"
    )
    assert narrow.slot.unavailable_reason() == f"this node is not handing out ids: {reason}"
    log_events.wait_for(f"stopped handing out ids: {reason}")
    with pytest.raises(UnavailableError):
        narrow.slot.next_id()
    default.tick()
    assert default.slot.serving, "the others keep serving"
    narrow.gate.advance(1)
    narrow.tick()  # a heartbeat proves the session, but the gate stays closed
    assert not narrow.slot.serving
    zk.set(record, json.dumps(layout_to_json(Layout(**OTHER_LAYOUT))).encode())
    default.tick()
    assert not default.slot.serving
    narrow.tick()  # its layout again: serving once the other layout's gates closed
    narrow.gate.advance(OPEN_FOR)
    narrow.tick()
    log_events.wait_for(f"the cluster's layout in {record} is this node's again: serving")
    assert narrow.slot.serving


def layout_json(**bits: int) -> bytes:
    return json.dumps(layout_to_json(Layout(**bits))).encode()


class CountedReads:
    """The reads of marks a client issued (the client is real; this only counts)."""

    def __init__(self, client: KazooClient, marks: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = client.get_async

        def counted(path: str, *args: Any, **kwargs: Any) -> Any:
            if path.startswith(marks):
                self.count += 1
            return real(path, *args, **kwargs)

        monkeypatch.setattr(client, "get_async", counted)


def test_a_wrong_record_stops_every_node_within_a_tick_and_writing_it_back_resumes_them(
    member: Make,
    zk: KazooClient,
    zk_path: str,
    log_events: LogEvents,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The record decides, nothing else: a wrong write stops the nodes whose layout
    differs (the marks are not read: a scan of thousands held the heartbeats back, and
    one mark of another layout, or one unfinished scan, kept a wrong node serving)."""
    a, b = member(worker_id=2).join(), member(worker_id=3).join()
    record = f"{zk_path}/layout"
    reads = CountedReads(a.client, f"{zk_path}/marks/", monkeypatch)
    zk.set(record, layout_json(**OTHER_LAYOUT))
    a.tick()
    reason = (
        f"this node's layout ({DEFAULT}) is not the cluster's, recorded in {record} "
        f"({NARROW}); two layouts in one cluster hand out the same ids"
    )
    assert a.slot.unavailable_reason() == f"this node is not handing out ids: {reason}"
    log_events.wait_for(f"stopped handing out ids: {reason}")
    assert reads.count == 0, "no mark read: the record decides"
    b.tick()
    assert not b.slot.serving
    assert zk.get(record)[0] == layout_json(**OTHER_LAYOUT), "not written back"
    zk.set(record, layout_json())  # the operator writes the right layout back
    a.tick()
    assert not a.slot.serving, "not before the other layout's gates closed"
    a.gate.advance(OPEN_FOR)
    a.tick()
    assert a.slot.serving, "resumed once settled"
    log_events.wait_for(f"the cluster's layout in {record} is this node's again: serving")
    b.tick()
    b.gate.advance(OPEN_FOR)
    b.tick()
    assert b.slot.serving


def test_a_record_that_is_not_a_layout_changes_nothing_and_is_logged_once(
    member: Make, zk: KazooClient, zk_path: str, log_events: LogEvents
) -> None:
    narrow = member(worker_id=3, **OTHER_LAYOUT).join()  # the first: its layout recorded
    record = f"{zk_path}/layout"
    zk.set(record, layout_json())
    default = member(worker_id=2).join()
    narrow.tick()
    assert not narrow.slot.serving, "stopped for its layout"
    zk.set(record, b"garbage")
    for node in (narrow, default, narrow, default):
        node.gate.advance(1)
        node.tick()
    assert default.slot.serving and not narrow.slot.serving, "each stays as it was"
    said = f"the cluster's layout in {record} was not checked: the cluster's layout in ZooKeeper"
    assert sum(said in m and "stays as it was" in m for m in log_events.messages) == 1
    assert sum(said in m and "stays stopped" in m for m in log_events.messages) == 1
    zk.delete(record)
    narrow.tick()  # recorded again as it last read a layout: the one that stopped it
    assert layout_of(zk, zk_path) == Layout()
    narrow.gate.advance(1)
    narrow.tick()
    assert not narrow.slot.serving


def test_a_layout_znode_the_node_may_not_read_is_not_decided_on(
    member: Make, zk: KazooClient, zk_path: str, log_events: LogEvents
) -> None:
    node = member(worker_id=2).join()
    zk.set_acls(f"{zk_path}/layout", [make_digest_acl("someone", "else", all=True)])
    node.gate.advance(1)
    node.tick()
    log_events.wait_for(
        f"the cluster's layout in {zk_path}/layout was not checked: ZooKeeper denied access"
    )
    assert node.slot.serving, "the heartbeat went on"


def test_a_record_changed_during_the_start_up_waits_refuses_before_serving(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    """The record was read before the first-start wait and never again: the node served
    with a layout the cluster no longer records."""
    record_layout(zk, zk_path)
    record = f"{zk_path}/layout"

    def changed(_: float) -> None:
        zk.set(record, layout_json(**OTHER_LAYOUT))

    node = member(worker_id=2, first_start_wait=1.0, on_sleep=changed)
    with pytest.raises(StartupRefused) as info:
        node.join()
    assert str(info.value) == (
        f"Layout insanity: this node would make ids with {DEFAULT}, but the cluster "
        f"({record}) makes them with {NARROW}; two layouts in one cluster hand out "
        "the same ids: start with the cluster's --epoch and --*-bits"
    )
    assert node.sleeps == [1.0] and node.slot.worker is None and not node.slot.serving
    assert zk.exists(f"{zk_path}/nodes/0/2") is None
    assert zk.exists(f"{zk_path}/marks/0/2") is None, "no mark written"


def test_a_newcomer_on_an_empty_tree_records_its_layout_only_before_its_first_mark(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    """A record written before the waits could stay unconfirmed for good (a lost reply,
    a kill -9 during the wait) and refuse the cluster's nodes coming back."""
    record = f"{zk_path}/layout"
    seen: list[object] = []

    def waiting(_: float) -> None:
        seen.append(zk.exists(record))

    node = member(worker_id=2, first_start_wait=1.0, on_sleep=waiting).join()
    assert seen == [None], "nothing recorded before the wait"
    assert layout_of(zk, zk_path) == Layout() and node.slot.serving
    assert zk.exists(f"{zk_path}/marks/0/2") is not None


def test_a_newcomer_whose_layout_differs_from_marks_put_back_during_its_wait_writes_nothing(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    """ZooKeeper lost its data: a misconfigured newcomer recorded its own layout, and
    the cluster's nodes, putting their marks back, were refused by that record forever."""
    theirs = json.dumps({"mark_ms": T0, "layout": layout_to_json(Layout())}).encode()

    def mark_put_back(_: float) -> None:
        zk.create(f"{zk_path}/marks/0/5", theirs, makepath=True)

    newcomer = member(worker_id=2, first_start_wait=1.0, on_sleep=mark_put_back, **OTHER_LAYOUT)
    with pytest.raises(StartupRefused) as info:
        newcomer.join()
    assert str(info.value).startswith(
        f"Layout insanity: this node would make ids with {NARROW}, but the cluster "
        f"({zk_path}/layout, recorded from its marks) makes them with {DEFAULT}"
    )
    assert layout_of(zk, zk_path) == Layout(), "the marks' layout"
    assert zk.exists(f"{zk_path}/nodes/0/2") is None
    assert zk.exists(f"{zk_path}/marks/0/2") is None, "no mark written"
    assert newcomer.slot.worker is None
    member(worker_id=5).join()  # the mark's node


def test_two_newcomers_of_two_layouts_on_an_empty_tree_one_records_the_other_writes_nothing(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    nodes: list[Member] = []

    def other_starts(_: float) -> None:
        if len(nodes) == 1:  # during the first one's wait: the second starts and records
            nodes.append(member(worker_id=3, **OTHER_LAYOUT).join())

    nodes.append(member(worker_id=2, first_start_wait=1.0, on_sleep=other_starts))
    with pytest.raises(StartupRefused, match=f"makes them with {re.escape(NARROW)}"):
        nodes[0].join()
    assert layout_of(zk, zk_path) == Layout(**OTHER_LAYOUT) and nodes[1].slot.serving
    assert zk.exists(f"{zk_path}/marks/0/2") is None and zk.exists(f"{zk_path}/nodes/0/2") is None
    assert nodes[0].slot.worker is None


def test_a_stopped_node_of_another_layout_registering_again_never_records_its_layout(
    member: Make, zookeeper: ZooKeeper, zk: KazooClient, zk_path: str
) -> None:
    """A stopped wrong-layout node whose own mark was put back first recorded its layout
    from the marks when registering again, and took the cluster over."""
    narrow = member(worker_id=3, **OTHER_LAYOUT).join()
    record = f"{zk_path}/layout"
    zk.set(record, layout_json())  # the cluster's layout
    narrow.tick()
    assert not narrow.slot.serving, "stopped for its layout"
    zk.delete(record)  # ZooKeeper lost its data: the record and the marks
    zk.delete(f"{zk_path}/marks/0/3")
    end_session(zookeeper, expire(narrow))
    with pytest.raises(StartupRefused, match="Layout insanity"):
        narrow.tick()  # its mark put back first, then the record as it last read it
    assert zk.exists(f"{zk_path}/marks/0/3") is not None, "its mark was put back"
    assert layout_of(zk, zk_path) == Layout(), "the record it last read, not the marks'"
    assert not narrow.slot.serving


def test_a_node_registering_again_rewrites_a_missing_record_as_it_last_read_it(
    member: Make, zookeeper: ZooKeeper, zk: KazooClient, zk_path: str
) -> None:
    node = member(worker_id=2).join()
    zk.delete(f"{zk_path}/layout")
    end_session(zookeeper, expire(node))
    node.tick()
    assert layout_of(zk, zk_path) == Layout() and node.slot.serving


def test_a_layout_stop_reopens_only_after_the_other_layouts_gates_closed(
    member: Make, zk: KazooClient, zk_path: str, log_events: LogEvents
) -> None:
    """A node of the old layout whose tick is late serves until its gate closes, 0.9 x
    session timeout after its last heartbeat: reopening at once overlapped with it."""
    node = member(worker_id=2).join()
    record = f"{zk_path}/layout"
    zk.set(record, layout_json(**OTHER_LAYOUT))
    node.tick()
    zk.set(record, layout_json())
    node.gate.advance(1)
    node.tick()  # the first matching read
    assert not node.slot.serving
    assert "is this node's again" in (node.slot.unavailable_reason() or "")
    node.gate.advance(OPEN_FOR - 1.01)
    node.tick()
    assert not node.slot.serving, "still within the settle time"
    zk.set(record, layout_json(**OTHER_LAYOUT))  # changed again meanwhile: starts over
    node.tick()
    zk.set(record, layout_json())
    node.tick()
    node.gate.advance(0.02)
    node.tick()
    assert not node.slot.serving, "counted from the last first matching read"
    node.gate.advance(OPEN_FOR)
    node.tick()
    assert node.slot.serving


def test_a_mark_write_refused_during_a_heartbeat_keeps_the_gate_closed(
    member: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lost_ownership (the reservation's thread) between the tick's check and the
    heartbeat's answer: the heartbeat opened the gate again."""
    node = member(worker_id=2).join()
    real = node.client.exists_async

    def refused_meanwhile(path: str, *args: Any, **kwargs: Any) -> Any:
        node.cluster.lost_ownership("a mark write was refused")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(node.client, "exists_async", refused_meanwhile)
    node.gate.advance(1)
    node.tick()
    assert not node.slot.serving and node.slot.gate.shut


def test_a_mark_write_refused_while_the_worker_opens_means_registering_again(
    member: Make,
) -> None:
    """The reservation's thread finds its mark write refused (another node put the id's
    mark back) after the worker opened but before the registration reopened the gate:
    that refusal is about this registration. It was wiped out by the reopening, and the
    next heartbeat opened the gate on a worker id this node had lost."""
    refusals = ["a mark write was refused"]
    made: list[Member] = []

    def refused() -> None:
        if refusals:
            made[0].cluster.lost_ownership(refusals.pop())

    node = member(worker_id=2, after_open=refused)
    made.append(node)
    node.join()
    assert not node.slot.serving and node.slot.gate.shut
    assert "worker id lost: a mark write was refused" in (node.slot.unavailable_reason() or "")
    node.tick()
    assert node.slot.serving and node.cluster.registrations == 2


def test_failures_to_register_again_are_logged_once_per_reason_and_minute(
    member: Make, zookeeper: ZooKeeper, zk: KazooClient, zk_path: str, log_events: LogEvents
) -> None:
    node = member(worker_id=2).join()
    zk.set(f"{zk_path}/layout", layout_json(**OTHER_LAYOUT))
    end_session(zookeeper, expire(node))

    def said() -> int:
        return sum("cannot register again yet: Layout insanity" in m for m in log_events.messages)

    node.cluster.supervise_tick()
    node.cluster.supervise_tick()
    assert said() == 1
    node.gate.advance(60)
    node.cluster.supervise_tick()
    assert said() == 2
    zk.set(f"{zk_path}/layout", b"garbage")
    node.cluster.supervise_tick()
    assert sum("cannot register again yet: the cluster's layout" in m
               for m in log_events.messages) == 1, "another reason: said at once"  # fmt: skip


def test_an_interrupted_first_start_leaves_no_record(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    """An interrupted start must not leave a record the next start would take as the
    cluster's, skipping the check of the marks."""
    nodes: list[Member] = []

    def stopped(_: float) -> None:
        nodes[0].cluster.interrupt()  # a stop during the first-start wait

    nodes.append(member(worker_id=2, first_start_wait=1.0, on_sleep=stopped, **OTHER_LAYOUT))
    with pytest.raises(StartupInterrupted):
        nodes[0].join()
    assert zk.exists(f"{zk_path}/layout") is None


def test_a_node_registering_again_says_why_when_the_record_is_not_its_layout(
    member: Make, zookeeper: ZooKeeper, zk: KazooClient, zk_path: str
) -> None:
    node = member(worker_id=2).join()
    record = f"{zk_path}/layout"
    zk.set(record, layout_json(**OTHER_LAYOUT))
    end_session(zookeeper, expire(node))
    with pytest.raises(StartupRefused, match="Layout insanity"):
        node.tick()  # the supervision thread logs it: cannot register again yet
    assert node.slot.unavailable_reason() == (
        f"this node is not handing out ids: this node's layout ({DEFAULT}) is not the "
        f"cluster's, recorded in {record} ({NARROW}); two layouts in one cluster hand out "
        "the same ids"
    )
    zk.set(record, layout_json())
    node.tick()
    assert node.slot.worker is not None and not node.slot.serving, "registered, settling"
    node.gate.advance(OPEN_FOR)
    node.tick()
    assert node.slot.serving and node.cluster.record.hold is None


def test_a_deleted_layout_recorded_by_another_node_first_is_left_to_it(
    member: Make, zk: KazooClient, zk_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = member(worker_id=2).join()
    record = f"{zk_path}/layout"
    zk.delete(record)
    real_create = node.client.create_async

    def created_meanwhile(path: str, *args: Any, **kwargs: Any) -> Any:
        if path == record:
            zk.create(record, b"another node's")
        return real_create(path, *args, **kwargs)

    monkeypatch.setattr(node.client, "create_async", created_meanwhile)
    node.tick()
    assert zk.get(record)[0] == b"another node's"


def test_a_node_stopped_for_its_layout_records_a_deleted_layout_as_the_one_that_stopped_it(
    member: Make, zk: KazooClient, zk_path: str, log_events: LogEvents
) -> None:
    """It recorded its own layout, served again, and stopped the cluster's nodes."""
    narrow = member(worker_id=3, **OTHER_LAYOUT).join()
    record = f"{zk_path}/layout"
    zk.set(record, json.dumps(layout_to_json(Layout())).encode())
    default = member(worker_id=2).join()
    narrow.tick()
    assert not narrow.slot.serving, "stopped for its layout"
    zk.delete(record)
    narrow.tick()  # the stopped node first
    assert layout_of(zk, zk_path) == Layout(), "the record that stopped it"
    log_events.wait_for(
        f"the cluster's layout znode {record} was gone: recorded it again as this node last "
        f"read it, {DEFAULT} (not this node's: it stays stopped)"
    )
    narrow.gate.advance(1)
    narrow.tick()
    narrow.tick()
    assert not narrow.slot.serving
    default.gate.advance(1)
    default.tick()
    assert default.slot.serving


def test_a_static_id_whose_mark_has_another_layout_is_refused(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    """Issue 16, item 2: the mark records the layout it was made under."""
    narrow = other_layouts_mark(T0, 1288834974657, worker_id_bits=4, sequence_bits=13)
    record_layout(zk, zk_path)
    zk.create(f"{zk_path}/marks/0/0", narrow, makepath=True)
    node = member(worker_id=0)
    with pytest.raises(StartupRefused, match="was recorded under another layout") as info:
        node.join()
    assert f"({NARROW}) than ours ({DEFAULT})" in str(info.value)
    assert zk.exists(f"{zk_path}/nodes/0/0") is None, "the registration was taken back"


def test_auto_skips_an_id_whose_mark_has_another_layout(
    member: Make, zk: KazooClient, zk_path: str, log_events: LogEvents
) -> None:
    record_layout(zk, zk_path)
    zk.create(f"{zk_path}/marks/0/0", other_layouts_mark(T0), makepath=True)
    node = member(worker_id=-1).join()
    assert node.worker_id == 1 and node.slot.serving
    assert zk.exists(f"{zk_path}/nodes/0/0") is None
    log_events.wait_for("skipping worker id 0: the high-water mark")


@pytest.mark.parametrize("another_layout", [False, True], ids=["leased", "mark-of-another-layout"])
def test_out_of_worker_ids_is_a_clear_refusal(
    member: Make, zk: KazooClient, zk_path: str, another_layout: bool
) -> None:
    narrow = {"worker_id": -1, "worker_id_bits": 1, "datacenter_id_bits": 9}
    # Leased: another session holds id 0 and a first node takes id 1. Another layout:
    # id 0's mark was made with another layout, and id 1 is held.
    hold(zk, f"{zk_path}/nodes/0/{int(another_layout)}")
    if another_layout:  # another epoch, our widths: an id to skip, not a refusal
        record_layout(zk, zk_path, worker_id_bits=1, datacenter_id_bits=9)
        mark = other_layouts_mark(T0, worker_id_bits=1, datacenter_id_bits=9)
        zk.create(f"{zk_path}/marks/0/0", mark, makepath=True)
    else:
        member(**narrow).join()
    with pytest.raises(StartupDeferred) as info:
        member(**narrow).join()
    skipped = ", 1 of them skipped for their marks" if another_layout else ""
    assert str(info.value) == (
        f"all 2 worker ids of datacenter 0 are leased ({zk_path}/nodes/0{skipped}); widen "
        "--worker-id-bits or use another datacenter id"
    )


def test_a_mark_of_0_1_0_is_a_mark_of_the_layout_in_use(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    """An upgrade from 0.1.0 (a plain number, no layout) must not refuse."""
    zk.create(f"{zk_path}/marks/0/4", str(T0 + 5000).encode(), makepath=True)
    node = member(worker_id=4).join()
    assert decompose(node.slot.next_id()).timestamp_ms > T0 + 5000
    assert json.loads(zk.get(f"{zk_path}/marks/0/4")[0])["layout"]["sequence_bits"] == 12


# -- a ZooKeeper that vanishes during start-up ----------------------------------------


@pytest.mark.parametrize("step", ["check_peers", "register"])
def test_a_zookeeper_that_vanishes_during_start_up_is_refused_within_the_connect_timeout(
    member: Make, own_zookeeper: OwnZooKeeper, step: str
) -> None:
    """Issue 16, item 8: kazoo's retries and its wait for a reconnection took 34 s."""
    own = own_zookeeper()
    node = member(hosts=own.hosts, worker_id=3, zk_connect_timeout=1.0)
    node.cluster.connect()
    own.stop()
    node.client.states.wait_for(KazooState.SUSPENDED)
    started = time.monotonic()
    with pytest.raises(StartupDeferred) as info:
        getattr(node.cluster, step)()
    assert time.monotonic() - started < 2.5
    assert str(info.value).startswith(
        "ZooKeeper did not answer within 1 s (--zk-connect-timeout) while "
    ), info.value
    assert not node.slot.serving
    started = time.monotonic()
    node.cluster.close()
    assert time.monotonic() - started < 5, "closing does not wait for ZooKeeper either"


def test_a_connection_dropped_while_taking_an_id_is_a_refusal(
    member: Make, zk: KazooClient, zk_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kazoo has no session id while disconnected: ``client_id`` is None (it was a
    TypeError, a traceback and exit 1)."""
    hold(zk, f"{zk_path}/nodes/0/5")
    node = member(worker_id=5)
    node.cluster.connect()
    # Disconnected between the create that found the node and the look at its owner.
    monkeypatch.setattr(WatchedClient, "client_id", property(lambda self: None))
    with pytest.raises(StartupDeferred, match=r"connection dropped while registering .*nodes/0/5"):
        node.cluster.register()


# -- faults: a granted session timeout, ZooKeeper's lost data, a clock that ran ahead ----


def test_the_gate_counts_with_the_session_timeout_zookeeper_granted(
    member: Make, own_zookeeper: OwnZooKeeper, log_events: LogEvents
) -> None:
    # Asked for 10 s, granted 2 s (its maxSessionTimeout): the registration can be
    # leased elsewhere 2 s after the last contact, so ids stop 1.8 s after it.
    own = own_zookeeper(max_session_timeout_ms=2000)
    node = member(hosts=own.hosts, worker_id=4, zk_session_timeout=10.0).join()
    log_events.wait_for("ZooKeeper granted a session timeout of 2 s, not the 10 s asked for")
    assert node.slot.gate.open_until == node.gate.now + 1.8
    assert node.cluster.session_timeout == 2.0
    assert node.cluster.details()["session_timeout_s"] == 2.0
    assert samples(node.cluster)["snowflake_zookeeper_session_timeout_seconds"] == 2.0
    node.gate.advance(1.8)
    assert node.slot.serving
    node.gate.advance(0.001)
    assert not node.slot.serving, "the gate closed at 0.9 x the granted timeout"
    assert node.slot.unavailable_reason() == f"this node is not handing out ids: {UNREACHABLE}"
    # A client left SUSPENDED is replaced after the granted timeout too.
    stuck = node.client
    own.stop()
    stuck.states.wait_for(KazooState.SUSPENDED)
    node.tick()
    assert node.cluster.client is stuck, "within the session"
    node.gate.advance(2.001)
    node.tick()
    assert node.cluster.client_restarts == 1


def test_a_heartbeat_from_a_session_whose_granted_timeout_is_unknown_proves_nothing(
    member: Make,
) -> None:
    node = member(worker_id=5).join()
    node.gate.advance(OPEN_FOR + 0.001)
    node.cluster.granted.record(session_of(node) + 1, 4000)  # another session's reply
    node.tick()
    assert not node.slot.serving
    node.cluster.granted.record(session_of(node), 4000)
    node.tick()
    assert node.slot.serving


def test_a_mark_deleted_under_a_registered_node_is_written_again(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    node = member(worker_id=6).join()
    marks = f"{zk_path}/marks/0/6"
    zk.delete(marks)
    node.clock.now += 3000  # past the reserved mark: the next id needs a write
    assert decompose(node.slot.next_id()).timestamp_ms == T0 + 3000
    assert mark(zk, marks) == T0 + 5000, "put back, ahead of the id"
    assert node.slot.serving


def lose_data(own: ZooKeeper, *nodes: Member) -> None:
    """ZooKeeper stops, comes back empty; ``nodes`` see their session gone."""
    own.stop()
    for node in nodes:
        node.client.states.wait_for(KazooState.SUSPENDED)
    own.wipe()
    own.start()


def comes_back(node: Member) -> None:
    """What the node's supervision does once ZooKeeper is back, empty: replace the
    client stuck without a session (past the timeout), then register again."""
    node.gate.advance(SESSION + 0.001)
    node.tick()
    node.tick()


def test_after_zookeeper_lost_its_data_a_node_on_the_id_waits_for_its_holder_to_come_back(
    member: Make, own_zookeeper: OwnZooKeeper, log_events: LogEvents
) -> None:
    # Seen: B, whose clock is 3 s behind A's, leased A's worker id from an emptied
    # ZooKeeper before A registered again, and both handed out the same ids.
    own = own_zookeeper()
    a = member(hosts=own.hosts, worker_id=-1, clock_ms=T0 + 5000).join()
    issued_by_a = {a.slot.next_id() for _ in range(50)}
    lose_data(own, a)
    # B leases worker 0: ZooKeeper has no mark of it. While B waits, A is back.
    b = member(
        hosts=own.hosts, worker_id=-1, first_start_wait=15.0, on_sleep=lambda _s: comes_back(a)
    ).join()
    log_events.wait_for("put the high-water mark of worker id 0 back")
    assert b.sleeps == [15.0] and b.worker_id == 0
    assert a.worker_id == 1, "A took another id: B had leased its own"
    from_b = [b.slot.next_id() for _ in range(50)]
    assert not issued_by_a & set(from_b)
    assert min(decompose(i).timestamp_ms for i in from_b) > max(
        decompose(i).timestamp_ms for i in issued_by_a
    ), "B waited for its clock to pass A's mark"
    assert b.slot.worker is not None
    assert not b.slot.worker.reservation.first_start, "it found a mark after all"


def test_after_zookeeper_lost_its_data_a_holder_back_first_keeps_its_id_and_mark(
    member: Make, own_zookeeper: OwnZooKeeper, zk_path: str
) -> None:
    own = own_zookeeper()
    a = member(hosts=own.hosts, worker_id=-1, clock_ms=T0 + 5000, first_start_wait=15.0)
    a.join()
    assert a.sleeps == [15.0], "a new id: waited once"
    last = max(a.slot.next_id() for _ in range(50))
    lose_data(own, a)
    comes_back(a)
    assert a.worker_id == 0 and a.slot.serving
    assert a.sleeps == [15.0], "its mark was back before it leased: no wait this time"
    assert decompose(a.slot.next_id()).timestamp_ms >= decompose(last).timestamp_ms
    b = member(hosts=own.hosts, worker_id=0, clock_ms=T0 + 2000, first_start_wait=15.0)
    b.cluster.connect()
    with pytest.raises(StartupDeferred, match="registered by"):
        b.cluster.register()
    assert b.sleeps == [1.0, 1.0], "the mark is there: no first-start wait, only retries"
    client = own.client()
    client.start(timeout=10)
    try:
        assert mark(client, f"{zk_path}/marks/0/0") >= decompose(last).timestamp_ms
    finally:
        client.stop()
        client.close()


def test_a_worker_id_without_a_mark_waits_the_window_when_no_holder_comes_back(
    member: Make, tmp_path: Path
) -> None:
    node = member(worker_id=-1, first_start_wait=15.0).join()
    assert node.sleeps == [15.0], "waited once, by the cluster"
    assert node.clock.sleeps == [], "Worker.open did not wait again"
    worker = node.slot.worker
    assert worker is not None and worker.reservation.first_start
    assert worker.reservation.first_start_wait_s == 15.0


def test_auto_skips_an_id_whose_mark_ran_far_ahead(
    member: Make, zk: KazooClient, zk_path: str, log_events: LogEvents
) -> None:
    # A node whose clock jumped an hour ahead used worker 0, then went away.
    ahead = json.dumps({"mark_ms": T0 + 3_600_000, "layout": layout_to_json(Layout())})
    zk.create(f"{zk_path}/marks/0/0", ahead.encode(), makepath=True)
    node = member(worker_id=-1).join()
    assert node.worker_id == 1 and node.slot.serving
    log_events.wait_for("skipping worker id 0: its high-water mark in zookeeper:")
    counts = samples(node.cluster)
    assert counts['snowflake_zookeeper_worker_ids_skipped_total{reason="mark_ahead"}'] == 1
    assert zk.exists(f"{zk_path}/nodes/0/0") is None, "not left registered"
    static = member(worker_id=0)
    static.cluster.connect()
    with pytest.raises(ClockBehindMark, match=re.escape("3600.000 s behind the high-water mark")):
        static.cluster.register()


def test_a_mark_put_back_just_before_the_first_write_refuses_the_start_cleanly(
    member: Make, zk: KazooClient, zk_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    marks = f"{zk_path}/marks/0/0"
    original = ZkMarkStore.load

    def load_then_holder_comes_back(*args: Any, **kwargs: Any) -> ZkMarkStore:
        store = original(*args, **kwargs)
        zk.create(marks, str(T0 + 100).encode(), makepath=True)  # after our read
        return store

    monkeypatch.setattr(ZkMarkStore, "load", load_then_holder_comes_back)
    node = member(worker_id=0)
    node.cluster.connect()
    with pytest.raises(StartupDeferred, match="its high-water mark changed while this node took"):
        node.cluster.register()
    assert zk.exists(f"{zk_path}/nodes/0/0") is None, "not left registered"
    assert mark(zk, marks) == T0 + 100, "the holder's mark stands"


def test_a_registration_lost_during_the_wait_is_not_served(
    member: Make, zookeeper: ZooKeeper, zk_path: str
) -> None:
    made: list[Member] = []
    node = member(worker_id=0, first_start_wait=1.0, on_sleep=lambda _s: expire(made[0]))
    made.append(node)
    node.cluster.connect()
    with pytest.raises(StartupDeferred, match="was lost while waiting for its high-water mark"):
        node.cluster.register()


# -- a stop while starting (issue 22, item 3) ------------------------------------------


def test_an_interrupt_during_the_first_start_wait_writes_no_mark_and_the_next_start_waits_again(
    member: Make, zk: KazooClient, zk_path: str, tmp_path: Path, log_events: LogEvents
) -> None:
    """A mark written during the wait would let the next start skip the very wait that
    guards a mark ZooKeeper lost. It ended in StartupRefused (exit 3) before."""
    node = member(worker_id=0, first_start_wait=15.0, stop_ends_waits=True)
    node.cluster.connect()
    thread, outcome = run_in_thread(node.cluster.register)
    log_events.wait_for("waiting --first-start-wait 15 s")
    assert zk.exists(f"{zk_path}/nodes/0/0") is not None, "registered, waiting"
    started = time.monotonic()
    node.cluster.interrupt()
    thread.join(5)
    assert time.monotonic() - started < 2, "the wait ended at once"
    (error,) = outcome
    assert isinstance(error, StartupInterrupted), error
    assert str(error).startswith("stopping while waiting --first-start-wait for the mark of")
    node.cluster.close()
    assert zk.exists(f"{zk_path}/nodes/0/0") is None, "no registration left"
    assert zk.exists(f"{zk_path}/marks/0/0") is None, "no mark in ZooKeeper"
    assert not list((tmp_path / "host0").glob("worker-*")), "no mark on disk"
    again = member(worker_id=0, first_start_wait=15.0, state_dir=str(tmp_path / "host0")).join()
    assert again.sleeps == [15.0], "waited again"
    assert again.worker_id == 0 and again.slot.serving
    assert list((tmp_path / "host0").glob("worker-*")), "its mark on disk, once it reserved"


def test_an_interrupt_ends_the_retries_of_a_held_static_id(
    member: Make, zk: KazooClient, zk_path: str
) -> None:
    hold(zk, f"{zk_path}/nodes/0/5")
    nodes: list[Member] = []
    node = member(worker_id=5, on_sleep=lambda _s: nodes[0].cluster.interrupt())
    nodes.append(node)
    node.cluster.connect()
    with pytest.raises(StartupInterrupted, match="stopping while retrying the held worker id 5"):
        node.cluster.register()
    assert node.sleeps == [1.0], "not one retry more"


def test_an_interrupt_ends_the_peer_checks(member: Make, zk: KazooClient, zk_path: str) -> None:
    hold(zk, f"{zk_path}/nodes/0/9", f"127.0.0.1:{free_port()}")  # registered, silent
    nodes: list[Member] = []
    node = member(worker_id=1, on_sleep=lambda _s: nodes[0].cluster.interrupt())
    nodes.append(node)
    node.cluster.connect()
    with pytest.raises(StartupInterrupted, match="stopping while the peer checks waited"):
        node.cluster.check_peers()
    assert len(node.sleeps) == 1
    with pytest.raises(StartupInterrupted, match="stopping while about to register"):
        node.cluster.register()
    with pytest.raises(StartupInterrupted, match="stopping while about to ask the registered"):
        node.cluster.check_peers()


def test_an_interrupt_after_start_leaves_the_heartbeats_running(member: Make) -> None:
    """A stop asked while draining (a second SIGTERM) ended the supervision thread: the
    gate lapsed while the node still had calls to finish."""
    node = member(worker_id=2, supervise_every=0.01).join()
    node.cluster.interrupt()
    before = node.slot.gate.open_until
    node.gate.advance(1)
    wait_until(lambda: node.slot.gate.open_until >= before + 1, "a heartbeat after the interrupt")
    assert node.slot.serving


def test_an_interrupt_ends_the_wait_for_zookeeper(member: Make) -> None:
    """kazoo's start(timeout) waited out --zk-connect-timeout whatever happened."""
    node = member(hosts=f"127.0.0.1:{free_port()}", zk_connect_timeout=60.0)
    thread, outcome = run_in_thread(node.cluster.connect)
    wait_until(lambda: node.clients, "a ZooKeeper client")
    started = time.monotonic()
    node.cluster.interrupt()
    thread.join(5)
    assert time.monotonic() - started < 2
    (error,) = outcome
    assert isinstance(error, StartupInterrupted), error
    assert str(error) == "stopping while connecting to ZooKeeper; not registered"
    assert node.cluster.client is None and not node.client.connected


def test_a_record_deleted_while_registering_again_is_written_back_at_the_confirmation(
    member: Make,
    zookeeper: ZooKeeper,
    zk: KazooClient,
    zk_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = member(worker_id=2).join()
    record = f"{zk_path}/layout"
    check = LayoutRecord.check

    def deleted_after(self: LayoutRecord, stage: Stage, bound: float | None = None) -> None:
        check(self, stage, bound)
        zk.delete(record)  # before the worker's first mark

    monkeypatch.setattr(LayoutRecord, "check", deleted_after)
    end_session(zookeeper, expire(node))
    node.tick()
    assert layout_of(zk, zk_path) == Layout() and node.slot.worker is not None


def test_a_node_registering_again_with_no_record_read_writes_none(
    member: Make, zookeeper: ZooKeeper, zk: KazooClient, zk_path: str
) -> None:
    node = member(worker_id=2).join()
    node.cluster.record.last = None  # as if it never read one
    zk.delete(f"{zk_path}/layout")
    end_session(zookeeper, expire(node))
    with pytest.raises(StartupDeferred, match="read no record to write back"):
        node.tick()
    assert zk.exists(f"{zk_path}/layout") is None and zk.exists(f"{zk_path}/nodes/0/2") is None


# -- the native generator state ---------------------------------------------------


@pytest.mark.skipif(native_core() is None, reason="the native core is not built")
def test_the_native_state_stops_at_once_on_a_lost_session_and_is_sealed_before_a_re_lease(
    member: Make, zookeeper: ZooKeeper
) -> None:
    node = member(worker_id=3).join()
    worker = node.slot.worker
    assert worker is not None
    state = worker.native_state
    assert state is not None and node.slot.gate.attached is state

    def fast() -> int | None:  # what a native thread gets now (on the fake clocks)
        assert state is not None
        return state.next_id(node.clock(), node.gate.now)

    first = fast()
    assert first is not None and decompose(first).worker_id == 3
    node.gate.advance(OPEN_FOR + 0.001)
    assert fast() is None, "no heartbeat within the session: SLOW"
    node.tick()  # confirmed again
    assert fast() is not None and state.gate_until == node.slot.gate.open_until
    old = expire(node)
    assert fast() is None, "at once, however long the gate had left"
    assert not state.gate_open and not state.sealed
    with pytest.raises(StartupDeferred):
        node.tick()  # the old session still holds the node: retired, not leased again
    assert state.sealed and node.slot.gate.attached is None
    end_session(zookeeper, old)
    node.tick()
    new = node.slot.worker
    assert new is not None and new is not worker and node.slot.serving
    assert new.native_state is not None and new.native_state is not state
    assert node.slot.gate.attached is new.native_state
    assert fast() is None, "the old state stays sealed"
    assert new.native_state.next_id(node.clock(), node.gate.now) is not None
