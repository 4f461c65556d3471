"""The event-loop server's connections: pipelined and split requests, floods and
readers that never read, and calls that must wait, on the real server in this
process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snowflake_server._http.connection import HttpConnection
from snowflake_server._thrift.connection import Shared
from snowflake_thrift_client._idl import snowflake_thrift
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.thrift import TApplicationException, TMessageType

from snowflake_server import GeneratorSettings, IdGenerator, ServerSettings, decompose
from snowflake_server._ids.clocks import wall_clock_ms
from snowflake_server._ids.generator import forbid_waiting
from snowflake_server._observability.metrics import NO_METHOD, ServiceMetrics
from snowflake_server._service import SnowflakeHandler
from snowflake_server._serving.listeners import new_event_loop, started_threads
from snowflake_server._thrift import connection
from snowflake_server._thrift.processor import Processor, service_methods
from tests.support.endpoints import encode_call
from tests.support.fakes import FakeTransport
from tests.support.inprocess import InProcessServer
from tests.support.processes import failures, parse_metrics
from tests.support.waiting import run_in_thread, wait_until


@pytest.fixture(scope="module", params=["framed", "buffered"])
def shared(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[InProcessServer]:
    settings_ = ServerSettings(transport=request.param)
    with InProcessServer(settings_, tmp_path_factory.mktemp("state")) as running:
        yield running


def connect(server: InProcessServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _Reader:
    """Reads replies off a socket, as a client of either transport does."""

    def __init__(self, sock: socket.socket, framed: bool) -> None:
        self._sock = sock
        self._framed = framed
        self._buf = b""

    def pending(self) -> bool:
        return bool(self._buf)

    def read(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise EOFError("the server closed the connection")
            self._buf += chunk
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def reply(self) -> tuple[str, int, int, Any]:
        """(method name, message type, seqid, result struct or exception) of the next reply."""
        if self._framed:
            self.read(4)
        protocol: Any = TBinaryProtocol(self)  # type: ignore[no-untyped-call]
        name, mtype, seqid = protocol.read_message_begin()
        service = snowflake_thrift().Snowflake
        if mtype == TMessageType.EXCEPTION:
            result: Any = TApplicationException()
        else:
            result = getattr(service, f"{name}_result")()
        result.read(protocol)
        return name, mtype, seqid, result


_CALLS: dict[str, dict[str, Any]] = {
    "get_id": {"useragent": "pipelined"},
    "get_ids": {"useragent": "pipelined", "count": 3},
    "get_worker_id": {},
    "get_layout": {},
    "get_timestamp": {},
}


def call_bytes(method: str, seqid: int, framed: bool) -> bytes:
    data = bytearray(encode_call(method, framed=framed, **_CALLS[method]))
    at = 4 if framed else 0
    # thriftpy2's client numbers calls from 0: give each its own seqid to check order
    name_length = struct.unpack_from(">i", data, at + 4)[0]
    struct.pack_into(">i", data, at + 8 + name_length, seqid)
    return bytes(data)


@given(
    methods=st.lists(st.sampled_from(sorted(_CALLS)), min_size=1, max_size=40),
    data=st.data(),
)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_pipelined_requests_split_anywhere_get_their_replies_in_order(
    shared: InProcessServer, methods: list[str], data: st.DataObject
) -> None:
    framed = shared.transport == "framed"
    stream = b"".join(call_bytes(m, seqid, framed) for seqid, m in enumerate(methods))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(stream) - 1), max_size=12))))
    with connect(shared) as sock:
        for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            sock.sendall(stream[start:end])
        reader = _Reader(sock, framed)
        last_id = 0
        for seqid, method in enumerate(methods):
            name, mtype, got_seqid, result = reader.reply()
            assert (name, mtype, got_seqid) == (method, TMessageType.REPLY, seqid)
            if method == "get_id":
                assert result.success > last_id
                last_id = result.success
            elif method == "get_ids":
                assert result.success[0] > last_id and len(result.success) == 3
                last_id = result.success[-1]


def test_a_flood_that_never_reads_is_stopped_and_others_are_served(tmp_path: Path) -> None:
    with InProcessServer(ServerSettings(), tmp_path) as server:
        request = call_bytes("get_id", 1, framed=True)
        flood = connect(server)
        flood.settimeout(0.5)
        sent = 0
        chunk = request * 2000  # 70 kB of calls per send
        try:
            while sent < 400 * 1024 * 1024:
                sent += flood.send(chunk)
        except TimeoutError:
            pass  # the server stopped reading: its replies are not being read
        # What the server took in is bounded by the kernel's socket buffers plus its
        # own unsent replies, not by what the client has to send.
        assert sent < 64 * 1024 * 1024
        other = server.raw_client()
        ids = [other.get_id("served-meanwhile") for _ in range(200)]
        assert ids == sorted(set(ids))
        flood.close()


def test_a_call_that_must_wait_waits_on_a_thread_and_others_are_served(tmp_path: Path) -> None:
    server, offset = _stepped_back_server(tmp_path)
    with server:
        waiting, other = server.raw_client(timeout_s=20), server.raw_client()
        first = waiting.get_id("before")
        offset[0] = -1500  # the clock steps back 1.5 s: the next id waits it out
        thread, outcome = run_in_thread(lambda: waiting.get_id("waits"))
        # Another get_id meets the generator held by the waiting call: it waits on a
        # thread of its own, not on the loop.
        queued = server.raw_client(timeout_s=20)
        queued_thread, queued_outcome = run_in_thread(lambda: queued.get_id("queued"))
        # Served while those calls wait: the loop is blocked by neither.
        assert other.get_worker_id() == 0 and other.get_layout().worker_id == 0
        assert not outcome, "the waiting call returned before the others were served"
        thread.join(20)
        queued_thread.join(20)
        assert isinstance(outcome[0], int) and outcome[0] > first
        assert isinstance(queued_outcome[0], int) and queued_outcome[0] != outcome[0]
        metrics = parse_metrics(server.metrics())
        assert metrics['snowflake_clock_backwards_total{action="waited"}'] == 1
        assert metrics['snowflake_ids_by_agent_total{agent="waits"}'] == 1


def test_without_uvloop_the_standard_loop_serves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    with caplog.at_level(logging.INFO, logger="snowflake_server._serving.listeners"):
        loop = new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio")
        assert "uvloop is not installed" in caplog.text
    finally:
        loop.close()


def test_the_server_raises_its_own_open_file_limit_to_fit_its_connections() -> None:
    code = (
        "import resource\n"
        "from snowflake_server._serving.listeners import check_open_files\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "check_open_files(1000)\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    hard = int(out[1])  # -1: RLIM_INFINITY
    assert int(out[0]) == 1128 and (hard == -1 or hard >= 1128)  # else it refuses to start


def test_the_fast_path_counts_each_agent_and_refuses_bad_ones_on_one_connection(
    tmp_path: Path,
) -> None:
    with InProcessServer(ServerSettings(), tmp_path) as server:
        client = server.raw_client()
        agents = ["alpha", "alpha", "beta", "alpha", "bad agent", "beta", "bad agent"]
        ids, refused = [], 0
        for agent in agents:
            try:
                ids.append(client.get_id(agent))
            except Exception as e:  # noqa: BLE001 - the declared error is what is checked
                assert type(e).__name__ == "InvalidUserAgentError"
                refused += 1
        assert ids == sorted(set(ids)) and refused == 2
        metrics = parse_metrics(server.metrics())
        assert metrics['snowflake_ids_by_agent_total{agent="alpha"}'] == 3
        assert metrics['snowflake_ids_by_agent_total{agent="beta"}'] == 2
        assert failures(metrics, "invalid_user_agent") == 2
        assert metrics['snowflake_request_duration_seconds_count{method="get_id"}'] == 7


def _stepped_back_server(
    tmp_path: Path, read_behind: threading.Event | None = None
) -> tuple[InProcessServer, list[int]]:
    """A server whose clock the test steps back by setting ``offset[0]`` (ms);
    ``read_behind`` is set once the server reads the clock stepped back."""
    offset = [0]

    def clock() -> int:
        if offset[0] < 0 and read_behind is not None:
            read_behind.set()
        return wall_clock_ms() + offset[0]

    settings_ = ServerSettings(max_backwards_ms=3000)
    return InProcessServer(settings_, tmp_path, clock=clock), offset


def test_a_client_gone_while_its_call_waits_still_has_its_ids_counted(tmp_path: Path) -> None:
    server, offset = _stepped_back_server(tmp_path)
    with server:
        client = server.raw_client()
        client.get_id("first")
        offset[0] = -800
        with connect(server) as sock:
            sock.sendall(call_bytes("get_ids", 1, framed=True))  # generic path, must wait
            # Gone before its reply: the call still finishes on its thread.
        ids = server.raw_client(timeout_s=20).get_ids("after", 2)  # waits its turn too

        def counted() -> bool:
            metrics = parse_metrics(server.metrics())
            return bool(
                metrics['snowflake_ids_by_agent_total{agent="pipelined"}'] == 3
                and metrics["snowflake_connections_open"] == 2  # the gone one is closed
            )

        assert len(ids) == 2
        wait_until(counted, "the gone client's ids counted and its connection closed")


def test_a_stop_during_a_waiting_call_lets_it_finish(tmp_path: Path) -> None:
    read_behind = threading.Event()
    server, offset = _stepped_back_server(tmp_path, read_behind)
    server.start()
    try:
        server.raw_client().get_worker_id()
        server.close_clients()  # a connection came and went before: the stop must still wait
        client = server.raw_client(timeout_s=20)
        first = client.get_id("first")
        offset[0] = -500
        thread, outcome = run_in_thread(lambda: client.get_id("in-flight"))
        assert read_behind.wait(10), "the call reached the server"
        server.node.request_stop()  # during the call's wait on its thread
        thread.join(20)
        assert isinstance(outcome[0], int) and outcome[0] > first
    finally:
        server.stop()


def test_tls_close_notify_and_a_silent_handshake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = trustme.CA()
    pem = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    monkeypatch.setattr(connection, "HANDSHAKE_TIMEOUT_S", 0.2)
    with InProcessServer(ServerSettings(tls_cert=str(pem)), tmp_path / "state") as server:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        with connect(server) as silent:  # never says hello: closed when its time is up
            assert silent.recv(1) == b""
        raw = connect(server)
        tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
        tls.sendall(call_bytes("get_worker_id", 1, framed=True))
        assert _Reader(tls, framed=True).reply()[:3] == ("get_worker_id", TMessageType.REPLY, 1)
        plain = tls.unwrap()  # close_notify: the server closes its side too
        assert plain.recv(1) == b""
        plain.close()
        tls.close()
        assert failures(parse_metrics(server.metrics()), "tls_error") == 0
        # A client that starts its handshake and hangs up in the middle of it.
        hello = ssl.MemoryBIO()
        client = context.wrap_bio(ssl.MemoryBIO(), hello, server_hostname="127.0.0.1")
        with contextlib.suppress(ssl.SSLWantReadError):
            client.do_handshake()
        with connect(server) as cut:
            cut.sendall(hello.read()[:20])
        wait_until(
            lambda: failures(parse_metrics(server.metrics()), "tls_error") == 1,
            "the cut handshake counted",
        )


def test_an_idle_client_that_never_reads_its_replies_is_cut_off(tmp_path: Path) -> None:
    with InProcessServer(ServerSettings(idle_timeout=0.3), tmp_path) as server:
        with connect(server) as flood:
            flood.settimeout(0.5)
            with contextlib.suppress(TimeoutError, ConnectionResetError, BrokenPipeError):
                while True:  # until the server stops reading: its replies are not read
                    flood.send(call_bytes("get_id", 1, framed=True) * 2000)
            # Quiet now, with replies unsent: closed for good, not left waiting to flush.
            wait_until(
                lambda: parse_metrics(server.metrics())["snowflake_connections_open"] == 0,
                "the stuck connection closed",
            )
        assert server.raw_client().get_id("next") > 0


# -- the connection's states, driven event by event --------------------------------------
# The transport is a fake: each test hands the protocol the events a loop would (data,
# pause, resume, a worker thread's outcome, the idle timer) in an order that a real
# socket produces only by chance.


class _Driven:
    """A Connection on a fake transport, its loop never run: events are called by hand."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        framed: bool = True,
        idle: float = 0.0,
        generator: IdGenerator | None = None,
        kind: type[connection.Connection] = connection.Connection,
    ) -> None:
        self.loop = new_event_loop()
        if generator is None:
            generator = IdGenerator(GeneratorSettings())
        metrics = ServiceMetrics(generator, service_methods(), max_agents=8)
        self.metrics = metrics
        self.shared = Shared(
            loop=self.loop,
            make_processor=lambda stats: Processor(
                SnowflakeHandler(generator, metrics, stats, wall_clock_ms), stats
            ),
            metrics=metrics,
            executor=ThreadPoolExecutor(1),
            framed=framed,
            max_frame_size=65536,
            idle_timeout=idle,
            tls=None,
            admit=self._admit,
        )
        self.transport = FakeTransport()
        self.connection = kind(self.shared)
        self.connection.connection_made(self.transport)  # type: ignore[arg-type]

    def _admit(self, conn: connection.Connection) -> bool:
        self.shared.connections.add(conn)
        return True

    def replies(self) -> list[tuple[str, int, int, Any]]:
        data = b"".join(self.transport.written)
        self.transport.written.clear()
        reader = _Reader(_Bytes(data), self.shared.framed)  # type: ignore[arg-type]
        out = []
        while reader.pending() or data:
            data = b""
            out.append(reader.reply())
        return out

    def close(self) -> None:
        self.shared.executor.shutdown()
        self.loop.close()


