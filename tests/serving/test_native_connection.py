"""The serving core on a native listener in step mode: a :class:`NativeConnection` over a
:class:`NativeTransport`, every event driven by hand.

Each test runs on the Python model of the native listener (tests/support/native_model.py)
and, once it is built, on ``_core.Listener(threads=0)``: the same scenarios, the same
answers. A real socketpair per connection, asyncio's own loop (as :class:`Driven`: one
turn at a time), ``step(0)`` then the events, then a turn of the loop
(:meth:`Native.pump`). What is checked is what the pure server promises, with the lease
granted exactly while the fast path applies: replies in request order, whoever answered
them; a connection's first request through Python; deadlines that see native's reads,
answers and kept bytes; back-pressure that stops native too.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import random
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import given, settings
from thriftpy2.thrift import TApplicationException, TMessageType

from snowflake_server import GeneratorSettings, IdGenerator
from snowflake_server._ids.clocks import wall_clock_ms
from snowflake_server._ids.generator import NativeStateIdGenerator, WouldBlock, forbid_waiting
from snowflake_server._native import native_core
from snowflake_server._observability.metrics import NO_METHOD, ConnectionStats, ServiceMetrics
from snowflake_server._service import SnowflakeHandler
from snowflake_server._serving.connection import Listener, Protocol, Shared
from snowflake_server._serving.fairness import TurnQueue
from snowflake_server._serving.native import NativeConnection, NativeListener, serve_natively
from snowflake_server._thrift.processor import Processor, service_methods
from snowflake_server._thrift.protocol import ThriftProtocol
from tests.server.test_fastpath import get_id_frame
from tests.server.test_native_parser import limits, streams
from tests.serving.test_connection import call_bytes
from tests.support import native_model
from tests.support.native_model import ModelListener, ModelRegistry
from tests.support.serving import ReplayedBytes, StepClock, ThriftReader, one_turn

core: Any = native_core()
LIMIT = 64 * 1024
QUANTUM = 100.0
PEER = ("127.0.0.1", 40000)


def _model_ids(generator: IdGenerator) -> Callable[[], int | None]:
    def ids() -> int | None:
        try:
            return generator.next_id()
        except WouldBlock:
            return None  # SLOW: Python serves it

    return ids


class Native:
    """A native listener (the model or C, in step mode) serving one ``thrift`` listener's
    connections, each from a real socketpair, on asyncio's own loop."""

    def __init__(
        self,
        kind: str,
        *,
        idle: float = 0.0,
        request_timeout: float = 0.0,
        limit: int = LIMIT,
        sock: socket.socket | None = None,
        max_connections: int = 10,
        max_conns: int = 64,
    ) -> None:
        self.kind = kind
        self.loop = asyncio.new_event_loop()
        self.machine: Any
        if kind == "model":
            self.registry: Any = ModelRegistry()
            self.generator: IdGenerator = IdGenerator(GeneratorSettings())
            self.machine = ModelListener(0, self.registry, None, limit, max_conns=max_conns)
            self.machine.set_state(_model_ids(self.generator))
            constants: Any = native_model
        else:
            self.registry = core.AgentRegistry()
            generator = NativeStateIdGenerator(GeneratorSettings())
            generator.native_state.set_gate(math.inf)
            self.generator = generator
            self.machine = core.Listener(
                0, self.registry, core.NativeStats(1), limit, max_conns=max_conns
            )
            self.machine.set_state(generator.native_state)
            constants = core
        self.metrics = ServiceMetrics(self.generator, service_methods(), max_agents=8)
        self.clock = StepClock()
        self.turns = TurnQueue(self.loop, quantum_s=QUANTUM, budget_s=1000.0, clock=self.clock)
        self.shared = Shared(
            loop=self.loop, metrics=self.metrics, executor=ThreadPoolExecutor(1), turns=self.turns
        )
        generator_, metrics = self.generator, self.metrics

        def make(stats: ConnectionStats, peer_check_only: bool = False) -> Protocol:
            handler = SnowflakeHandler(generator_, metrics, stats, wall_clock_ms)
            return ThriftProtocol(
                Processor(handler, stats),
                framed=True,
                limit=limit,
                peer_check_only=peer_check_only,
            )

        self.make_protocol = make
        self.reserve = False  # admit the next connections into the reserve (peer checks only)
        self.listener = Listener("thrift", make, 10, idle, request_timeout, None, self.shared)
        self.listener.admit = self._admit
        self.labels: dict[str, int] = {}
        self.native = NativeListener(
            self.loop,
            self.machine,
            self.listener,
            constants=constants,
            registry=self.registry,
            label_index=lambda label: self.labels.setdefault(label, len(self.labels)),
            sock=sock,
        )
        self.max_connections = max_connections
        self.refused = 0
        self._clients: list[socket.socket] = []

    def _admit(self, conn: Any) -> bool:
        if len(self.listener.open) >= self.max_connections:
            self.refused += 1
            return False
        self.listener.open.add(conn)
        self.shared.connections.add(conn)
        if self.reserve:
            conn.reserved(self.make_protocol, 1000.0)
        return True

    def connect(self, *, established: bool = True) -> tuple[NativeConnection, socket.socket]:
        """A connection and its client's socket; ``established``: it had its first turn
        (credit), as :class:`Driven`'s (a new connection has none)."""
        client, server = socket.socketpair()
        client.settimeout(5)
        self._clients.append(client)
        conn = self.native.connect(server, PEER)
        assert conn is not None
        if established:
            conn.credit = QUANTUM
        return conn, client

    def pump(self) -> None:
        """Native steps, its events, a turn of the loop, until nothing more happens."""
        quiet = 0
        while quiet < 2:
            handled = self.machine.step(0)
            events = self.native.process_events()
            one_turn(self.loop)
            quiet = 0 if handled or events else quiet + 1

    def served(self, conn: NativeConnection) -> int:
        """Frames native answered on ``conn`` (0 once it is gone)."""
        transport = conn.native_transport
        assert transport is not None
        return int(self.machine.served(transport.handle))

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self.pump()
        self.native.stop()
        if self.kind == "model":
            self.machine.stop()
        else:
            self.machine.stop(1.0)
        self.shared.executor.shutdown()
        self.loop.close()


