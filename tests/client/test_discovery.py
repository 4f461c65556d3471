"""Servers found at run time: a SnowflakePool fed by a discovery callable (refreshed on
the pool's clock, moved by the test), and ZooKeeperDiscovery against a real ZooKeeper."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError
from snowflake_thrift_client import (
    NoServerAvailableError,
    SnowflakePool,
    ZooKeeperDiscovery,
    decompose,
)

from tests.client.helpers import MakeServer, address, counts
from tests.support.endpoints import free_port
from tests.support.fakes import SecondsClock
from tests.support.inprocess import InProcessServer
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

# -- a discovery callable -------------------------------------------------------------------


def test_servers_can_come_from_a_discovery_callable(
    servers: MakeServer, clock: SecondsClock
) -> None:
    one, two = servers(worker_id=1), servers(worker_id=2)
    current = [address(one)]
    asked: list[float] = []

    def discover() -> list[str]:
        asked.append(clock())
        return list(current)

    with SnowflakePool(discover, refresh_interval=5, clock=clock) as pool:
        assert {decompose(pool.next_id()).worker_id for _ in range(5)} == {1}
        assert pool.servers == [address(one)]
        current[:] = [address(two)]
        clock.advance(4)
        assert {decompose(pool.next_id()).worker_id for _ in range(5)} == {1}, "not yet asked"
        clock.advance(1)
        assert {decompose(pool.next_id()).worker_id for _ in range(5)} == {2}
        assert pool.servers == [address(two)]
    assert asked == [1000.0, 1005.0], "asked once per refresh interval, not per call"
    wait_until(
        lambda: counts(one)['snowflake_connections_open{protocol="thrift"}'] == 0,
        "the server that left to see its idle connection closed",
        timeout_s=10,
    )


def test_a_failing_discovery_keeps_the_last_list(
    server: InProcessServer, clock: SecondsClock, caplog: pytest.LogCaptureFixture
) -> None:
    answers: list[Any] = [[address(server)], RuntimeError("registry down"), []]
    asked = 0

    def discover() -> list[str]:
        nonlocal asked
        asked += 1
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    with (
        caplog.at_level(logging.WARNING, "snowflake_thrift_client"),
        SnowflakePool(discover, refresh_interval=1, clock=clock) as pool,
    ):
        assert pool.next_id() > 0
        for _ in range(2):
            clock.advance(1)
            assert pool.next_id() > 0, "the error, then the empty list, keep the old list"
        assert pool.servers == [address(server)]
    assert asked == 3
    kept = [r.getMessage() for r in caplog.records if "keeping" in r.getMessage()]
    assert len(kept) == 2 and "registry down" in kept[0] and "found no servers" in kept[1]
    with (
        SnowflakePool(lambda: [], refresh_interval=1, clock=clock) as pool,
        pytest.raises(NoServerAvailableError, match="discovery found no servers"),
    ):
        pool.next_id()


def test_a_failed_discovery_is_reported_on_every_call_until_it_recovers(
    server: InProcessServer, clock: SecondsClock
) -> None:
    answers: list[object] = [OSError("registry down"), OSError("registry down"), []]
    asked = 0

    def discover() -> list[str]:
        nonlocal asked
        asked += 1
        answer = answers.pop(0) if answers else [address(server)]
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, list)
        return answer

    with SnowflakePool(discover, refresh_interval=60, clock=clock) as pool:
        for _ in range(3):  # the second call must not fall through to an empty list
            with pytest.raises(NoServerAvailableError, match="server discovery failed"):
                pool.next_id()
        assert asked == 1, "the failure is remembered until the refresh interval has passed"
        clock.advance(60)
        with pytest.raises(NoServerAvailableError, match="registry down"):
            pool.next_id()
        clock.advance(60)
        with pytest.raises(NoServerAvailableError, match="discovery found no servers"):
            pool.next_id()
        clock.advance(60)
        assert pool.next_id() > 0 and asked == 4, "recovered"


# -- ZooKeeperDiscovery ---------------------------------------------------------------------


@pytest.fixture
def registry(zookeeper: ZooKeeper) -> Iterator[tuple[KazooClient, str]]:
    """A kazoo client and a fresh ``--zk-path`` under which the test registers nodes as the
    server does: ``<zk-path>/nodes/<datacenter>/<worker>`` holding ``host:port``."""
    zk = zookeeper.client()
    zk.start()
    yield zk, f"/snowflake-test-{uuid.uuid4().hex[:8]}"
    zk.stop()
    zk.close()


@pytest.mark.zookeeper
def test_zookeeper_discovery_lists_the_registered_nodes(
    zookeeper: ZooKeeper, registry: tuple[KazooClient, str], server: InProcessServer
) -> None:
    zk, path = registry
    with ZooKeeperDiscovery(zookeeper.hosts, path, timeout=5) as discovery:
        assert discovery() == [], "nothing registered yet"
        for dc, worker, found in [(0, 10, "10.0.0.10:7609"), (1, 0, "10.0.1.0:7609"),
                                  (0, 2, address(server))]:  # fmt: skip
            zk.create(f"{path}/nodes/{dc}/{worker}", found.encode(), makepath=True)
        # Datacenters, then workers, in numeric order: worker 2 before worker 10.
        assert discovery() == [address(server), "10.0.0.10:7609", "10.0.1.0:7609"]
        zk.delete(f"{path}/nodes/0/10")
        assert discovery() == [address(server), "10.0.1.0:7609"], "asked anew on each call"
    with ZooKeeperDiscovery(zookeeper.hosts, path, datacenter=0) as only_dc0:
        assert only_dc0() == [address(server)]
        with SnowflakePool(only_dc0) as pool:
            assert pool.next_id() > 0
    with ZooKeeperDiscovery(zookeeper.hosts, path, datacenter=7) as empty:
        assert empty() == []


def test_zookeeper_discovery_fails_within_its_timeout_when_zookeeper_is_unreachable() -> None:
    discovery = ZooKeeperDiscovery(f"127.0.0.1:{free_port()}", timeout=0.2)
    with discovery:
        started = time.monotonic()
        with pytest.raises(KazooTimeoutError):
            discovery()
        assert time.monotonic() - started < 5
        with (
            SnowflakePool(discovery) as pool,
            pytest.raises(NoServerAvailableError, match="server discovery failed"),
        ):
            pool.next_id()