class _Bytes:
    """recv() over fixed bytes, for _Reader."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def recv(self, n: int) -> bytes:
        chunk, self._data = self._data[:n], self._data[n:]
        return chunk


@pytest.fixture
def driven(tmp_path: Path) -> Iterator[_Driven]:
    made = _Driven(tmp_path)
    yield made
    made.close()


def test_a_paused_writer_is_served_again_when_it_resumes(driven: _Driven) -> None:
    conn, transport = driven.connection, driven.transport
    conn.pause_writing()
    assert not transport.reading
    conn.data_received(call_bytes("get_worker_id", 1, framed=True))
    assert transport.written == []  # kept until its replies drain
    conn.resume_writing()
    assert [r[:3] for r in driven.replies()] == [("get_worker_id", TMessageType.REPLY, 1)]
    assert transport.reading


def test_more_than_a_turn_of_requests_waits_for_the_next_turn(driven: _Driven) -> None:
    conn, transport = driven.connection, driven.transport
    conn.data_received(call_bytes("get_timestamp", 7, framed=True) * 40)
    assert len(driven.replies()) == 32 and not transport.reading  # the others' turn now
    driven.loop.run_until_complete(asyncio.sleep(0))  # the loop gives it its next turn
    assert len(driven.replies()) == 8 and transport.reading


def test_idle_checks_close_a_quiet_connection_and_abort_one_with_unread_replies(
    tmp_path: Path,
) -> None:
    for unread in (0, 100):
        made = _Driven(tmp_path, idle=60)
        try:
            made.transport.buffered = unread
            conn = made.connection
            conn.data_received(call_bytes("get_worker_id", 1, framed=True))
            conn._check_idle()  # it read since the last look
            for _ in range(3):
                conn._check_idle()
                assert not made.transport.closed
            conn._check_idle()  # a whole timeout without a read
            assert made.transport.closed and made.transport.aborted == bool(unread)
        finally:
            made.close()


def test_a_worker_threads_outcomes(driven: _Driven) -> None:
    conn, transport = driven.connection, driven.transport
    cancelled = driven.loop.create_future()
    cancelled.cancel()
    conn._busy = True
    conn._after_thread(cancelled)  # the server stopped before the call ran: closed
    assert transport.closed and driven.replies() == []


def test_a_worker_threads_refusal_is_sent_before_the_close(tmp_path: Path) -> None:
    made = _Driven(tmp_path)
    try:
        refused = made.loop.create_future()
        refused.set_exception(connection.Refused("protocol_error", "undecodable request: x"))
        made.connection._busy = True
        made.connection._after_thread(refused)
        (reply,) = made.replies()
        assert reply[1] == TMessageType.EXCEPTION and "undecodable" in reply[3].message
        assert made.transport.closed
        failed = made.loop.create_future()
        failed.set_exception(RuntimeError("a bug"))
        other = _Driven(tmp_path)
        try:
            other.connection._busy = True
            other.connection._after_thread(failed)
            assert other.transport.closed and other.replies() == []
        finally:
            other.close()
    finally:
        made.close()


def test_gone_while_busy_is_finished_after_the_thread(driven: _Driven) -> None:
    conn = driven.connection
    conn._busy = True
    conn.connection_lost(ConnectionResetError("reset"))
    assert conn in driven.shared.connections  # its call still counts on a thread
    done = driven.loop.create_future()
    done.set_result(b"never sent")
    conn._after_thread(done)
    assert conn not in driven.shared.connections and driven.transport.written == []


def test_a_drain_serves_what_was_received_then_closes(driven: _Driven) -> None:
    conn, transport = driven.connection, driven.transport
    conn.pause_writing()
    conn.data_received(call_bytes("get_worker_id", 3, framed=True) * 2)
    conn.drain()
    assert [r[2] for r in driven.replies()] == [3, 3] and transport.closed
    conn.drain()  # again: nothing more
    conn.data_received(b"after the close")  # not read
    assert transport.written == []


def test_malformed_buffered_bytes_are_refused_with_a_reply(tmp_path: Path) -> None:
    made = _Driven(tmp_path, framed=False)
    try:
        made.connection.data_received(b"\x80\x01\x00\x01\x00\x00\x00\x01x\x00\x00\x00\x01\x63")
        (reply,) = made.replies()
        assert reply[1] == TMessageType.EXCEPTION and "unknown type code 99" in reply[3].message
        assert made.transport.closed
    finally:
        made.close()


def test_a_call_still_waiting_past_the_grace_is_cut_off_and_issues_nothing_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    read_behind = threading.Event()
    server, offset = _stepped_back_server(tmp_path, read_behind)
    server.start()
    client = server.raw_client(timeout_s=20)
    first = client.get_id("first")
    offset[0] = -2900  # longer than the stop's grace (1.5 s) and the 1 s after it
    thread, outcome = run_in_thread(lambda: client.get_id("too-late"))
    assert read_behind.wait(10), "the call reached the server"
    with caplog.at_level(logging.WARNING, logger="snowflake_server._thrift.server"):
        server.stop()
    thread.join(20)
    assert "still busy after 1.5 s" in caplog.text
    assert not isinstance(outcome[0], int), outcome  # cut off without its reply
    # The seal waited for the call's id (made under the generator's lock), so the final
    # mark covers it: a restart cannot repeat it.
    generator: Any = server.node.mode.source if server.node.mode is not None else None
    assert generator.counters().ids_generated == 2
    newest_ms = generator.seal()
    (state,) = tmp_path.glob("worker-*.json")
    assert json.loads(state.read_text())["high_water_mark_ms"] >= newest_ms
    assert newest_ms >= decompose(first).timestamp_ms


def test_a_call_that_must_wait_with_no_thread_to_run_on_is_refused_and_counted(
    tmp_path: Path,
) -> None:
    now = [wall_clock_ms()]
    generator = IdGenerator(GeneratorSettings(max_backwards_ms=1000), clock=lambda: now[0])
    made = _Driven(tmp_path, generator=generator)
    pool = started_threads(1, "test-wait")
    pool.shutdown()  # it takes no call, as when no thread can be had
    made.shared.executor = pool
    forbid_waiting()  # this thread plays the loop's
    try:
        made.connection.data_received(call_bytes("get_id", 1, framed=True))
        now[0] -= 100  # the next id must wait out 100 ms: on a thread, which there is not
        made.connection.data_received(call_bytes("get_id", 2, framed=True))
        served, refused = made.replies()
        assert served[:3] == ("get_id", TMessageType.REPLY, 1)
        assert refused[1] == TMessageType.EXCEPTION
        assert refused[3].type == TApplicationException.INTERNAL_ERROR
        assert "no thread to run this call on" in refused[3].message
        assert made.transport.closed
        assert made.metrics.totals().exceptions == {("unavailable", NO_METHOD): 1}
    finally:
        forbid_waiting(False)
        made.close()


def test_an_http_call_with_no_thread_to_run_on_is_a_503_unavailable(tmp_path: Path) -> None:
    now = [wall_clock_ms()]
    generator = IdGenerator(GeneratorSettings(max_backwards_ms=1000), clock=lambda: now[0])
    made = _Driven(tmp_path, generator=generator, kind=HttpConnection)
    pool = started_threads(1, "test-wait")
    pool.shutdown()
    made.shared.executor = pool
    forbid_waiting()
    request = b"GET /v1/id?agent=a HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        made.connection.data_received(request)
        assert b"200 OK" in b"".join(made.transport.written)
        made.transport.written.clear()
        now[0] -= 100  # the next id must wait: on a thread, which there is not
        made.connection.data_received(request)
        reply = b"".join(made.transport.written)
        head, body = reply.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: " in head
        assert json.loads(body)["error"] == "unavailable"
        assert made.transport.closed
    finally:
        forbid_waiting(False)
        made.close()