def _kinds() -> list[Any]:
    c = pytest.param(
        "c",
        marks=pytest.mark.skipif(
            core is None or not hasattr(core, "Listener"),
            reason="the native core is not built",
        ),
    )
    return ["model", c]


@pytest.fixture(params=_kinds())
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def native(kind: str) -> Iterator[Native]:
    made = Native(kind)
    yield made
    made.close()


def replies(client: socket.socket, n: int) -> list[tuple[str, int, int, Any]]:
    reader = ThriftReader(client, framed=True)
    return [reader.reply() for _ in range(n)]


def nothing_more(client: socket.socket) -> bool:
    """Nothing more was written to ``client`` (and it is still open)."""
    client.setblocking(False)
    try:
        client.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        client.settimeout(5)
    return False


def closed(client: socket.socket) -> bool:
    return client.recv(1) == b""


def get_id(agent: str, seqid: int) -> bytes:
    return get_id_frame(agent, seqid)


def leased(native: Native, agent: str = "alpha") -> tuple[NativeConnection, socket.socket]:
    """An established connection whose ``agent`` Python has answered once (registering it):
    the lease is granted."""
    conn, client = native.connect()
    client.sendall(get_id(agent, 0))
    native.pump()
    ((name, mtype, seqid, _),) = replies(client, 1)
    assert (name, mtype, seqid) == ("get_id", TMessageType.REPLY, 0)
    assert native.served(conn) == 0  # Python's
    return conn, client


# --- the model itself ------------------------------------------------------------------


@pytest.mark.skipif(core is None, reason="the native core is not built")
@given(stream=streams(), limit=limits)
@settings(max_examples=300, deadline=None)
def test_the_models_scan_is_step_ones(stream: bytes, limit: int) -> None:
    why = {int(core.WHY_LENGTH): "length", int(core.WHY_REQUEST): "request"}
    for k in range(min(len(stream), native_model.NATIVE_MAX_FRAME + 8) + 1):
        result, reason, n = native_model.scan_prefix(stream[:k], limit)
        native_result, native_why, native_n, *_ = core.scan_prefix(stream[:k], limit)
        assert result == native_result, (k, stream[:k])
        if result == native_model.MATCH:
            assert n == native_n
        elif result == native_model.HANDOVER:
            assert reason == why[native_why]


