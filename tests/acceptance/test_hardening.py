"""Hostile input and floods against the real server: it shrugs and serves others."""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import thriftpy2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snowflake_thrift_client._idl import snowflake_thrift
from snowflake_thrift_client._transports import Transport
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.thrift import TApplicationException, TMessageType
from thriftpy2.transport import TMemoryBuffer, TTransportException

from tests.support.cgroups import pids_limit_unavailable, thread_limit
from tests.support.endpoints import Endpoints, encode_call, read_to_close
from tests.support.fuzzing import ANSWER_BOUND_S, RequestFuzz
from tests.support.processes import (
    DATA,
    FakeTime,
    ServerProcess,
    failures,
    parse_metrics,
    start_server,
)
from tests.support.waiting import wait_until

thrift = snowflake_thrift()


def _status(server: ServerProcess, field: str) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(field)).split()[1])


def rss_kib(server: ServerProcess) -> int:
    return _status(server, "VmRSS:")


def peak_rss_kib(server: ServerProcess) -> int:
    """The most memory the server has held at once, however briefly (VmHWM)."""
    return _status(server, "VmHWM:")


def threads(server: ServerProcess) -> int:
    return _status(server, "Threads:")


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
    open_ = 'snowflake_connections_open{protocol="thrift"}'
    rejected = 'snowflake_connections_rejected_total{protocol="thrift"}'
    reserve = 8  # slots kept beyond the limit for joining nodes' peer checks (5 s each)
    try:
        active = server.raw_client()
        assert active.get_id("active") > 0
        idle = [socket.create_connection((server.host, server.port)) for _ in range(19 + reserve)]
        wait_until(
            lambda: parse_metrics(server.metrics())[open_] == 20 + reserve,
            "every slot and the reserve taken",
            5,
        )
        for _ in range(10):
            extra = socket.create_connection((server.host, server.port), timeout=5)
            assert extra.recv(1) == b"", "closed at once"
            extra.close()
        assert active.get_id("still-served") > 0
        counts = parse_metrics(server.metrics())
        assert counts[rejected] == 10
        assert counts[open_] == 20 + reserve
        assert counts['snowflake_connections_limit{protocol="thrift"}'] == 20
        for conn in idle:
            conn.close()
        wait_until(
            lambda: parse_metrics(server.metrics())[open_] <= 1,
            "the closed connections counted out",
            5,
        )
        assert server.raw_client().get_id("room-again") > 0
    finally:
        assert server.stop() == 0
    assert "refusing thrift connections: 28 open, the most allowed (1 refused so far)" in (
        server.log()
    )


# -- issue 15: decode bombs, requests over many frames, a host out of threads ----------

_GET_ID = struct.pack(">iI", -2147418111, 6) + b"get_id" + struct.pack(">i", 1)
_AGENT = b"\x0b\x00\x01" + struct.pack(">i", 5) + b"bombs"
_BOMB_LIMIT = 2**20  # --max-frame-size: a megabyte of bytes is allowed, not its work


def _bombs() -> dict[str, bytes]:
    """get_id calls (unframed) that cost a decoder far more than their bytes."""
    nest = b"\x0c\x00\x02" * 60
    structs = _BOMB_LIMIT - 4 - len(_GET_ID + _AGENT + nest) - 8 - 62
    huge = struct.pack(">i", 2**31 - 1)
    return {
        # The issue's: an unknown field, a list of 2^31 elements of a type that does not
        # exist (thriftpy2 loops over the count reading nothing).
        "2^31 of an unknown type": _GET_ID + _AGENT + b"\x0f\x00\x02\x63" + huge + b"\x00",
        "2^31 i64, 16 GiB announced in 5 bytes": _GET_ID + _AGENT + b"\x0f\x00\x02\x0a" + huge,
        # A megabyte of empty structs 60 levels down: a step each, for any decoder.
        "a megabyte of nested empty structs": _GET_ID + _AGENT + nest + b"\x0f\x00\x02\x0c"
        + struct.pack(">i", structs) + b"\x00" * structs + b"\x00" * 62,
    }  # fmt: skip


def _exchange(server: Endpoints, chunks: Iterator[bytes] | list[bytes]) -> bytes:
    """Send ``chunks`` on a new connection, as far as the server reads them; return all
    it answers before closing (a reset after its answer ends it too)."""
    with socket.create_connection((server.host, server.port), timeout=60) as raw:
        try:
            for chunk in chunks:
                raw.sendall(chunk)
            raw.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # it stopped reading and closed: its answer is already on its way
        return read_to_close(raw)


def _application_error(reply: bytes, framed: bool) -> TApplicationException:
    protocol: Any = TBinaryProtocol(TMemoryBuffer(reply[4:] if framed else reply))  # type: ignore[no-untyped-call]
    _, mtype, _ = protocol.read_message_begin()
    assert mtype == TMessageType.EXCEPTION, f"not refused: {reply[:120]!r}"
    error = TApplicationException()
    error.read(protocol)
    return error


