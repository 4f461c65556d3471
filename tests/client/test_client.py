"""SnowflakeClient: one connection to one server, against real servers in this process
and, for a reply that comes too late, a Thrift server whose handler the test writes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from snowflake_thrift_client import (
    CallFailedError,
    ClockMovedBackwardsError,
    InvalidCountError,
    InvalidUserAgentError,
    RequestError,
    SnowflakeClient,
    SnowflakeError,
    UnavailableError,
    decompose,
)
from snowflake_thrift_client._transports import Transport, binary_protocol, client_socket
from thriftpy2.thrift import TClient

from tests.client.helpers import (
    FakeServer,
    MakeServer,
    ShiftedWallClock,
    counts,
    thrift,
)
from tests.support.endpoints import free_port
from tests.support.inprocess import InProcessServer


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_every_call_over_each_transport(servers: MakeServer, transport: Transport) -> None:
    server = servers(worker_id=5, datacenter_id=2, transport=transport)
    with SnowflakeClient(server.host, server.port, transport=transport, agent="t-1") as client:
        first = client.next_id()
        assert (decompose(first).worker_id, decompose(first).datacenter_id) == (5, 2)
        batch = client.next_ids(4096)
        assert len(batch) == 4096 and batch == sorted(set(batch)) and batch[0] > first
        layout, datacenter_id, worker_id = client.layout()
        assert (datacenter_id, worker_id) == (2, 5)
        assert layout.decompose(batch[-1]).worker_id == 5
        assert (client.worker_id(), client.datacenter_id()) == (5, 2)
        assert abs(client.timestamp() - time.time() * 1000) < 10_000
        assert client.is_open
        assert counts(server)["snowflake_connections_accepted_total"] == 1
    assert not client.is_open


def test_the_layout_of_a_server_with_a_clock_sequence(servers: MakeServer) -> None:
    server = servers(datacenter_id_bits=3, clock_sequence_bits=2, datacenter_id=5)
    with SnowflakeClient(server.host, server.port) as client:
        layout, datacenter_id, _ = client.layout()
        assert (layout.clock_sequence_bits, layout.datacenter_id_bits, datacenter_id) == (2, 3, 5)
        decoded = layout.decompose(client.next_id())
        assert (decoded.clock_sequence, decoded.datacenter_id) == (0, 5)


def test_declared_errors_are_typed_and_keep_the_connection(server: InProcessServer) -> None:
    with SnowflakeClient(server.host, server.port) as client:
        first = client.next_id()
        with pytest.raises(InvalidUserAgentError, match="letter followed by letters") as info:
            client.next_id("1bad")
        assert isinstance(info.value, RequestError) and isinstance(info.value, SnowflakeError)
        with pytest.raises(InvalidCountError, match=r"1\.\.4096"):
            client.next_ids(0)
        with pytest.raises(InvalidCountError):
            client.next_ids(4097)
        assert client.is_open
        assert client.next_id() > first
    assert counts(server)["snowflake_connections_accepted_total"] == 1


def test_a_clock_that_went_back_is_a_typed_error_until_it_catches_up(servers: MakeServer) -> None:
    wall = ShiftedWallClock()
    server = servers(worker_id=1, clock=wall)
    with SnowflakeClient(server.host, server.port) as client:
        assert decompose(client.next_id()).worker_id == 1
        wall.offset_ms = -60_000
        with pytest.raises(ClockMovedBackwardsError, match="Clock moved backwards") as info:
            client.next_id()
        assert info.value.behind_ms >= 59_000
        assert client.is_open, "a declared error keeps the connection"
        wall.offset_ms = 0
        assert decompose(client.next_id()).worker_id == 1, "back once the clock has caught up"
    assert counts(server)["snowflake_connections_accepted_total"] == 1


def test_a_node_that_says_it_is_unavailable_raises_unavailable_error(
    fake: Callable[[object], FakeServer],
) -> None:
    class Unavailable:
        def get_id(self, useragent: str) -> int:
            raise thrift.UnavailableError(message="shutting down")

    down = fake(Unavailable())
    with SnowflakeClient(down.host, down.port) as client:
        with pytest.raises(UnavailableError, match="shutting down"):
            client.next_id()
        assert client.is_open, "a declared error keeps the connection"


class LateFirstReply:
    """Answers the first call only when the test lets it: after the client gave up."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()
        self.replied = threading.Event()

    def get_id(self, useragent: str) -> int:
        self.calls += 1
        if self.calls == 1:
            assert self.release.wait(10), "the test never released the late reply"
            self.replied.set()
            return 111
        return 100 + self.calls


def test_a_timed_out_connection_is_discarded_so_a_late_reply_is_never_read(
    fake: Callable[[object], FakeServer],
) -> None:
    # The pitfall, shown with a bare thriftpy2 client: after a timeout, the next
    # call on the same connection reads the previous call's late reply.
    handler = LateFirstReply()
    server = fake(handler)
    protocol = binary_protocol(client_socket(server.host, server.port, 0.2), "framed")
    protocol.trans.open()
    bare = TClient(thrift.Snowflake, protocol)
    with pytest.raises(TimeoutError):
        bare.get_id("late")
    handler.release.set()
    assert bare.get_id("late") == 111, "the fake server reproduces the pitfall"
    bare.close()

    handler = LateFirstReply()
    server = fake(handler)
    with SnowflakeClient(server.host, server.port, timeout=0.2) as client:
        started = time.monotonic()
        with pytest.raises(CallFailedError, match="timed out") as info:
            client.next_id()
        assert time.monotonic() - started < 0.5
        assert info.value.timed_out and info.value.connected
        assert not client.is_open, "the connection is discarded"
        handler.release.set()
        assert handler.replied.wait(5)  # the late reply is on its way: it must not be read
        assert client.next_id() == 102, "a new connection, and the answer to this call"
    assert server.accepted == 2


def test_unreachable_and_mismatched_servers_are_call_failed_errors(server: InProcessServer) -> None:
    port = free_port()
    with pytest.raises(CallFailedError, match=f"127.0.0.1:{port}: cannot connect") as info:
        SnowflakeClient("127.0.0.1", port).next_id()
    assert not info.value.connected and not info.value.timed_out
    buffered = SnowflakeClient(server.host, server.port, transport="buffered", timeout=2)
    with pytest.raises(CallFailedError) as info:  # a closed connection, or bytes it cannot read
        buffered.next_id()
    assert info.value.connected and not buffered.is_open


def test_a_client_reopens_after_a_failure_and_can_be_opened_early(server: InProcessServer) -> None:
    client = SnowflakeClient(server.host, server.port)
    assert not client.is_open and "closed" in repr(client)
    client.open()
    assert client.is_open and "open" in repr(client)
    assert client.next_id() > 0
    assert counts(server)["snowflake_connections_accepted_total"] == 1, "the one opened early"
    client.close()
    client.close()  # closing twice is harmless
    assert client.next_id() > 0, "used again after close: a new connection"
    assert counts(server)["snowflake_connections_accepted_total"] == 2
    client.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"timeout": float("inf")}, "timeout must be a positive number"),
        ({"connect_timeout": -1}, "connect_timeout must be a positive number"),
        ({"transport": "http"}, "transport must be one of"),
        ({"port": 0}, "port out of range"),
        ({"host": ""}, "not a server address"),
    ],
)
def test_bad_client_arguments_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SnowflakeClient(**kwargs)  # type: ignore[arg-type]
