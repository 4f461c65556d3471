"""Hostile input and floods against the real server: it shrugs and serves others."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import thriftpy2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snowflake_thrift_client._idl import snowflake_thrift
from snowflake_thrift_client._transports import Transport
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TTransportException

from tests.support.endpoints import Endpoints, encode_call
from tests.support.processes import DATA, ServerProcess, failures, parse_metrics, start_server
from tests.support.waiting import wait_until

thrift = snowflake_thrift()


def rss_kib(server: ServerProcess) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def threads(server: ServerProcess) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads")).split()[1])


def send(server: Endpoints, payload: bytes, timeout_s: float = 5.0) -> bytes:
    """Send raw bytes on a new connection; return all the server says before closing."""
    with socket.create_connection((server.host, server.port), timeout=timeout_s) as raw:
        raw.sendall(payload)
        raw.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := raw.recv(65536):
            reply += chunk
        return reply


@pytest.fixture(scope="module")
def shared_server() -> Iterator[ServerProcess]:
    server = start_server()
    yield server
    assert server.stop() == 0


@pytest.mark.parametrize("announced", [2**31 - 1, 2**30, 65537, 0, -5])
def test_absurd_frame_lengths_are_refused_unread(
    shared_server: ServerProcess, announced: int
) -> None:
    before = rss_kib(shared_server)
    for _ in range(50):
        reply = send(shared_server, struct.pack("!i", announced) + b"\x80\x01\x00\x01" * 8)
        assert b"--max-frame-size is 65536 bytes" in reply, "the client is told why"
    assert rss_kib(shared_server) - before < 10_000, "nothing of the frames was allocated"
    assert shared_server.raw_client().get_id("after-frames") > 0


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_a_megabyte_user_agent_is_refused(transport: Transport) -> None:
    server = start_server(transport=transport)
    try:
        client = server.raw_client()
        with pytest.raises((TApplicationException, TTransportException)) as info:
            client.get_id("a" * 1_000_000)
        if isinstance(info.value, TApplicationException):
            assert info.value.type == TApplicationException.PROTOCOL_ERROR
            assert "--max-frame-size" in str(info.value)
        assert server.raw_client().get_id("normal") > 0
        assert failures(parse_metrics(server.metrics()), "frame_too_large") == 1
    finally:
        assert server.stop() == 0


def test_wrong_argument_types_get_clear_errors(shared_server: ServerProcess) -> None:
    hostile = thriftpy2.load(str(DATA / "hostile.thrift"), module_name="hostile_thrift")
    client = shared_server.raw_client(hostile.Snowflake)
    with pytest.raises(hostile.InvalidUserAgentError, match="user agent missing"):
        client.get_id(42)  # an i32 where a string belongs: the server skips the field
    with pytest.raises(hostile.InvalidUserAgentError, match="not valid UTF-8"):
        client.get_ids(b"\xff\xfe\xfd", "10")
    with pytest.raises(hostile.InvalidCountError, match="got None"):
        client.get_ids(b"valid-agent", "10")  # a string where an i32 belongs
    assert shared_server.raw_client().get_id("fine") > 0


def test_an_http_request_on_the_thrift_port(shared_server: ServerProcess) -> None:
    reply = send(shared_server, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert b"--max-frame-size" in reply  # "GET " read as a frame length: refused unread
    assert shared_server.raw_client().get_id("after-http") > 0


_VALID = [
    encode_call("get_id", useragent="fuzz"),
    encode_call("get_ids", useragent="fuzz", count=7),
    encode_call("get_worker_id"),
    encode_call("get_layout"),
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    message = bytearray(draw(st.sampled_from(_VALID)))
    for _ in range(draw(st.integers(1, 6))):
        action = draw(st.sampled_from(["flip", "cut", "insert", "length"]))
        if action == "flip" and message:
            i = draw(st.integers(0, len(message) - 1))
            message[i] = draw(st.integers(0, 255))
        elif action == "cut" and message:
            del message[draw(st.integers(0, len(message) - 1)) :]
        elif action == "insert":
            i = draw(st.integers(0, len(message)))
            message[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif len(message) >= 4:
            message[0:4] = struct.pack("!i", draw(st.integers(-(2**31), 2**31 - 1)))
    return bytes(message)


_fuzz = settings(
    max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class _Fuzz:
    """Sends each example on its own connection; checks a good client now and then."""

    def __init__(self, server: Endpoints) -> None:
        self.server = server
        self.sent = 0
        self.good = server.raw_client()

    def __call__(self, payload: bytes) -> None:
        send(self.server, payload)
        self.sent += 1
        if self.sent % 100 == 0:
            assert self.good.get_id("well-behaved") > 0


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(mutated(), id="mutated-calls"),
        pytest.param(st.binary(max_size=512), id="random"),
    ],
)
@pytest.mark.slow  # 1,500 hostile inputs each
def test_fuzz_leaves_the_server_serving(strategy: Any) -> None:
    server = start_server()
    try:
        fuzz = _Fuzz(server)
        assert fuzz.good.get_id("first") > 0  # its connection thread runs: part of the baseline
        baseline_threads = threads(server)
        send(server, _VALID[0])  # warm up before measuring memory
        before = rss_kib(server)

        @_fuzz
        @given(payload=strategy)
        def run(payload: bytes) -> None:
            fuzz(payload)

        run()
        assert fuzz.sent >= 1000
        assert server.process.poll() is None
        assert fuzz.good.get_id("still-here") > 0 and server.raw_client().get_id("new") > 0
        assert rss_kib(server) - before < 20_000, "memory does not grow with hostile input"
        # Connection threads end as their sockets close.
        wait_until(lambda: threads(server) <= baseline_threads + 1, "connection threads ended", 5)
    finally:
        assert server.stop() == 0


def test_connections_beyond_the_limit_are_refused_cleanly() -> None:
    server = start_server("--max-connections", "20")
    try:
        active = server.raw_client()
        assert active.get_id("active") > 0
        idle = [socket.create_connection((server.host, server.port)) for _ in range(19)]
        for _ in range(10):
            extra = socket.create_connection((server.host, server.port), timeout=5)
            assert extra.recv(1) == b"", "closed at once"
            extra.close()
        assert active.get_id("still-served") > 0
        counts = parse_metrics(server.metrics())
        assert counts["snowflake_connections_rejected_total"] == 10
        assert counts["snowflake_connections_open"] == 20
        for conn in idle:
            conn.close()
        wait_until(
            lambda: parse_metrics(server.metrics())["snowflake_connections_open"] <= 1,
            "the closed connections counted out",
            5,
        )
        assert server.raw_client().get_id("room-again") > 0
    finally:
        assert server.stop() == 0
    assert "refusing connections: 20 open, --max-connections 20" in server.log()
