"""The Thrift server: one event loop per process, many connections, hardened, stopped
gracefully; with ``--http-port``, the HTTP/JSON API's connections on the same loop.

Connections are served on an asyncio loop (uvloop's when it is installed), not a
thread each: at 4+ connections a thread per connection spent a third of the
server's time handing the GIL between threads. What each connection does is in
:mod:`.connection`; this module listens, admits, runs the loop and stops it.

Unlike thriftpy2's ``make_server`` it does not drop a client idle for 3 s (the
idle timeout is a setting), it reports the port it bound (so port 0 works), and
it sets SO_REUSEPORT only when asked (a port clash is otherwise an error, not a
silent second server). At most ``max_connections`` connections are served at
once; it raises its own open-file limit to fit them. TLS handshakes run in the
loop with a time limit. :meth:`ThriftServer.request_shutdown` stops it within a
bounded time: no new connections, calls already received finish and get their
reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .._config.settings import ThriftSettings
from .._errors import ConfigurationError
from .._http.connection import HttpConnection
from .._ids.generator import forbid_waiting
from .._observability.metrics import ConnectionStats, ServiceMetrics
from .._serving.listeners import listen_socket, new_event_loop, started_threads
from .connection import Connection, Shared
from .processor import Processor

__all__ = ["ThriftServer"]

log = logging.getLogger(__name__)

_REJECT_LOG_EVERY_S = 10.0
_WAIT_THREADS = 4  # calls that must wait (clock stepped back, reservation) run on these
_AFTER_ABORT_S = 1.0
_BEAT_EVERY_S = 1.0


class ThriftServer:
    """Serves Thrift calls as ``settings`` say until :meth:`request_shutdown`.

    ``make_processor`` builds the processor of one connection around that
    connection's stats. ``settings.idle_timeout`` closes a connection that
    sends nothing for that long (0: never). ``tls`` serves TLS (with client
    certificates if the context requires them). ``bound``: the Thrift and HTTP
    sockets, bound already (by the node, before its start-up waits); by default
    :meth:`bind` binds them.
    """

    def __init__(
        self,
        make_processor: Callable[[ConnectionStats], Processor],
        metrics: ServiceMetrics,
        settings: ThriftSettings,
        *,
        tls: ssl.SSLContext | None = None,
        backlog: int = 1024,
        heartbeat: Callable[[], None] = lambda: None,
        bound: tuple[socket.socket | None, socket.socket | None] | None = None,
    ) -> None:
        self._make_processor = make_processor
        self._bound = bound
        self._metrics = metrics
        self._settings = settings
        self._tls = tls
        self._backlog = backlog
        self._heartbeat = heartbeat
        self._listener: socket.socket | None = None
        self._http_listener: socket.socket | None = None
        self._listening = False
        self._stop_at: float | None = None  # monotonic; a stop asked before the loop ran
        self._stop_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._shared: Shared | None = None
        self._beat_handle: asyncio.TimerHandle | None = None
        self._last_reject_log = float("-inf")
        self._waits: ThreadPoolExecutor | None = None

    def bind(self) -> tuple[str, int]:
        """Bind, not yet listening (a connection attempt is refused until :meth:`listen`);
        return the address bound (the real port if 0 was asked). Raises
        ``ConfigurationError`` if the address cannot be used."""
        settings = self._settings
        listener, http = self._bound or (None, None)
        if listener is None:
            listener = listen_socket(settings.host, settings.port, reuse_port=settings.reuse_port)
        listener.setblocking(False)
        self._listener = listener
        if settings.http:
            if http is None:
                http = listen_socket(
                    settings.http_host, settings.http_port, reuse_port=settings.reuse_port
                )
            http.setblocking(False)
            self._http_listener = http
        host, port = listener.getsockname()[:2]
        return host, port

    @property
    def http_address(self) -> tuple[str, int] | None:
        """Where the HTTP/JSON API is bound (``--http-port``), or None."""
        if self._http_listener is None:
            return None
        host, port = self._http_listener.getsockname()[:2]
        return host, port

    def listen(self) -> None:
        """Start accepting connections (into the backlog until :meth:`serve_forever`
        serves them): call it once the node can serve. Raises ``ConfigurationError``
        if another socket took the port meanwhile."""
        if self._listener is None:
            raise RuntimeError("bind() first")
        settings = self._settings
        listeners = [(self._listener, settings.host, settings.port)]
        if self._http_listener is not None:
            listeners.append((self._http_listener, settings.http_host, settings.http_port))
        for listener, host, port in listeners:
            try:
                listener.listen(self._backlog)
            except OSError as e:
                # Another socket bound the port while neither listened (SO_REUSEADDR
                # allows that) and listened first: a port in use, found only now.
                raise ConfigurationError(
                    f"cannot listen on {host}:{port}: {e.strerror or e}"
                ) from None
        if self._waits is None:
            self._waits = started_threads(_WAIT_THREADS, "snowflake-wait")
        self._listening = True

    def set_tls(self, tls: ssl.SSLContext) -> None:
        """Serve connections accepted from now on with ``tls`` (those open keep theirs)."""
        self._tls = tls
        if self._shared is not None:
            self._shared.tls = tls

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
        if self._listener is None:
            raise RuntimeError("bind() first")
        if not self._listening:
            self.listen()
        loop = new_event_loop()
        try:
            loop.run_until_complete(self._serve(loop, self._listener, grace_s))
        finally:
            loop.close()
            self._loop = None
            self.close()

    def close(self) -> None:
        """Release the listening sockets and the wait threads; for a server that never
        served, or after serving."""
        for listener in (self._listener, self._http_listener):
            if listener is not None:
                listener.close()
        if self._waits is not None:
            self._waits.shutdown(wait=False, cancel_futures=True)

    async def _serve(
        self, loop: asyncio.AbstractEventLoop, listener: socket.socket, grace_s: float
    ) -> None:
        forbid_waiting()  # generator calls that must wait go to the executor's threads
        try:
            await self._serve_until_stopped(loop, listener, grace_s)
        finally:
            forbid_waiting(False)

    async def _serve_until_stopped(
        self, loop: asyncio.AbstractEventLoop, listener: socket.socket, grace_s: float
    ) -> None:
        settings = self._settings
        executor = self._waits
        assert executor is not None  # started by listen()
        all_closed = asyncio.Event()
        shared = Shared(
            loop=loop,
            make_processor=self._make_processor,
            metrics=self._metrics,
            executor=executor,
            framed=settings.transport == "framed",
            max_frame_size=settings.max_frame_size,
            idle_timeout=settings.idle_timeout,
            tls=self._tls,
            admit=lambda connection: self._admit(shared, connection),
        )
        shared.on_closed = lambda: None if shared.connections else all_closed.set()
        self._shared = shared
        stop = asyncio.Event()
        with self._stop_lock:
            self._stop, self._loop = stop, loop
            if self._stop_at is not None:  # asked before the loop existed
                loop.call_later(max(0.0, self._stop_at - time.monotonic()), stop.set)
        servers = [
            await loop.create_server(
                lambda: Connection(shared), sock=listener, backlog=self._backlog
            )
        ]
        if self._http_listener is not None:
            servers.append(
                await loop.create_server(
                    lambda: HttpConnection(shared),
                    sock=self._http_listener,
                    backlog=self._backlog,
                )
            )
        self._beat(loop)
        try:
            await self._stop.wait()
        finally:
            if self._beat_handle is not None:
                self._beat_handle.cancel()
            for server in servers:
                server.close()  # no new connections
            listener.close()  # in case the loop serves a duplicate of it
            if self._http_listener is not None:
                self._http_listener.close()
            await self._drain(shared, all_closed, grace_s)

    def _beat(self, loop: asyncio.AbstractEventLoop) -> None:
        """Call the heartbeat now and then every second while the loop turns."""
        self._heartbeat()
        self._beat_handle = loop.call_later(_BEAT_EVERY_S, self._beat, loop)

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

    def _admit(self, shared: Shared, connection: Connection) -> bool:
        if len(shared.connections) < self._settings.max_connections:
            shared.connections.add(connection)
            return True
        self._metrics.connections_rejected += 1
        now = time.monotonic()
        if now - self._last_reject_log > _REJECT_LOG_EVERY_S:
            self._last_reject_log = now
            limit = self._settings.max_connections
            log.warning(
                "refusing connections: %d open, --max-connections %d (%d refused so far)",
                limit, limit, self._metrics.connections_rejected,
            )  # fmt: skip
        return False