# --- the lease: native serves what Python would, in order ----------------------------------


def test_a_registered_agents_get_ids_are_served_natively_after_its_first(native: Native) -> None:
    conn, client = leased(native)
    assert native.registry.lookup(b"alpha") >= 0
    client.sendall(b"".join(get_id("alpha", s) for s in (1, 2, 3)))
    native.pump()
    got = replies(client, 3)
    assert [(r[0], r[1], r[2]) for r in got] == [
        ("get_id", TMessageType.REPLY, s) for s in (1, 2, 3)
    ]
    ids = [r[3].success for r in got]
    assert ids == sorted(ids) and len(set(ids)) == 3
    assert native.served(conn) == 3 and nothing_more(client)


MIXED = [  # (call, whether native answers it once the lease is back after the call before)
    (get_id("alpha", 1), True),
    (call_bytes("get_layout", 2, framed=True), False),  # another method: Python's
    (get_id("alpha", 3), True),
    (get_id("beta", 4), False),  # an agent not yet registered: Python's (then registered)
    (get_id("alpha", 5), True),
    (get_id("beta", 6), True),
    (call_bytes("get_worker_id", 7, framed=True), False),
    (get_id("alpha", 8), True),
]


@pytest.mark.parametrize("split", [None, 11, 29])
def test_replies_stay_in_order_with_python_served_calls_between(
    native: Native, split: int | None
) -> None:
    """``split``: the stream sent in pieces of so many bytes (frames cut anywhere), else
    one call at a time, each answered before the next is sent."""
    conn, client = leased(native)
    stream = b"".join(call for call, _ in MIXED)
    pieces = (
        [call for call, _ in MIXED]
        if split is None
        else [stream[at : at + split] for at in range(0, len(stream), split)]
    )
    for piece in pieces:
        client.sendall(piece)
        native.pump()
    got = replies(client, len(MIXED))
    assert [r[2] for r in got] == list(range(1, 9))
    assert all(r[1] == TMessageType.REPLY for r in got)
    ids = [r[3].success for r in got if r[0] == "get_id"]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    if split is None:
        # The lease comes back after each call Python answered, the fast path's included.
        assert native.served(conn) == sum(native_ for _, native_ in MIXED)
    else:
        assert 0 < native.served(conn) < len(ids)
    assert nothing_more(client)


def test_the_first_request_of_a_new_connection_goes_through_python(native: Native) -> None:
    native.native.on_agent(b"alpha", "alpha")  # registered on another connection
    conn, client = native.connect(established=False)
    client.sendall(get_id("alpha", 1))
    native.machine.step(0)
    native.native.process_events()
    assert nothing_more(client)  # no credit: it waits for its turn
    native.pump()
    assert [r[2] for r in replies(client, 1)] == [1]
    assert native.served(conn) == 0
    client.sendall(get_id("alpha", 2))  # it has had a turn: the lease is granted
    native.pump()
    assert [r[2] for r in replies(client, 1)] == [2] and native.served(conn) == 1


def test_a_half_close_ends_the_stream_after_every_call_before_it_is_answered(
    native: Native,
) -> None:
    """The peer's end of stream is a place in it: told once the connection reads again
    after the calls before it, however many turns they take (found by review: a close on
    the end of stream came before the queued calls' turns, and they went unanswered)."""
    calls = 3 * int(QUANTUM)  # more than one turn's credit: several rounds of the queue
    _, client = native.connect(established=False)
    client.sendall(b"".join(get_id("beta", seqid) for seqid in range(calls)))
    client.shutdown(socket.SHUT_WR)
    for _ in range(8):  # the native thread reads ahead, to the end, before Python looks
        native.machine.step(0)
    received, closed = bytearray(), False
    client.setblocking(False)
    for _ in range(100):  # the client reads as it goes: its replies do not fill the socket
        native.pump()
        with contextlib.suppress(BlockingIOError):
            while chunk := client.recv(65536):
                received += chunk
            closed = True
        if closed:
            break
    assert closed, "closed once every call before the end was answered"
    seqids = [int.from_bytes(received[i + 18 : i + 22], "big") for i in range(0, len(received), 34)]
    assert seqids == list(range(calls))
    assert native.metrics.totals().exceptions == {}, "not a hang-up in the middle of a call"


