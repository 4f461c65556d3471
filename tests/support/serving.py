"""The serving core driven event by event: a :class:`Connection` on a fake transport,
its loop run only when a test says so, its requests priced by a clock that counts.

A loop serves a connection in an order that a real socket produces only by chance
(data, pause, resume, a worker thread's outcome, a deadline's look, the turn
queue's visit): each test here calls those events itself.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Literal

from snowflake_thrift_client._idl import snowflake_thrift
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.thrift import TApplicationException, TMessageType

from snowflake_server import GeneratorSettings, IdGenerator
from snowflake_server._http.protocol import HttpProtocol
from snowflake_server._ids.clocks import wall_clock_ms
from snowflake_server._observability.metrics import ConnectionStats, ServiceMetrics
from snowflake_server._service import SnowflakeHandler
from snowflake_server._serving.connection import Connection, Listener, Protocol, Shared
from snowflake_server._serving.fairness import TurnQueue
from snowflake_server._thrift.processor import Processor, service_methods
from snowflake_server._thrift.protocol import ThriftProtocol
from tests.support.fakes import FakeTransport

__all__ = ["Driven", "ReplayedBytes", "StepClock", "ThriftReader", "one_turn"]


class StepClock:
    """A ``perf_counter`` for the turn queue that moves ``step`` seconds at each read.

    The connection reads its clock once before a batch, once per request and once
    after it: a batch of ``n`` requests costs ``(n + 1) * step``, so "so many
    requests per turn" is exact. Whole numbers keep the sums exact in floats.
    """

    def __init__(self, step: float = 1.0) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class HeldExecutor(Executor):
    """Worker threads that run nothing: each call handed to them waits as a ``Future``
    in :attr:`calls` until the test settles it (a result, an exception, a cancel), as
    the call's thread would have."""

    def __init__(self) -> None:
        self.calls: list[Future[Any]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.calls.append(future)
        return future


def one_turn(loop: asyncio.AbstractEventLoop) -> None:
    """Run exactly one turn of asyncio's ``loop``: the callbacks ready now (those they
    schedule wait for the next turn). uvloop's runs two turns this way."""
    loop.call_soon(loop.stop)
    loop.run_forever()


class ThriftReader:
    """Reads Thrift replies off anything with ``recv`` (a socket, :class:`ReplayedBytes`)."""

    def __init__(self, sock: Any, framed: bool) -> None:
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


class ReplayedBytes:
    """recv() over fixed bytes, for :class:`ThriftReader`."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def recv(self, n: int) -> bytes:
        chunk, self._data = self._data[:n], self._data[n:]
        return chunk


class Driven:
    """One :class:`Connection` of a ``thrift`` (framed or buffered) or ``http`` listener,
    on a :class:`FakeTransport`, with the real protocol, processor and generator.

    ``quantum`` and ``clock`` set the turn queue's credit and its price of a request
    (by default a request costs 1 of a quantum of 100: credit never runs out unless a
    test says so). ``peer_check_only`` makes the protocol of a reserved slot.
    ``established``: the connection has had its first turn (a new one has no credit
    until then); a TLS connection is always new.
    """

    def __init__(
        self,
        *,
        protocol: Literal["thrift", "http"] = "thrift",
        framed: bool = True,
        idle: float = 0.0,
        request_timeout: float = 0.0,
        generator: IdGenerator | None = None,
        quantum: float = 100.0,
        budget: float = 1000.0,
        clock: StepClock | None = None,
        tls: ssl.SSLContext | None = None,
        peer_check_only: bool = False,
        max_frame_size: int = 65536,
        established: bool = True,
        executor: Executor | None = None,
    ) -> None:
        # asyncio's own loop, not uvloop's: one_turn must run exactly one turn, and
        # uvloop's stop() lets a second one run first.
        self.loop = asyncio.new_event_loop()
        self.generator = generator or IdGenerator(GeneratorSettings())
        self.metrics = ServiceMetrics(self.generator, service_methods(), max_agents=8)
        self.clock = clock or StepClock()
        self.framed = framed
        self.turns = TurnQueue(self.loop, quantum_s=quantum, budget_s=budget, clock=self.clock)
        self.shared = Shared(
            loop=self.loop,
            metrics=self.metrics,
            executor=executor or ThreadPoolExecutor(1),
            turns=self.turns,
        )
        generator_ = self.generator
        metrics = self.metrics

        def handler(stats: ConnectionStats) -> SnowflakeHandler:
            return SnowflakeHandler(generator_, metrics, stats, wall_clock_ms)

        def make(stats: ConnectionStats) -> Protocol:
            if protocol == "http":
                return HttpProtocol(handler(stats), stats)
            return ThriftProtocol(
                Processor(handler(stats), stats),
                framed=framed,
                limit=max_frame_size,
                peer_check_only=peer_check_only,
            )

        self.listener = Listener(protocol, make, 10, idle, request_timeout, tls, self.shared)
        self.listener.admit = self._admit
        self.transport = FakeTransport()
        self.connection = Connection(self.listener)
        self.connection.connection_made(self.transport)  # type: ignore[arg-type]
        if established and tls is None:
            self.connection.credit = quantum

    def _admit(self, conn: Connection) -> bool:
        self.listener.open.add(conn)
        self.shared.connections.add(conn)
        return True

    def written(self) -> bytes:
        """What was written since the last look."""
        data = b"".join(self.transport.written)
        self.transport.written.clear()
        return data

    def replies(self) -> list[tuple[str, int, int, Any]]:
        """The Thrift replies written since the last look."""
        reader = ThriftReader(ReplayedBytes(self.written()), self.framed)
        out = []
        while True:
            try:
                out.append(reader.reply())
            except EOFError:
                return out

    def close(self) -> None:
        self.shared.executor.shutdown()
        self.loop.close()
