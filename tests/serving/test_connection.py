"""The serving core's connections (snowflake_server/_serving/connection.py): pipelined
and split requests, floods and readers that never read, calls that must wait, credit
and turns, the idle and request deadlines; on the real server in this process, and
event by event on a fake transport."""

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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from thriftpy2.thrift import TApplicationException, TMessageType

from snowflake_server import GeneratorSettings, IdGenerator, ServerSettings, decompose
from snowflake_server._ids.clocks import wall_clock_ms
from snowflake_server._ids.generator import forbid_waiting
from snowflake_server._observability.metrics import NO_METHOD
from snowflake_server._serving import connection
from snowflake_server._serving.listeners import new_event_loop, started_threads
from snowflake_server._serving.refusal import Refused
from tests.support.endpoints import encode_call
from tests.support.fakes import FakeClock
from tests.support.inprocess import InProcessServer
from tests.support.processes import failures, parse_metrics
from tests.support.serving import Driven, HeldExecutor, StepClock, ThriftReader, one_turn
from tests.support.waiting import run_in_thread, wait_until

OPEN = 'snowflake_connections_open{protocol="thrift"}'


@pytest.fixture(scope="module", params=["framed", "buffered"])
def shared(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[InProcessServer]:
    settings_ = ServerSettings(transport=request.param)
    with InProcessServer(settings_, tmp_path_factory.mktemp("state")) as running:
        yield running


def connect(server: InProcessServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


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
        reader = ThriftReader(sock, framed)
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


@pytest.mark.slow  # a second or more of real time
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


@pytest.mark.slow  # a second or more of real time
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
        assert (
            metrics['snowflake_request_duration_seconds_count{method="get_id",protocol="thrift"}']
            == 7
        )


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


@pytest.mark.slow  # about a second of real time
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
                and metrics['snowflake_connections_open{protocol="thrift"}']
                == 2  # the gone one is closed
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
        assert ThriftReader(tls, framed=True).reply()[:3] == (
            "get_worker_id",
            TMessageType.REPLY,
            1,
        )
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


@pytest.mark.slow  # about a second of real time
def test_an_idle_client_that_never_reads_its_replies_is_cut_off(tmp_path: Path) -> None:
    with InProcessServer(ServerSettings(idle_timeout=0.3), tmp_path) as server:
        with connect(server) as flood:
            flood.settimeout(0.5)
            with contextlib.suppress(TimeoutError, ConnectionResetError, BrokenPipeError):
                while True:  # until the server stops reading: its replies are not read
                    flood.send(call_bytes("get_id", 1, framed=True) * 2000)
            # Quiet now, with replies unsent: closed for good, not left waiting to flush.
            wait_until(
                lambda: parse_metrics(server.metrics())[OPEN] == 0,
                "the stuck connection closed",
            )
        assert server.raw_client().get_id("next") > 0


# -- the connection's states, driven event by event --------------------------------------
# tests/support/serving.py: a Connection on a fake transport, each event (data, pause,
# resume, a worker thread's outcome, a deadline's look, a turn of the loop) called by hand.


@pytest.fixture
def driven() -> Iterator[Driven]:
    made = Driven()
    yield made
    made.close()


def test_a_paused_writer_is_served_again_when_it_resumes(driven: Driven) -> None:
    conn, transport = driven.connection, driven.transport
    conn.pause_writing()
    assert not transport.reading
    conn.data_received(call_bytes("get_worker_id", 1, framed=True))
    assert transport.written == []  # kept until its replies drain
    conn.resume_writing()
    assert [r[:3] for r in driven.replies()] == [("get_worker_id", TMessageType.REPLY, 1)]
    assert transport.reading


def test_a_flood_spends_its_credit_and_is_served_a_quantum_per_turn() -> None:
    # Each request costs 1 of a quantum of 8 (the clock moves 1 per read): the first
    # turn serves 8 requests (the connection's credit), each later one 7 (a quantum
    # less the batch's last look at the clock), and the connection is not read while
    # it waits. The old server served 32 requests per turn, whatever they cost.
    made = Driven(quantum=8)
    try:
        conn, transport = made.connection, made.transport
        conn.data_received(call_bytes("get_timestamp", 7, framed=True) * 40)
        assert len(made.replies()) == 8 and not transport.reading  # the others' turn now
        assert len(made.turns) == 1
        for _ in range(4):
            one_turn(made.loop)  # the turn queue gives it its next quantum
            assert len(made.replies()) == 7 and not transport.reading
        one_turn(made.loop)
        assert len(made.replies()) == 4 and transport.reading and len(made.turns) == 0
        assert made.turns.waits == 5
    finally:
        made.close()


def test_a_request_costing_more_than_its_credit_waits_its_turns_unread() -> None:
    clock = StepClock(step=5)
    made = Driven(quantum=2, clock=clock)
    try:
        conn, transport = made.connection, made.transport
        conn.data_received(call_bytes("get_worker_id", 1, framed=True) * 2)
        # The first request cost 5 (and the batch's last look 5 more): credit -8, the
        # second request waits, and nothing more is read meanwhile.
        assert [r[2] for r in made.replies()] == [1]
        assert conn.credit == -8 and not transport.reading and len(made.turns) == 1
        clock.step = 1
        conn.data_received(call_bytes("get_worker_id", 2, framed=True))  # already in flight
        for _ in range(4):  # overdrawn by 4 quanta: 4 rounds without a turn
            one_turn(made.loop)
            assert made.replies() == [] and not transport.reading
        one_turn(made.loop)
        assert [r[2] for r in made.replies()] == [1, 2] and transport.reading
        assert len(made.turns) == 0
    finally:
        made.close()


def test_a_connection_that_overdrew_on_its_last_request_pays_before_its_next() -> None:
    # One costly request at a time (a client that waits for each reply) pays too: it
    # is not a flood, yet its overdraft is not forgiven when its next request comes.
    clock = StepClock(step=5)
    made = Driven(quantum=2, clock=clock)
    try:
        conn, transport = made.connection, made.transport
        conn.data_received(call_bytes("get_worker_id", 1, framed=True))
        assert [r[2] for r in made.replies()] == [1]
        assert conn.credit == -8 and transport.reading and len(made.turns) == 0  # no work
        clock.step = 1
        conn.data_received(call_bytes("get_worker_id", 2, framed=True))
        assert made.replies() == [] and not transport.reading and len(made.turns) == 1
        for _ in range(4):
            one_turn(made.loop)
        assert made.replies() == []
        one_turn(made.loop)
        assert [r[2] for r in made.replies()] == [2] and transport.reading
    finally:
        made.close()


def test_a_connection_with_credit_left_is_served_at_once_each_time_it_sends() -> None:
    made = Driven(quantum=8)
    try:
        conn = made.connection
        for seqid in range(3):  # 15 requests in all, more than a quantum, 5 at a time
            conn.data_received(call_bytes("get_timestamp", seqid, framed=True) * 5)
            assert [r[2] for r in made.replies()] == [seqid] * 5  # inline: no turn of the loop
        # Each read starts a fresh turn: its credit is back to a quantum, never queued.
        assert made.turns.waits == 0 and made.transport.reading
    finally:
        made.close()


def test_a_new_connection_has_no_credit_its_first_request_waits_for_a_turn() -> None:
    # A flood of new connections, one costly request each, is paced by the queue.
    made = Driven(established=False)
    try:
        conn, transport = made.connection, made.transport
        assert conn.credit == 0
        conn.data_received(call_bytes("get_worker_id", 1, framed=True))
        assert transport.written == [] and not transport.reading and len(made.turns) == 1
        one_turn(made.loop)  # its turn: answered, and read again
        assert [r[:3] for r in made.replies()] == [("get_worker_id", TMessageType.REPLY, 1)]
        assert transport.reading and len(made.turns) == 0
    finally:
        made.close()


def test_a_new_tls_connection_has_no_credit_its_handshake_waits_for_a_turn(
    tmp_path: Path,
) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    made = Driven(tls=context)
    try:
        conn, transport = made.connection, made.transport
        assert conn.credit == 0
        client_context = ssl.create_default_context()
        ca.configure_trust(client_context)
        hello = ssl.MemoryBIO()
        client = client_context.wrap_bio(ssl.MemoryBIO(), hello, server_hostname="127.0.0.1")
        with contextlib.suppress(ssl.SSLWantReadError):
            client.do_handshake()
        conn.data_received(hello.read())
        assert transport.written == [] and not transport.reading and len(made.turns) == 1
        one_turn(made.loop)  # its turn: the handshake is answered
        assert transport.written and transport.reading and not transport.closed
    finally:
        made.close()


def _thrift_timeout_refusal(made: Driven) -> Any:
    (reply,) = made.replies()
    assert reply[1] == TMessageType.EXCEPTION
    return reply[3]


def test_a_request_not_whole_within_the_request_timeout_is_refused_however_it_trickles() -> None:
    made = Driven(request_timeout=1.0)  # looked at every 0.25 s
    try:
        conn, transport = made.connection, made.transport
        partial = call_bytes("get_id", 1, framed=True)[:-1]
        conn.data_received(partial[:1])
        for i in range(1, 5):  # a byte per look: never idle, never whole
            conn.check_deadlines()
            assert not transport.closed, f"closed after {i} looks"
            conn.data_received(partial[i : i + 1])
        conn.check_deadlines()  # a whole --request-timeout since the request's first look
        error = _thrift_timeout_refusal(made)
        assert error.type == TApplicationException.PROTOCOL_ERROR
        assert "--request-timeout 1 s" in error.message
        assert transport.closed and not transport.aborted
        assert made.metrics.totals().exceptions == {("request_timeout", NO_METHOD): 1}
    finally:
        made.close()


def test_a_request_timeout_with_replies_unread_aborts() -> None:
    made = Driven(request_timeout=1.0)
    try:
        made.transport.buffered = 100  # replies the client has not read
        made.connection.data_received(b"\x00\x00")
        for _ in range(5):
            made.connection.check_deadlines()
        assert made.transport.aborted
    finally:
        made.close()


def test_a_client_whose_requests_keep_completing_is_never_cut_by_the_request_timeout() -> None:
    made = Driven(request_timeout=1.0)
    try:
        conn, transport = made.connection, made.transport
        call = call_bytes("get_worker_id", 1, framed=True)
        stream = call * 21
        half = len(call) // 2
        conn.data_received(stream[:half])  # always half a request left over
        for n in range(20):
            start = half + n * len(call)
            conn.data_received(stream[start : start + len(call)])
            conn.check_deadlines()
            conn.check_deadlines()  # 40 looks in all: ten request timeouts
        assert not transport.closed and len(made.replies()) == 20
    finally:
        made.close()


def test_an_http_head_not_whole_within_the_request_timeout_is_a_408() -> None:
    made = Driven(protocol="http", request_timeout=1.0)
    try:
        made.connection.data_received(b"GET /v1/id?agent=a HTTP/1.1\r\nHo")
        for _ in range(4):
            made.connection.check_deadlines()
        assert made.transport.written == []
        made.connection.check_deadlines()
        head, body = made.written().split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head
        assert json.loads(body)["error"] == "request_timeout"
        assert made.transport.closed
        assert made.metrics.totals().exceptions == {("request_timeout", NO_METHOD): 1}
    finally:
        made.close()


def test_idle_checks_close_a_quiet_connection_and_abort_one_with_unread_replies(
    tmp_path: Path,
) -> None:
    for unread in (0, 100):
        made = Driven(idle=60)
        try:
            made.transport.buffered = unread
            conn = made.connection
            conn.data_received(call_bytes("get_worker_id", 1, framed=True))
            conn.check_deadlines()  # it read since the last look
            for _ in range(3):
                conn.check_deadlines()
                assert not made.transport.closed
            conn.check_deadlines()  # a whole timeout without a read
            assert made.transport.closed and made.transport.aborted == bool(unread)
        finally:
            made.close()


def on_a_thread() -> tuple[Driven, Future[Any]]:
    """A connection whose ``get_id`` went to a worker thread (its clock 100 ms behind the
    last id, to be waited out) and waits there: the test settles the call as its thread
    would have."""
    clock = FakeClock(1_700_000_000_000)
    generator = IdGenerator(
        GeneratorSettings(max_backwards_ms=1000), clock=clock, sleep=clock.sleep
    )
    generator.next_id()
    clock.now -= 100  # within the tolerance: the call waits it out, on a thread
    held = HeldExecutor()
    made = Driven(generator=generator, executor=held)
    forbid_waiting()  # as on the serving loop's thread
    try:
        made.connection.data_received(call_bytes("get_id", 1, framed=True))
    finally:
        forbid_waiting(False)
    assert len(held.calls) == 1 and made.replies() == [], "the call waits on a thread"
    return made, held.calls[0]


def settle(made: Driven) -> None:
    """Run the loop's turns until the thread's outcome has reached the connection."""
    for _ in range(3):  # the future's state, then its callback: a turn each
        one_turn(made.loop)


def test_a_worker_threads_outcomes() -> None:
    driven, call = on_a_thread()
    try:
        conn, transport = driven.connection, driven.transport
        assert conn is not None
        call.cancel()  # the server stopped before the call ran: told, closed
        settle(driven)
        [(_, mtype, _, error)] = driven.replies()
        assert mtype == TMessageType.EXCEPTION and "the server is stopping" in error.message
        assert error.type == TApplicationException.INTERNAL_ERROR and transport.closed
    finally:
        driven.close()


def test_a_worker_threads_refusal_is_sent_before_the_close(tmp_path: Path) -> None:
    made, refused = on_a_thread()
    try:
        refused.set_exception(Refused("protocol_error", "undecodable request: x"))
        settle(made)
        (reply,) = made.replies()
        assert reply[1] == TMessageType.EXCEPTION and "undecodable" in reply[3].message
        assert made.transport.closed
        other, failed = on_a_thread()
        try:
            failed.set_exception(RuntimeError("a bug"))  # a bug: an answer all the same
            settle(other)
            [(_, mtype, _, error)] = other.replies()
            assert mtype == TMessageType.EXCEPTION and error.message == "internal error"
            assert error.type == TApplicationException.INTERNAL_ERROR
            assert other.transport.closed
        finally:
            other.close()
    finally:
        made.close()


def test_gone_while_busy_is_finished_after_the_thread() -> None:
    driven, done = on_a_thread()
    try:
        conn = driven.connection
        conn.connection_lost(ConnectionResetError("reset"))
        assert conn in driven.shared.connections  # its call still counts on a thread
        done.set_result(b"never sent")
        settle(driven)
        assert conn not in driven.shared.connections and driven.transport.written == []
    finally:
        driven.close()


def test_a_drain_serves_what_was_received_then_closes(driven: Driven) -> None:
    conn, transport = driven.connection, driven.transport
    conn.pause_writing()
    conn.data_received(call_bytes("get_worker_id", 3, framed=True) * 2)
    conn.drain()  # its client reads nothing: the replies wait, as ever
    assert driven.replies() == [] and not transport.closed
    conn.resume_writing()
    assert [r[2] for r in driven.replies()] == [3, 3] and transport.closed
    conn.drain()  # again: nothing more
    conn.data_received(b"after the close")  # not read
    assert transport.written == []


def test_malformed_buffered_bytes_are_refused_with_a_reply(tmp_path: Path) -> None:
    made = Driven(framed=False)
    try:
        made.connection.data_received(b"\x80\x01\x00\x01\x00\x00\x00\x01x\x00\x00\x00\x01\x63")
        (reply,) = made.replies()
        assert reply[1] == TMessageType.EXCEPTION and "unknown type code 99" in reply[3].message
        assert made.transport.closed
    finally:
        made.close()


@pytest.mark.slow  # seconds of real time
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
    with caplog.at_level(logging.WARNING, logger="snowflake_server._serving.server"):
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
    made = Driven(generator=generator)
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
    made = Driven(generator=generator, protocol="http")
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


# -- what a review of the core found: each a scenario that once went wrong ---------------


def _tls_pair(
    made_tls: ssl.SSLContext, ca: trustme.CA
) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    return client, incoming, outgoing


def test_a_tls_record_trickled_a_byte_at_a_time_meets_the_request_deadline() -> None:
    # The bytes of an unfinished TLS record wait in the TLS session, not in the
    # connection's buffer: they are a request in the making all the same.
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    made = Driven(tls=context, request_timeout=1.0)
    try:
        conn, transport = made.connection, made.transport
        client, incoming, outgoing = _tls_pair(context, ca)
        for _ in range(4):  # the handshake, through the turn queue
            with contextlib.suppress(ssl.SSLWantReadError):
                client.do_handshake()
            if outgoing.pending:
                conn.data_received(outgoing.read())
                one_turn(made.loop)
            incoming.write(made.written())
        client.write(call_bytes("get_worker_id", 1, framed=True))
        record = outgoing.read()
        for i in range(4):  # a byte per look: never idle, never whole
            conn.data_received(record[i : i + 1])
            one_turn(made.loop)
            conn.check_deadlines()
            assert not transport.closed, f"closed after {i + 1} looks"
        conn.data_received(record[4:5])
        one_turn(made.loop)
        conn.check_deadlines()
        assert transport.closed
        assert made.metrics.totals().exceptions == {("request_timeout", NO_METHOD): 1}
    finally:
        made.close()


def test_a_drain_serves_in_turns_not_all_at_once() -> None:
    # Draining (the server's stop, a TLS close_notify, Connection: close) once served
    # everything received in one go, whatever it cost.
    made = Driven(quantum=8)
    try:
        conn, transport = made.connection, made.transport
        conn.data_received(call_bytes("get_timestamp", 7, framed=True) * 20)
        assert len(made.replies()) == 8
        conn.drain()
        for expected in (7, 5):
            one_turn(made.loop)
            assert len(made.replies()) == expected
        assert transport.closed
    finally:
        made.close()


def test_a_call_that_meets_a_busy_generator_tries_again_on_the_loop() -> None:
    # A worker thread's call holds the generator: its clock read waits on a gate.
    in_call, gate = threading.Event(), threading.Event()

    def clock() -> int:
        if threading.current_thread().name == "holder":
            in_call.set()
            gate.wait(10)
        return wall_clock_ms()

    made = Driven(generator=IdGenerator(GeneratorSettings(), clock=clock))
    holder = threading.Thread(target=made.generator.next_id, name="holder")
    holder.start()
    forbid_waiting()  # as on the serving loop's thread
    try:
        conn, transport = made.connection, made.transport
        assert in_call.wait(10), "the holder's call never started"
        conn.data_received(call_bytes("get_id", 1, framed=True))
        assert made.replies() == [] and not transport.reading  # held, and not read
        gate.set()
        holder.join(10)
        made.loop.run_until_complete(asyncio.sleep(0.01))  # its retry, half a ms later
        [(name, mtype, _, result)] = made.replies()
        assert (name, mtype) == ("get_id", TMessageType.REPLY) and result.success > 0
        assert transport.reading
    finally:
        forbid_waiting(False)
        gate.set()
        holder.join(10)
        made.close()


def test_a_deadline_on_a_closing_connection_with_unread_replies_aborts_it_once() -> None:
    made = Driven(request_timeout=1.0)
    try:
        made.transport.buffered = 100  # replies the client has not read
        made.connection.data_received(b"\xff\xff\xff\xff")  # refused: closing
        assert made.transport.closed and not made.transport.aborted
        for _ in range(6):
            made.connection.check_deadlines()
        assert made.transport.aborted
        assert made.metrics.totals().exceptions == {("frame_too_large", NO_METHOD): 1}
    finally:
        made.close()


def test_a_whole_request_held_back_by_its_unread_replies_is_no_late_request() -> None:
    # The request deadline is for a client's own bytes, not for what the server holds.
    made = Driven(request_timeout=1.0)
    try:
        conn, transport = made.connection, made.transport
        conn.pause_writing()  # its client reads nothing
        conn.data_received(call_bytes("get_worker_id", 1, framed=True))
        for _ in range(8):
            conn.check_deadlines()
        assert not transport.closed and made.metrics.totals().exceptions == {}
        conn.resume_writing()
        assert [r[:3] for r in made.replies()] == [("get_worker_id", TMessageType.REPLY, 1)]
    finally:
        made.close()


def test_a_partial_request_held_back_a_while_keeps_its_deadline_count() -> None:
    # Held back by the server, the count waits; it neither runs nor starts over, so a
    # trickler cannot win more time by being held back now and then.
    made = Driven(request_timeout=1.0)  # looked at every 0.25 s: refused at the 5th look
    try:
        conn, transport = made.connection, made.transport
        conn.data_received(b"\x00\x00")  # part of a frame's length
        conn.check_deadlines()
        conn.check_deadlines()
        conn.pause_writing()  # its replies unread: held back
        for _ in range(3):
            conn.check_deadlines()
        assert not transport.closed
        conn.resume_writing()
        conn.check_deadlines()
        conn.check_deadlines()
        assert not transport.closed
        conn.check_deadlines()  # the 5th look at it partial while not held back
        assert transport.closed
        assert made.metrics.totals().exceptions == {("request_timeout", NO_METHOD): 1}
    finally:
        made.close()