def test_a_client_whose_writes_end_mid_frame_is_served_natively_between_python_calls(
    native: Native,
) -> None:
    """Each write ends in the middle of a frame, and every tenth call is Python's: once
    Python has answered one, the start of the next frame is in its buffer, which no read
    would ever leave empty; it goes to native with the lease (grant's prefix), else such a
    client (any pipelining one) would never be served natively again."""
    native.native.on_agent(b"alpha", "alpha")
    conn, client = native.connect()
    calls = 200
    stream = b"".join(
        call_bytes("get_layout", seqid, framed=True) if seqid % 10 == 5 else get_id("alpha", seqid)
        for seqid in range(calls)
    )
    cut = len(get_id("alpha", 0)) * 3 // 2
    received = bytearray()
    client.setblocking(False)
    for start in range(0, len(stream), cut):
        client.sendall(stream[start : start + cut])
        native.pump()
        with contextlib.suppress(BlockingIOError):
            while chunk := client.recv(65536):
                received += chunk
    for _ in range(10):
        native.pump()
        with contextlib.suppress(BlockingIOError):
            while chunk := client.recv(65536):
                received += chunk
    client.setblocking(True)
    reader = ThriftReader(ReplayedBytes(bytes(received)), framed=True)
    got = [reader.reply() for _ in range(calls)]
    assert [r[2] for r in got] == list(range(calls)), "every reply, in order"
    ids = [r[3].success for r in got if r[0] == "get_id"]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert native.served(conn) >= 150, "native answered the get_ids between Python's calls"


def test_a_connection_that_owes_the_loop_is_still_served_natively_after_its_turn(
    native: Native,
) -> None:
    """Native's answers cost the loop nothing: a connection whose Python-served call cost
    more than its credit (a loaded machine prices by wall time) is leased again once that
    call is answered; only what it hands Python waits for its turns."""
    native.native.on_agent(b"alpha", "alpha")
    conn, client = native.connect()
    native.clock.step = 10 * QUANTUM  # every Python-served call costs ten quanta
    client.sendall(call_bytes("get_layout", 1, framed=True))
    native.pump()
    assert [r[2] for r in replies(client, 1)] == [1] and conn.credit <= 0, "it owes"
    client.sendall(b"".join(get_id("alpha", seqid) for seqid in range(2, 12)))
    native.pump()
    assert [r[2] for r in replies(client, 10)] == list(range(2, 12))
    assert native.served(conn) == 10, "native answered them, owing or not"


def test_bytes_on_their_way_to_python_keep_the_lease_from_being_granted(native: Native) -> None:
    native.native.on_agent(b"alpha", "alpha")
    _, client = native.connect(established=False)
    client.sendall(get_id("alpha", 1))
    native.machine.step(0)  # read, not yet taken by Python
    client.sendall(get_id("alpha", 2))
    native.machine.step(0)
    # Python takes both: the first waits for a turn (reading paused), the second is held
    # by the transport until reading resumes.
    native.native.process_events()
    client.sendall(get_id("alpha", 3))
    native.pump()
    got = replies(client, 3)
    assert [r[2] for r in got] == [1, 2, 3]
    ids = [r[3].success for r in got]
    assert ids == sorted(ids)


def test_a_connection_in_the_reserve_is_never_leased(native: Native) -> None:
    native.native.on_agent(b"alpha", "alpha")
    native.reserve = True
    conn, client = native.connect()
    for seqid in range(1, 4):  # each after the last was answered: the fast path would apply
        client.sendall(get_id("alpha", seqid))
        native.pump()
        ((_, mtype, got, result),) = replies(client, 1)
        assert (mtype, got) == (TMessageType.REPLY, seqid)
        assert result.unavailable is not None  # peer checks only: no ids here
    assert native.served(conn) == 0


