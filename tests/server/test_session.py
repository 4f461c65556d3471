"""The session timeout ZooKeeper granted (the gate's use of it, against a real
ZooKeeper, is in test_membership)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.serialization import Connect

from snowflake_server._cluster.session import GrantedTimeout, watch_granted_timeout
from tests.support.zookeeper import ZooKeeper

SESSION = 0x1234


def test_nothing_is_known_before_a_connect_reply() -> None:
    granted = GrantedTimeout(10.0)
    assert granted.granted_s is None and granted.for_session(SESSION) is None


def test_the_smaller_of_requested_and_granted_counts_for_that_session_only() -> None:
    granted = GrantedTimeout(10.0)
    granted.record(SESSION, 2000)
    assert granted.for_session(SESSION) == 2.0 and granted.granted_s == 2.0
    assert granted.for_session(SESSION + 1) is None
    granted.record(SESSION + 1, 40000)  # a higher minSessionTimeout: the request counts
    assert granted.for_session(SESSION + 1) == 10.0 and granted.for_session(SESSION) is None


def test_a_difference_is_logged_once_per_session(caplog: pytest.LogCaptureFixture) -> None:
    granted = GrantedTimeout(10.0)
    with caplog.at_level(logging.WARNING, "snowflake_server._cluster.session"):
        granted.record(SESSION, 10000)
        granted.record(SESSION, 2000)
        granted.record(SESSION, 2000)  # a reconnection to the same session
        granted.record(SESSION + 1, 20000)
    assert [r.getMessage().split(",")[0] for r in caplog.records] == [
        "ZooKeeper granted a session timeout of 2 s",
        "ZooKeeper granted a session timeout of 20 s",
    ]


def test_a_client_without_the_handshake_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot see the session timeout"):
        watch_granted_timeout(object(), 10.0)


@pytest.mark.zookeeper
def test_a_real_handshake_is_seen(zookeeper: ZooKeeper) -> None:
    client = KazooClient(hosts=zookeeper.hosts, timeout=120.0)  # above maxSessionTimeout
    granted = watch_granted_timeout(client, 120.0)
    client.start(timeout=10)
    try:
        assert granted.for_session(client.client_id[0]) == 60.0
    finally:
        client.stop()
        client.close()


def test_an_expired_sessions_reply_records_nothing() -> None:
    # The handshake of a session ZooKeeper no longer knows answers time_out 0.
    class Handshake:
        def _invoke(self, timeout: float, request: Any, xid: int | None = None) -> Any:
            return Connect(0, 0, 0, SESSION, b"", False), None

    class Client:
        _connection = Handshake()

    client = Client()
    granted = watch_granted_timeout(client, 10.0)
    client._connection._invoke(1.0, Connect(0, 0, 10000, SESSION, b"", False))
    assert granted.granted_s is None and granted.for_session(SESSION) is None
