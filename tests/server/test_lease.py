"""The lease of a worker id against a real ZooKeeper: who gets which id, and how a held
one is refused. Retries are counted by an injected sleep; nothing waits."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from kazoo.client import KazooClient

from snowflake_server._cluster.lease import Lease
from snowflake_server._errors import StartupDeferred, StartupInterrupted

pytestmark = pytest.mark.zookeeper

ADDRESS = "127.0.0.1:7001"


class Waits:
    """The lease's sleep and interrupt check: records the sleeps; ``stop`` makes the
    next check raise, as a SIGTERM does."""

    def __init__(self) -> None:
        self.slept: list[float] = []
        self.stop = False

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def interrupted(self, doing: str) -> None:
        if self.stop:
            raise StartupInterrupted(f"stopping while {doing}; not registered")


def lease_of(client: KazooClient, zk_path: str, waits: Waits) -> Lease:
    return Lease(
        lambda: client, f"{zk_path}/nodes/0", 0, ADDRESS, 5.0,
        sleep=waits.sleep, interrupted=waits.interrupted,
    )  # fmt: skip


def hold(other: KazooClient, path: str) -> None:
    other.create(path, b"10.0.0.9:7609", ephemeral=True, makepath=True)


def test_a_static_id_is_taken_as_an_ephemeral_znode_of_our_session_holding_our_address(
    zk: KazooClient, zk_path: str
) -> None:
    lease = lease_of(zk, zk_path, Waits())
    assert lease.take(3, 31) == 3
    data, stat = zk.get(f"{zk_path}/nodes/0/3")
    assert data == ADDRESS.encode() and stat.ephemeralOwner == zk.client_id[0]
    assert lease.owned(lease.node(3), "checking")


def test_a_held_static_id_is_tried_three_times_1_s_apart_then_deferred_naming_its_holder(
    zk: KazooClient, zk_sessions: Callable[[], KazooClient], zk_path: str
) -> None:
    hold(zk_sessions(), f"{zk_path}/nodes/0/3")
    waits = Waits()
    with pytest.raises(StartupDeferred, match=re.escape("registered by 10.0.0.9:7609")):
        lease_of(zk, zk_path, waits).take(3, 31)
    assert waits.slept == [1.0, 1.0]
    impatient = Waits()
    with pytest.raises(StartupDeferred):
        lease_of(zk, zk_path, impatient).take(3, 31, patient=False)
    assert impatient.slept == [], "registering again does not wait for a ghost"


def test_a_stop_ends_the_retries_of_a_held_static_id(
    zk: KazooClient, zk_sessions: Callable[[], KazooClient], zk_path: str
) -> None:
    hold(zk_sessions(), f"{zk_path}/nodes/0/3")
    waits = Waits()
    waits.stop = True
    with pytest.raises(StartupInterrupted, match="retrying the held worker id 3"):
        lease_of(zk, zk_path, waits).take(3, 31)
    assert waits.slept == [1.0]


def test_auto_takes_the_lowest_free_id_the_preferred_first_and_passes_over_skipped(
    zk: KazooClient, zk_sessions: Callable[[], KazooClient], zk_path: str
) -> None:
    other = zk_sessions()
    hold(other, f"{zk_path}/nodes/0/0")
    assert lease_of(zk, zk_path, Waits()).take(None, 3) == 1
    second, third = (lease_of(zk_sessions(), zk_path, Waits()) for _ in range(2))
    assert second.take(None, 3, preferred=3) == 3, "the id held last, if free"
    assert third.take(None, 3, preferred=0) == 2, "held by another: the lowest free instead"


def test_auto_with_every_id_leased_is_deferred_saying_how_many_were_skipped(
    zk: KazooClient, zk_sessions: Callable[[], KazooClient], zk_path: str
) -> None:
    other = zk_sessions()
    hold(other, f"{zk_path}/nodes/0/0")
    hold(other, f"{zk_path}/nodes/0/1")
    lease = lease_of(zk, zk_path, Waits())
    with pytest.raises(StartupDeferred, match=r"all 4 worker ids of datacenter 0 are leased .*"
                       r"2 of them skipped for their marks"):  # fmt: skip
        lease.take(None, 3, skipped=frozenset({2, 3}))
    assert zk.exists(f"{zk_path}/nodes/0/2") is None, "a skipped id is not taken"


def test_our_own_znode_from_a_create_whose_reply_was_lost_counts_as_taken(
    zk: KazooClient, zk_path: str
) -> None:
    zk.create(f"{zk_path}/nodes/0/5", ADDRESS.encode(), ephemeral=True, makepath=True)
    assert lease_of(zk, zk_path, Waits()).take(5, 31) == 5


def test_owned_is_false_for_a_znode_gone_or_another_sessions(
    zk: KazooClient, zk_sessions: Callable[[], KazooClient], zk_path: str
) -> None:
    lease = lease_of(zk, zk_path, Waits())
    assert not lease.owned(f"{zk_path}/nodes/0/7", "checking")
    hold(zk_sessions(), f"{zk_path}/nodes/0/7")
    assert not lease.owned(f"{zk_path}/nodes/0/7", "checking")


def test_a_holder_that_cannot_be_read_is_another_node(zk: KazooClient, zk_path: str) -> None:
    assert lease_of(zk, zk_path, Waits()).holder(f"{zk_path}/nodes/0/9") == "another node"


def test_release_deletes_our_registration_and_survives_one_already_gone(
    zk: KazooClient, zk_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    lease = lease_of(zk, zk_path, Waits())
    lease.take(4, 31)
    lease.release(lease.node(4))
    assert zk.exists(lease.node(4)) is None
    lease.release(lease.node(4))
    assert "could not delete" in caplog.text and "expires with the session" in caplog.text