# --- refusals, drain, hang-ups ---------------------------------------------------------------


def test_a_refusal_is_written_after_the_native_replies_then_the_close(native: Native) -> None:
    conn, client = leased(native)
    client.sendall(get_id("alpha", 1) + get_id("alpha", 2) + b"\x7f\xff\xff\xf0" + b"x" * 40)
    native.pump()
    got = replies(client, 3)
    assert [(r[0], r[2]) for r in got[:2]] == [("get_id", 1), ("get_id", 2)]
    assert got[2][1] == TMessageType.EXCEPTION
    assert got[2][3].type == TApplicationException.PROTOCOL_ERROR
    assert "--max-frame-size" in got[2][3].message
    assert closed(client)
    assert native.metrics.totals().exceptions == {("frame_too_large", NO_METHOD): 1}
    assert conn not in native.shared.connections


def test_a_drain_takes_the_lease_back_and_closes_after_what_was_received(native: Native) -> None:
    conn, client = leased(native)
    partial = get_id("alpha", 2)[:-3]
    client.sendall(get_id("alpha", 1) + partial)
    native.pump()
    assert [r[2] for r in replies(client, 1)] == [1] and native.served(conn) == 1
    transport = conn.native_transport
    assert transport is not None
    forwarded = transport.forwarded()  # its first call, Python's
    conn.drain()
    # The lease is back: the frame native kept went to Python (which drops a partial
    # request at a drain, as ever: only whole ones were received), then the close.
    assert transport.forwarded() == forwarded + len(partial)
    native.pump()
    assert closed(client)
    assert native.metrics.totals().exceptions == {}
    assert conn not in native.shared.connections


def test_a_hang_up_mid_frame_under_the_lease_is_a_protocol_error(native: Native) -> None:
    conn, client = leased(native)
    client.sendall(get_id("alpha", 1) + get_id("alpha", 2)[:-5])
    native.pump()
    assert [r[2] for r in replies(client, 1)] == [1]
    client.close()
    native.pump()
    assert conn not in native.shared.connections
    assert native.metrics.totals().exceptions == {("protocol_error", NO_METHOD): 1}


def test_a_hang_up_between_calls_under_the_lease_is_no_error(native: Native) -> None:
    conn, client = leased(native)
    client.sendall(get_id("alpha", 1))
    native.pump()
    assert [r[2] for r in replies(client, 1)] == [1] and native.served(conn) == 1
    client.close()
    native.pump()
    assert conn not in native.shared.connections
    assert native.metrics.totals().exceptions == {}


# --- deadlines ---------------------------------------------------------------------------


@pytest.fixture
def timed(kind: str) -> Iterator[Native]:
    # Deadlines long enough that the loop's own timers never fire during a test: each
    # look is made by hand, as in test_connection.py (four looks per deadline).
    made = Native(kind, idle=1000.0, request_timeout=1000.0)
    yield made
    made.close()


def test_a_request_trickled_under_the_lease_meets_the_request_deadline(timed: Native) -> None:
    conn, client = leased(timed)
    conn.check_deadlines()  # its first call, Python's, is seen
    partial = get_id("alpha", 1)[:-1]
    client.sendall(partial[:1])
    timed.pump()
    for i in range(1, 5):  # a byte per look: never idle, never whole
        conn.check_deadlines()
        assert nothing_more(client), f"refused after {i} looks"
        client.sendall(partial[i : i + 1])
        timed.pump()
    conn.check_deadlines()  # a whole --request-timeout since its first look
    timed.pump()
    ((_, mtype, _, error),) = replies(client, 1)
    assert mtype == TMessageType.EXCEPTION and "--request-timeout" in error.message
    assert closed(client)
    assert timed.metrics.totals().exceptions == {("request_timeout", NO_METHOD): 1}


def test_requests_that_keep_completing_natively_are_never_cut(timed: Native) -> None:
    conn, client = leased(timed)
    call = get_id("alpha", 1)
    half = len(call) // 2
    client.sendall(call[:half])  # always half a request left over, native's
    for _ in range(12):
        client.sendall(call[half:] + call[:half])
        timed.pump()
        conn.check_deadlines()
        conn.check_deadlines()  # 24 looks: six request timeouts
    assert len(replies(client, 12)) == 12 and nothing_more(client)
    assert timed.served(conn) == 12


