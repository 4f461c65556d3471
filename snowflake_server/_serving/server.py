"""The serving core: one event loop per process serving every listening port, whatever
its protocol, with shared flow control, and stopped gracefully.

Connections are served on an asyncio loop (uvloop's when it is installed), not a
thread each: at 4+ connections a thread per connection spent a third of the
server's time handing the GIL between threads. What a connection does is in
:mod:`.connection`, the share of the loop each gets in :mod:`.fairness`; this
module listens, admits, turns the loop and stops it.

Each port is an :class:`Endpoint` (the Thrift port, the HTTP port) with its own
protocol and its own slots: a flood of HTTP connections cannot lock Thrift
clients out, nor the other way round. A full port closes a new connection at
once (counted, logged once per 10 s); the Thrift port keeps a few slots beyond
its limit for the peer checks of a node joining the cluster (``reserve``): a
connection admitted there may only ask for a node's ids, time and layout, and
lives a few seconds. A periodic tick measures the loop's lag and proves that it
turns (:class:`LoopTicks`). :meth:`Server.request_shutdown` stops it within a
bounded time: no new connections, calls already received finish and get their
reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from typing import Protocol as Interface

from .._errors import ConfigurationError
from .._ids.generator import forbid_waiting
from .._observability.metrics import ConnectionStats, ServiceMetrics
from .connection import Connection, Listener, Protocol, Shared
from .fairness import TurnQueue
from .listeners import new_event_loop, started_threads
from .native import NativeListener, NativeThreads, Registry, serve_natively

__all__ = ["NATIVE_FALLBACK", "Endpoint", "LoopTicks", "Native", "Server"]

log = logging.getLogger(__name__)

_REJECT_LOG_EVERY_S = 10.0
_WAIT_THREADS = 4  # calls that must wait (clock stepped back, reservation) run on these
_AFTER_ABORT_S = 1.0
_NATIVE_JOIN_S = 1.0
NATIVE_FALLBACK = "Python serves every request"
"""The end of the line logged when native threads could not start."""
_SWITCH_INTERVAL_S = 0.001
RESERVED_FOR_S = 5.0
"""How long a connection admitted over the limit (peer checks only) may stay."""


_serving_now = [0, 0.0]  # servers serving in this process, the interval before the first
_serving_lock = threading.Lock()


def _switching(serving: bool) -> None:
    """The switch interval is the process's: set by the first server to serve, restored
    by the last to stop (servers may overlap: tests, embedding)."""
    with _serving_lock:
        if serving:
            if not _serving_now[0]:
                _serving_now[1] = sys.getswitchinterval()
                sys.setswitchinterval(min(_serving_now[1], _SWITCH_INTERVAL_S))
            _serving_now[0] += 1
        else:
            _serving_now[0] -= 1
            if not _serving_now[0]:
                sys.setswitchinterval(_serving_now[1])


class LoopTicks(Interface):
    """What watches the loop: told at each tick how late its timer fired."""

    interval_s: float

    def turned(self, late_s: float) -> None: ...

    def rest(self) -> None: ...


@dataclass(frozen=True)
class Native:
    """An endpoint's ``get_id`` answered on native threads (see :mod:`.native`).

    ``machine`` is the native listener (``_core.Listener`` with its threads, not yet
    started; ``constants`` its module), ``registry`` the agents it may serve, each
    registered under ``label_index(label)`` once Python validated it. ``ticks`` watch its
    threads, one each, as ``Server``'s ``ticks`` watches the loop.
    """

    machine: NativeThreads
    constants: Any
    registry: Registry
    label_index: Callable[[str], int]
    ticks: Sequence[LoopTicks] = field(default_factory=tuple)


@dataclass(frozen=True)
class Endpoint:
    """One port the server serves: its socket (bound, not yet listening), its
    protocol, its slots and deadlines.

    ``make_protocol(stats, peer_check_only)`` makes one connection's protocol;
    ``peer_check_only`` is true for a connection admitted into the ``reserve``
    beyond ``max_connections``. ``tls``: whether the server's TLS context applies.
    """

    name: str
    sock: socket.socket
    make_protocol: Callable[[ConnectionStats, bool], Protocol]
    max_connections: int
    idle_timeout: float = 0.0
    request_timeout: float = 0.0
    reserve: int = 0
    tls: bool = True
    native: Native | None = None
    """Answer its get_id on native threads too (framed Thrift without TLS only)."""

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)


class Server:
    """Serves ``endpoints`` until :meth:`request_shutdown`.

    ``tls`` serves TLS on every endpoint that takes it (with client certificates
    if the context requires them). ``ticks`` is told the loop's lag every
    ``ticks.interval_s``. ``clock`` prices the requests (``time.perf_counter``).
    """

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        metrics: ServiceMetrics,
        *,
        tls: ssl.SSLContext | None = None,
        backlog: int = 1024,
        ticks: LoopTicks | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._endpoints = tuple(endpoints)
        self._metrics = metrics
        self._tls = tls
        self._backlog = backlog
        self._ticks = ticks
        self._clock = clock
        self._listening = False
        self._stop_at: float | None = None  # monotonic; a stop asked before the loop ran
        self._stop_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._listeners: list[Listener] = []
        self._tick_handle: asyncio.TimerHandle | None = None
        self._last_reject_log: dict[str, float] = {}
        self._waits: ThreadPoolExecutor | None = None
        self._native: dict[str, Native] = {}  # by endpoint name: those whose threads started
        for endpoint in self._endpoints:
            endpoint.sock.setblocking(False)
            metrics.set_limit(endpoint.name, endpoint.max_connections)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop serving the connections while :meth:`serve_forever` runs
        (work handed to it from another thread: ``call_soon_threadsafe``), else None."""
        return self._loop

    def listen(self) -> None:
        """Start accepting connections (into the backlog until :meth:`serve_forever`
        serves them): call it once the node can serve. Raises ``ConfigurationError``
        if another socket took a port meanwhile."""
        for endpoint in self._endpoints:
            try:
                endpoint.sock.listen(self._backlog)
            except OSError as e:
                # Another socket bound the port while neither listened (SO_REUSEADDR
                # allows that) and listened first: a port in use, found only now.
                host, port = endpoint.address
                raise ConfigurationError(
                    f"cannot listen on {host}:{port}: {e.strerror or e}"
                ) from None
        if self._waits is None:
            self._waits = started_threads(_WAIT_THREADS, "snowflake-wait")
        for endpoint in self._endpoints:
            self._start_native(endpoint)
        self._listening = True

    def _start_native(self, endpoint: Endpoint) -> None:
        """Start ``endpoint``'s native threads (all now: none is started while serving), or
        serve it in Python alone if they cannot start."""
        native = endpoint.native
        if native is None or endpoint.name in self._native:
            return
        try:
            native.machine.start()
        except OSError as e:
            host, port = endpoint.address
            log.warning(
                "native threads for %s:%d could not start (%s): %s",
                host, port, e.strerror or e, NATIVE_FALLBACK,
            )  # fmt: skip
            return
        self._native[endpoint.name] = native

    @property
    def native_endpoints(self) -> frozenset[str]:
        """The endpoints whose get_id native threads answer (their threads started)."""
        return frozenset(self._native)

    def set_tls(self, tls: ssl.SSLContext) -> None:
        """Serve connections accepted from now on with ``tls`` (those open keep theirs)."""
        self._tls = tls
        for listener in self._listeners:
            if listener.tls is not None:
                listener.tls = tls

    def request_shutdown(self, after_s: float = 0.0) -> None:
        """Ask :meth:`serve_forever` to stop, in ``after_s`` seconds (serving on until
        then). Safe from a signal handler or any thread; a later request with a
        shorter delay wins."""
        with self._stop_lock:
            loop, stop = self._loop, self._stop
            if loop is None or stop is None:  # asked before the loop runs: it stops then
                at = time.monotonic() + after_s
                self._stop_at = at if self._stop_at is None else min(self._stop_at, at)
                return
        with contextlib.suppress(RuntimeError):  # the loop has already closed
            if after_s > 0:
                loop.call_soon_threadsafe(loop.call_later, after_s, stop.set)
            else:
                loop.call_soon_threadsafe(stop.set)

    def serve_forever(self, grace_s: float = 1.5) -> None:
        """Accept and serve until asked to stop, then give calls in flight up to
        ``grace_s`` to finish before returning. Runs its own event loop; listens
        first if :meth:`listen` was not called."""
        if not self._listening:
            self.listen()
        loop = new_event_loop()
        try:
            loop.run_until_complete(self._serve(loop, grace_s))
        finally:
            loop.close()
            self._loop = None
            self.close()

    def close(self) -> None:
        """Release the listening sockets, the native threads (joined: no id is issued
        natively once this returns) and the wait threads; for a server that never served,
        or after serving."""
        for endpoint in self._endpoints:
            endpoint.sock.close()
        for name, native in self._native.items():
            if not native.machine.stop(_NATIVE_JOIN_S):
                log.error("native threads of %s still running after %.0f s", name, _NATIVE_JOIN_S)
        if self._waits is not None:
            self._waits.shutdown(wait=False, cancel_futures=True)

    async def _serve(self, loop: asyncio.AbstractEventLoop, grace_s: float) -> None:
        forbid_waiting()  # generator calls that must wait go to the executor's threads
        # A saturated loop holds the GIL; a thread that asks for it waits the switch
        # interval, after each of its system calls. The high-water mark's renewal makes
        # dozens: at the default 5 ms a write took 270 ms under a flood (the mark 0.7 s
        # ahead instead of 1 s, /readyz 503 once), at 1 ms 15 ms. Threads that ask
        # nothing cost nothing.
        _switching(True)
        try:
            await self._serve_until_stopped(loop, grace_s)
        finally:
            _switching(False)
            forbid_waiting(False)
            if self._ticks is not None:
                self._ticks.rest()

    async def _serve_until_stopped(self, loop: asyncio.AbstractEventLoop, grace_s: float) -> None:
        executor = self._waits
        assert executor is not None  # started by listen()
        all_closed = asyncio.Event()
        shared = Shared(
            loop=loop,
            metrics=self._metrics,
            executor=executor,
            turns=TurnQueue(loop, clock=self._clock),
        )
        shared.on_closed = lambda: None if shared.connections else all_closed.set()
        self._metrics.turn_waits = lambda: shared.turns.waits
        stop = asyncio.Event()
        with self._stop_lock:
            self._stop, self._loop = stop, loop
            if self._stop_at is not None:  # asked before the loop existed
                loop.call_later(max(0.0, self._stop_at - time.monotonic()), stop.set)
        servers: list[asyncio.Server | NativeListener] = []
        natives: list[NativeListener] = []
        for endpoint in self._endpoints:
            listener = self._listener(endpoint, shared)
            self._listeners.append(listener)
            native = self._native.get(endpoint.name)
            if native is not None:
                natives.append(
                    serve_natively(
                        loop,
                        native.machine,
                        listener,
                        endpoint.sock,
                        constants=native.constants,
                        registry=native.registry,
                        label_index=native.label_index,
                    )
                )
                servers.append(natives[-1])
                continue
            servers.append(
                await loop.create_server(
                    lambda listener=listener: Connection(listener),  # type: ignore[misc]
                    sock=endpoint.sock,
                    backlog=self._backlog,
                )
            )
        if self._ticks is not None:
            self._tick(loop, self._ticks, loop.time())
        try:
            await stop.wait()
        finally:
            if self._tick_handle is not None:
                self._tick_handle.cancel()
            for server in servers:
                server.close()  # no new connections
            for endpoint in self._endpoints:
                endpoint.sock.close()  # in case the loop serves a duplicate of it
            await self._drain(shared, all_closed, grace_s)
            for native_listener in natives:
                native_listener.stop()  # every connection is gone: no more events

    def _listener(self, endpoint: Endpoint, shared: Shared) -> Listener:
        listener = Listener(
            name=endpoint.name,
            make_protocol=lambda stats: endpoint.make_protocol(stats, False),
            max_connections=endpoint.max_connections,
            idle_timeout=endpoint.idle_timeout,
            request_timeout=endpoint.request_timeout,
            tls=self._tls if endpoint.tls else None,
            shared=shared,
        )
        listener.admit = lambda connection: self._admit(endpoint, listener, connection)
        return listener

    def _tick(self, loop: asyncio.AbstractEventLoop, ticks: LoopTicks, due: float) -> None:
        """Tell ``ticks`` how late this tick came, and each native thread's watch how late
        its own came (if it turned since: a thread stuck is not told, and its watch
        sees it stall), and set the next one."""
        now = loop.time()
        ticks.turned(max(0.0, now - due))
        for native in self._native.values():
            for watch, (since_s, late_s) in zip(native.ticks, native.machine.ticks(), strict=False):
                if since_s <= 2 * watch.interval_s:
                    watch.turned(late_s)
        self._tick_handle = loop.call_at(
            now + ticks.interval_s, self._tick, loop, ticks, now + ticks.interval_s
        )

    async def _drain(self, shared: Shared, all_closed: asyncio.Event, grace_s: float) -> None:
        if not shared.connections:
            return
        all_closed.clear()  # set whenever the last connection went, long before now
        for connection in list(shared.connections):
            connection.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_closed.wait(), grace_s)
        left = list(shared.connections)
        if not left:
            return
        log.warning("%d connection(s) still busy after %.1f s; exiting anyway", len(left), grace_s)
        for connection in left:
            connection.abort()
        # A call still running on a worker thread holds its connection until it has
        # counted (and audited) its ids: give it a moment, so that the generator is not
        # sealed under it.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_closed.wait(), _AFTER_ABORT_S)

    def _admit(self, endpoint: Endpoint, listener: Listener, connection: Connection) -> bool:
        shared = listener.shared
        if len(listener.open) < endpoint.max_connections:
            listener.open.add(connection)
            shared.connections.add(connection)
            return True
        if len(listener.open) < endpoint.max_connections + endpoint.reserve:
            # A peer check must pass however full the node is: it gets a reserved slot,
            # for the peer-check calls only, for a few seconds.
            listener.open.add(connection)
            shared.connections.add(connection)
            connection.reserved(endpoint.make_protocol, RESERVED_FOR_S)
            return True
        self._metrics.count_rejected(endpoint.name)
        now = time.monotonic()
        if now - self._last_reject_log.get(endpoint.name, float("-inf")) > _REJECT_LOG_EVERY_S:
            self._last_reject_log[endpoint.name] = now
            log.warning(
                "refusing %s connections: %d open, the most allowed (%d refused so far)",
                endpoint.name, len(listener.open), self._metrics.rejected(endpoint.name),
            )  # fmt: skip
        return False
