from __future__ import annotations

import re
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from snowflake_server import ServerSettings
from tests.support.inprocess import InProcessServer
from tests.support.zookeeper import ZkTls, ZooKeeper


@pytest.fixture
def server(tmp_path: Path) -> Iterator[InProcessServer]:
    """The real server with default settings, in a thread of this process, on free
    loopback ports (tests that need a process of its own use ``start_server``)."""
    with InProcessServer(ServerSettings(), tmp_path / "state") as running:
        yield running


@pytest.fixture(scope="module")
def zookeeper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeper]:
    """A real ZooKeeper shared by a test module (each test has its own ``zk_path``)."""
    zk = ZooKeeper(tmp_path_factory.mktemp("zk"))
    zk.start()
    yield zk
    zk.stop()


@pytest.fixture(scope="module")
def tls_zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeper]:
    """A ZooKeeper serving clients over TLS only, requiring a client certificate, shared
    by a test module."""
    directory = tmp_path_factory.mktemp("tls-zk")
    zk = ZooKeeper(directory / "zk", tls=ZkTls.make(directory / "tls"))
    zk.start()
    yield zk
    zk.stop()


@pytest.fixture
def own_zk(tmp_path: Path) -> Iterator[ZooKeeper]:
    """A ZooKeeper this test may stop, restart or wipe."""
    zk = ZooKeeper(tmp_path / "zk")
    zk.start()
    yield zk
    zk.stop()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for systemd, and the NOTIFY_SOCKET naming it."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(15)
        yield sock, str(path)


@pytest.fixture
def zk_sessions(zookeeper: ZooKeeper) -> Iterator[Callable[[], KazooClient]]:
    """Makes ZooKeeper sessions of the test's own, ended after the test."""
    made: list[KazooClient] = []

    def session() -> KazooClient:
        client = zookeeper.client()
        client.start(timeout=10)
        made.append(client)
        return client

    yield session
    for client in made:
        client.stop()
        client.close()


@pytest.fixture
def zk(zk_sessions: Callable[[], KazooClient]) -> KazooClient:
    """A session of the test's own: it looks at znodes, and plays other nodes, through it."""
    return zk_sessions()


@pytest.fixture
def zk_path(request: pytest.FixtureRequest) -> str:
    """A ``--zk-path`` of this test's own, named after it."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:60]
    return f"/test-{name}-{uuid.uuid4().hex[:6]}"