class _Prober:
    """A well-behaved client calling get_id without pause on its own connection, until
    :meth:`stop`: its slowest call, which a frozen server shows."""

    def __init__(self, server: Endpoints) -> None:
        self._client = server.raw_client(timeout_s=30)
        self._stop = threading.Event()
        self.calls = 0
        self.slowest = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 300  # stops by itself whatever the test does
        while not self._stop.is_set() and time.monotonic() < deadline:
            started = time.monotonic()
            try:
                self._client.get_id("prober")
            except Exception as e:  # noqa: BLE001 - handed to the test
                self.error = e
                return
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.calls += 1

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(60)
        assert self.error is None, f"the well-behaved client failed: {self.error!r}"
        assert self.calls > 0
        return self.slowest


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_decode_bombs_are_refused_at_once_and_no_other_client_waits(
    transport: Transport,
) -> None:
    framed = transport == "framed"
    server = start_server("--max-frame-size", str(_BOMB_LIMIT), transport=transport)
    try:
        prober = _Prober(server)
        for name, message in _bombs().items():
            payload = struct.pack(">i", len(message)) + message if framed else message
            started = time.monotonic()
            error = _application_error(_exchange(server, [payload]), framed)
            took = time.monotonic() - started
            assert error.type == TApplicationException.PROTOCOL_ERROR, name
            # A safety bound, not a target: refused in milliseconds; before, seconds.
            assert took < 2.0, f"{name}: refused after {took:.1f} s"
        slowest = prober.stop()
        assert slowest < 2.0, f"a well-behaved client waited {slowest:.1f} s"
        counts = parse_metrics(server.metrics())
        assert failures(counts, "protocol_error") + failures(counts, "frame_too_large") == 3
        assert server.raw_client().get_id("after-the-bombs") > 0
    finally:
        assert server.stop() == 0


def _agent_of_128_mib(framed: bool) -> Iterator[bytes]:
    """A get_id whose user agent is announced as 128 MiB and sent in 2,048 pieces of
    64 KiB: frames that each pass --max-frame-size (framed), or one message (buffered)."""
    total, piece = 128 * 2**20, 64 * 1024
    head = _GET_ID + b"\x0b\x00\x01" + struct.pack(">i", total)
    chunk = b"a" * piece
    left = total - (piece - len(head))
    pieces = [head + chunk[len(head) :]]
    while left > 0:
        pieces.append(chunk if left >= piece else chunk[:left])  # one object, not 128 MiB
        left -= len(pieces[-1])
    pieces.append(b"\x00")  # the end of the call's struct
    for data in pieces:
        yield struct.pack(">i", len(data)) + data if framed else data


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_a_128_mib_user_agent_over_many_frames_is_refused_at_its_first(
    transport: Transport,
) -> None:
    framed = transport == "framed"
    server = start_server(transport=transport)
    try:
        prober = _Prober(server)
        before = rss_kib(server)
        answers: list[bytes] = []

        def send() -> None:
            answers.append(_exchange(server, _agent_of_128_mib(framed)))

        senders = [threading.Thread(target=send) for _ in range(3)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(120)
        assert len(answers) == 3
        for answer in answers:
            assert "--max-frame-size 65536 bytes" in str(_application_error(answer, framed))
        grown = peak_rss_kib(server) - before
        assert grown < 20_000, f"the server held {grown:,} KiB more for three such requests"
        slowest = prober.stop()
        assert slowest < 2.0, f"a well-behaved client waited {slowest:.1f} s"
        assert server.raw_client().get_id("after-the-agents") > 0
    finally:
        assert server.stop() == 0


_NO_PIDS_LIMIT = pids_limit_unavailable()


@pytest.mark.skipif(_NO_PIDS_LIMIT is not None, reason=str(_NO_PIDS_LIMIT))
def test_a_server_out_of_threads_serves_answers_its_probes_and_stops(tmp_path: Path) -> None:
    faketime = FakeTime(tmp_path)
    server = start_server("--max-backwards-ms", "1000", env=faketime.env)
    try:
        first = server.raw_client().get_id("before-the-limit")
        with thread_limit(server.process.pid) as limit:
            # From here the server can start no thread: a container at its pids.max.
            for _ in range(20):
                assert server.raw_client().get_id("new-connection") > first
            for path in ("/livez", "/readyz", "/metrics"):
                assert server.http_get(path)[0] == 200, path
            faketime.set("-0.3")  # the next id waits 300 ms, on one of the server's threads
            waited = server.raw_client(timeout_s=10).get_id("must-wait")
            faketime.set("+0")
            assert waited > first
            assert server.raw_client().get_id("after-the-wait") > waited
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(15)
            refused = limit.refused
        assert code == 0, server.log()
        assert "can't start new thread" not in server.log(), f"{refused} thread starts refused"
    finally:
        server.stop()


@pytest.mark.slow  # 300 fuzzed inputs on each transport; make soak runs a minute of them
@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_fuzzed_requests_are_answered_or_closed_and_others_are_served(
    transport: Transport,
) -> None:
    server = start_server(transport=transport)
    try:
        fuzz = RequestFuzz(server)
        fuzz.run(30)  # warm up before measuring memory
        before = rss_kib(server)
        fuzz.run(300)
        assert fuzz.sent >= 300 and fuzz.replies > 0 and fuzz.silent_closes > 0
        assert fuzz.slowest_s < ANSWER_BOUND_S
        grown = rss_kib(server) - before
        assert grown < 20_000, f"memory grew {grown:,} KiB over 300 fuzzed requests"
        assert server.raw_client().get_id("after-the-fuzz") > 0
    finally:
        assert server.stop() == 0
