"""ZooKeeper calls bounded in time, and kazoo's failures in an operator's words."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import (
    ConnectionLoss,
    NoAuthError,
    NoNodeError,
    NotEmptyError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError

from snowflake_server._cluster.zk import (
    children,
    describe_zk_error,
    numeric_order,
    session_id,
    zk_call,
)
from snowflake_server._errors import StartupDeferred
from tests.support.zookeeper import ZooKeeper


@pytest.mark.zookeeper
def test_a_call_to_a_vanished_zookeeper_ends_within_its_timeout(tmp_path: Path) -> None:
    own = ZooKeeper(tmp_path / "zk")
    own.start()
    client = own.client()
    try:
        client.start(timeout=10)
        assert zk_call(client, 1.0, "reading /", "get_children", "/") is not None
        own.stop()
        started = time.monotonic()
        with pytest.raises(StartupDeferred) as info:
            zk_call(client, 1.0, "reading /x", "get", "/x")
        assert time.monotonic() - started < 2
        assert str(info.value) == (
            "ZooKeeper did not answer within 1 s (--zk-connect-timeout) while reading /x; is "
            "it running? start again once it is"
        ), "in words, no exception class"
    finally:
        client.stop()
        client.close()
        own.stop()


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (KazooTimeoutError(), "ZooKeeper did not answer in time"),
        (ConnectionLoss(), "the connection to ZooKeeper was lost"),
        (SessionExpiredError(), "the ZooKeeper session expired"),
        (NoNodeError(), "a znode it needed does not exist (deleted meanwhile?)"),
        (NoAuthError(), "ZooKeeper denied access: a znode's ACL does not let this node in"),
        (NotEmptyError(), "ZooKeeper failed (NotEmptyError)"),
        (NotEmptyError("odd"), "ZooKeeper failed (NotEmptyError: odd)"),
    ],
)
def test_zookeeper_errors_are_said_in_words(error: Exception, said: str) -> None:
    assert describe_zk_error(error) == said


def test_ids_are_listed_in_numeric_order() -> None:
    assert numeric_order(["10", "2", "1", "31", "3"]) == ["1", "2", "3", "10", "31"]


@pytest.mark.zookeeper
def test_children_of_a_missing_znode_are_none(zk: KazooClient) -> None:
    assert children(zk, "/zk-test-no-such-parent", "listing nothing") == []
    zk.ensure_path("/zk-test-children/10")
    zk.ensure_path("/zk-test-children/9")
    assert children(zk, "/zk-test-children", "listing") == ["9", "10"]


@pytest.mark.zookeeper
def test_a_client_without_a_session_has_no_session_id(zookeeper: ZooKeeper) -> None:
    never_started = zookeeper.client()
    try:
        with pytest.raises(StartupDeferred, match="connection dropped while reading x"):
            session_id(never_started, "reading x")
        with pytest.raises(StartupDeferred, match="connection dropped while reading y"):
            session_id(None, "reading y")
    finally:
        never_started.close()