def test_the_idle_deadline_sees_native_reads(timed: Native) -> None:
    conn, client = leased(timed)
    for seqid in range(1, 9):  # eight looks, each after a call native answered
        client.sendall(get_id("alpha", seqid))
        timed.pump()
        conn.check_deadlines()
    assert len(replies(client, 8)) == 8 and timed.served(conn) == 8
    for _ in range(4):
        assert nothing_more(client)
        conn.check_deadlines()
    timed.pump()
    assert closed(client)  # a whole idle timeout without a read
    assert timed.metrics.totals().exceptions == {}


# --- back-pressure -------------------------------------------------------------------------


def test_a_client_that_does_not_read_stops_native_and_is_served_once_it_reads(
    native: Native,
) -> None:
    conn, client = leased(native)
    client.setblocking(False)
    stream = b"".join(get_id("alpha", seqid) for seqid in range(1, 20001))
    sent = 0

    def send_some() -> None:
        nonlocal sent
        with contextlib.suppress(BlockingIOError):
            sent += client.send(stream[sent : sent + 65536])

    for _ in range(1000):  # the client writes all it can and reads nothing
        send_some()
        native.pump()
        transport = conn.native_transport
        if transport is not None and transport.writing_paused:  # native's replies passed it
            break
    transport = conn.native_transport
    assert transport is not None
    assert transport.writing_paused and native.machine.out_len(transport.handle) > 65536
    # The lease is back (Python's fast path is off while it cannot write): a frame native
    # had begun went to Python.
    assert not transport.native_pending()
    if native.kind == "model":
        assert not native.machine.leased(transport.handle)
    served = native.served(conn)
    for _ in range(3):  # it sends on: nothing more is read or answered
        send_some()
        native.pump()
    assert native.served(conn) == served and not transport.is_reading()
    # It reads its replies: each in order, its ids increasing, every call answered.
    received = bytearray()
    for _ in range(100000):
        send_some()
        native.pump()
        with contextlib.suppress(BlockingIOError):
            received += client.recv(1 << 20)
        if len(received) == 34 * 20000:
            break
    assert len(received) == 34 * 20000
    seqids = [int.from_bytes(received[i + 18 : i + 22], "big") for i in range(0, len(received), 34)]
    ids = [int.from_bytes(received[i + 25 : i + 33], "big") for i in range(0, len(received), 34)]
    assert seqids == list(range(1, 20001)) and ids == sorted(ids)
    assert native.served(conn) > served  # granted again once its replies drained
    assert native.metrics.totals().exceptions == {} and not transport.writing_paused


def test_the_transport_holds_bytes_while_reading_is_paused_and_delivers_them_later(
    native: Native,
) -> None:
    conn, _ = leased(native)
    transport = conn.native_transport
    assert transport is not None
    seen: list[bytes] = []
    conn.data_received = seen.append  # type: ignore[method-assign,assignment]
    transport.pause_reading()
    transport.data(b"one")
    transport.data(b"two")
    assert seen == [] and not transport.is_reading()
    transport.resume_reading()
    assert seen == []  # not inside the protocol's own call
    transport.data(b"three")  # after the held bytes, never before
    one_turn(native.loop)
    assert seen == [b"onetwothree"]
    transport.data(b"four")
    assert seen[-1] == b"four"


# --- accepting ------------------------------------------------------------------------------


class _OutOfFiles(socket.socket):
    """A listening socket whose next ``failures`` accepts fail as at the open-files limit."""

    failures = 0

    def accept(self) -> tuple[socket.socket, Any]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return super().accept()


@pytest.fixture
def listening(kind: str) -> Iterator[tuple[Native, _OutOfFiles]]:
    sock = _OutOfFiles(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    made = Native(kind, sock=sock, max_connections=1)
    yield made, sock
    made.native.close()
    sock.close()
    made.close()


def _dial(sock: socket.socket) -> socket.socket:
    client = socket.create_connection(sock.getsockname()[:2], timeout=5)
    return client


def test_accepted_connections_are_admitted_by_the_listener_and_the_refused_never_served(
    listening: tuple[Native, _OutOfFiles],
) -> None:
    made, sock = listening
    first, second = _dial(sock), _dial(sock)
    made.pump()  # the loop accepts both: one slot, the second is refused and closed
    assert made.refused == 1 and len(made.listener.open) == 1
    assert closed(second)
    first.sendall(get_id("alpha", 1))
    made.pump()
    ((_, mtype, seqid, result),) = replies(first, 1)
    assert (mtype, seqid) == (TMessageType.REPLY, 1) and result.success
    (conn,) = made.listener.open
    transport = conn.native_transport  # type: ignore[attr-defined]
    assert transport.get_extra_info("peername") == first.getsockname()
    assert transport.get_extra_info("sockname") == sock.getsockname()
    assert transport.get_extra_info("socket") is None
    first.close()
    second.close()
    made.pump()
    assert made.native.connections == 0 and not made.listener.open


def test_out_of_files_accepting_pauses_doubling_and_logs_once(
    listening: tuple[Native, _OutOfFiles], caplog: pytest.LogCaptureFixture
) -> None:
    made, sock = listening
    listener = made.native
    sock.failures = 3
    client = _dial(sock)
    one_turn(made.loop)  # the listening socket is readable: its accept fails
    pauses = []
    for _ in range(3):
        resumes_at = listener.accepting_resumes_at
        assert resumes_at is not None and made.listener.open == set()
        pauses.append(round(resumes_at - made.loop.time(), 1))
        listener.resume_accepting()  # as its timer would, without waiting for it
        one_turn(made.loop)
    assert pauses == [0.1, 0.2, 0.4]
    assert caplog.text.count("cannot accept connections") == 1  # once per 10 s
    made.pump()
    client.sendall(get_id("alpha", 1))
    made.pump()
    assert [r[2] for r in replies(client, 1)] == [1]
    client.close()


def test_a_connection_native_has_no_room_for_is_closed_and_the_others_served(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    made = Native(kind, max_conns=1)
    try:
        conn, client = made.connect()
        extra, server_side = socket.socketpair()
        assert made.native.connect(server_side, PEER) is None
        assert server_side.fileno() == -1  # handed over, then closed by native
        assert extra.recv(1) == b"" and "cannot serve a connection" in caplog.text
        extra.close()
        client.sendall(get_id("alpha", 1))
        made.pump()
        assert [r[2] for r in replies(client, 1)] == [1]
        assert made.listener.open == {conn}
    finally:
        made.close()


# --- the agent hook and the shim's own failures ---------------------------------------------


def test_only_agents_python_validated_are_registered(native: Native) -> None:
    _, client = native.connect()
    bad = "bad agent"  # a space: refused by check_user_agent
    client.sendall(get_id(bad, 1) + get_id("x" * 200, 2))
    native.pump()
    got = replies(client, 2)
    assert [r[3].agent_error is not None for r in got] == [True, True]
    assert len(native.registry) == 0
    client.sendall(get_id("alpha", 3))
    native.pump()
    replies(client, 1)
    assert native.registry.lookup(b"alpha") == 0 and native.labels == {"alpha": 0}


def test_a_failure_in_an_event_ends_its_connection_only(
    native: Native, caplog: pytest.LogCaptureFixture
) -> None:
    conn, client = leased(native)
    other, other_client = leased(native, "beta")

    def broken(data: bytes) -> None:
        raise RuntimeError("a bug")

    conn.data_received = broken  # type: ignore[method-assign]
    client.sendall(call_bytes("get_layout", 1, framed=True))
    other_client.sendall(get_id("beta", 2))
    native.pump()
    assert closed(client)
    assert [r[2] for r in replies(other_client, 1)] == [2]
    assert "failed" in caplog.text
    assert conn not in native.shared.connections and other in native.shared.connections
    exceptions = native.metrics.totals().exceptions
    assert exceptions == {("internal_error", NO_METHOD): 1}


@contextlib.contextmanager
def forbidding_waits() -> Iterator[None]:
    """As the server's loop thread: a generator call that would wait raises WouldBlock."""
    forbid_waiting()
    try:
        yield
    finally:
        forbid_waiting(False)


# --- with native threads ---------------------------------------------------------------------


_ONE_AT_A_TIME = 8


@pytest.mark.skipif(
    core is None or not hasattr(core, "Listener"),
    reason="the native core is not built",
)
def test_native_threads_and_the_loop_serve_pipelining_clients_in_order() -> None:
    """The shim as the server will run it: two native threads, the loop accepting and
    serving what they hand over, eight clients pipelining get_id with other calls and new
    agents between, each sending whole calls in bursts while it reads."""
    generator = NativeStateIdGenerator(GeneratorSettings())
    generator.native_state.set_gate(math.inf)
    registry, stats = core.AgentRegistry(), core.NativeStats(2)
    machine = core.Listener(2, registry, stats, LIMIT)
    machine.set_state(generator.native_state)
    machine.start()
    metrics = ServiceMetrics(generator, service_methods(), max_agents=8)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    rng = random.Random(27)
    plans = []
    for _ in range(8):
        plan = []
        for seqid in range(500):
            pick = rng.random()
            if pick < 0.03:
                plan.append(call_bytes("get_layout", seqid, framed=True))
            elif pick < 0.06:
                plan.append(get_id(f"agent-{rng.randrange(20)}", seqid))
            else:
                plan.append(get_id("alpha", seqid))
        plans.append((plan, [rng.randrange(1, 30) for _ in range(500)]))

    def client(plan: list[bytes], bursts: list[int]) -> list[tuple[str, int, int, Any]]:
        with socket.create_connection(sock.getsockname()[:2], timeout=10) as c:

            def send() -> None:
                pos = 0
                for n in bursts:
                    c.sendall(b"".join(plan[pos : pos + n]))
                    pos += n
                    if pos >= len(plan):
                        return

            sender = threading.Thread(target=send)
            sender.start()
            try:
                got = replies(c, len(plan))
            finally:
                sender.join(10)
            # Then one call at a time on an idle connection: the lease is granted between
            # them (a random pace above may leave every burst to Python on a busy machine).
            for seqid in range(len(plan), len(plan) + _ONE_AT_A_TIME):
                c.sendall(get_id("alpha", seqid))
                got += replies(c, 1)
            return got

    async def serve() -> list[list[tuple[str, int, int, Any]]]:
        loop = asyncio.get_running_loop()
        shared = Shared(
            loop=loop, metrics=metrics, executor=ThreadPoolExecutor(1), turns=TurnQueue(loop)
        )

        def make(stats_: ConnectionStats) -> Protocol:
            handler = SnowflakeHandler(generator, metrics, stats_, wall_clock_ms)
            return ThriftProtocol(Processor(handler, stats_), framed=True, limit=LIMIT)

        listener = Listener("thrift", make, 100, 0.0, 0.0, None, shared)

        def admit(conn: Any) -> bool:
            listener.open.add(conn)
            shared.connections.add(conn)
            return True

        listener.admit = admit
        labels: dict[str, int] = {}
        native = serve_natively(
            loop,
            machine,
            listener,
            sock,
            constants=core,
            registry=registry,
            label_index=lambda label: labels.setdefault(label, len(labels)),
        )
        with ThreadPoolExecutor(8) as clients:
            got = await asyncio.gather(
                *(loop.run_in_executor(clients, client, *plan) for plan in plans)
            )
        native.close()
        native.stop()
        shared.executor.shutdown()
        return list(got)

    try:
        with forbidding_waits():
            results = asyncio.run(serve())
    finally:
        machine.stop(1.0)
        sock.close()
    every_id = []
    for got in results:
        assert [r[2] for r in got] == list(range(500 + _ONE_AT_A_TIME))
        assert all(r[1] == TMessageType.REPLY for r in got)
        ids = [r[3].success for r in got if r[0] == "get_id"]
        assert ids == sorted(ids)
        every_id += ids
    assert len(set(every_id)) == len(every_id)
    assert stats.snapshot(registry)["calls"] > 0  # native served some, Python the rest
    assert metrics.totals().exceptions == {}
