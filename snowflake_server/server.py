"""A threaded Thrift server: one thread per connection, stopped gracefully.

Unlike thriftpy2's ``make_server`` it does not drop a client idle for 3 s (the
idle timeout is a setting), it reports the port it bound (so port 0 works),
it never sets SO_REUSEPORT (a port clash is an error, not a silent second
server), and :meth:`ThriftServer.request_shutdown` stops it within a bounded
time: no new connections, calls in flight finish and get their reply.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from thriftpy2.transport import TTransportException

from .handler import Processor
from .metrics import ConnectionStats, ServiceMetrics
from .transports import Transport, binary_protocol, server_socket

__all__ = ["ThriftServer"]

log = logging.getLogger(__name__)


class ThriftServer:
    """Serves Thrift calls on ``host:port`` until :meth:`request_shutdown`.

    ``make_processor`` builds the processor of one connection around that
    connection's stats. ``idle_timeout_s`` closes a connection that sends
    nothing for that long (0: never).
    """

    def __init__(
        self,
        make_processor: Callable[[ConnectionStats], Processor],
        metrics: ServiceMetrics,
        *,
        host: str = "127.0.0.1",
        port: int = 7609,
        transport: Transport = "framed",
        idle_timeout_s: float = 600.0,
        backlog: int = 1024,
    ) -> None:
        self._make_processor = make_processor
        self._metrics = metrics
        self._host = host
        self._port = port
        self._transport: Transport = transport
        self._idle_timeout = idle_timeout_s or None
        self._backlog = backlog
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}

    def bind(self) -> tuple[str, int]:
        """Bind and listen; return the address bound (the real port if 0 was asked)."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self._host, self._port))
            listener.listen(self._backlog)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener = listener
        host, port = listener.getsockname()[:2]
        return host, port

    def request_shutdown(self) -> None:
        """Ask :meth:`serve_forever` to stop. Safe from a signal handler or any thread."""
        self._stopping.set()
        with contextlib.suppress(OSError):  # already woken: the pipe is full or closed
            self._wake_w.send(b"x")

    def serve_forever(self, grace_s: float = 1.5) -> None:
        """Accept and serve until asked to stop, then give calls in flight up to
        ``grace_s`` to finish before returning."""
        listener = self._listener
        if listener is None:
            raise RuntimeError("bind() first")
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping.is_set():
                for key, _ in selector.select():
                    if key.fileobj is listener:
                        self._accept(listener)
        listener.close()
        self._drain(grace_s)
        self.close()

    def close(self) -> None:
        """Release the sockets; for a server that never served, or after serving."""
        if self._listener is not None:
            self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, peer = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # e.g. out of file descriptors: keep serving the others
            log.warning("accept failed: %s", e)
            return
        conn.setblocking(True)
        thread = threading.Thread(
            target=self._serve_connection, args=(conn, peer), name=f"conn-{peer}", daemon=True
        )
        with self._lock:
            self._connections[conn] = thread
        thread.start()

    def _serve_connection(self, conn: socket.socket, peer: object) -> None:
        stats = self._metrics.open_connection()
        try:
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self._idle_timeout)
            protocol = binary_protocol(server_socket(conn), self._transport)
            processor = self._make_processor(stats)
            while not self._stopping.is_set():
                processor.process(protocol, protocol)
        except TTransportException as e:
            if e.type != TTransportException.END_OF_FILE:
                stats.count_exception("protocol_error")
                log.info("closing connection from %s: %s", peer, e)
        except OSError as e:  # idle timeout, reset by peer
            log.debug("connection from %s ended: %s", peer, e)
        except Exception as e:  # noqa: BLE001 - bytes that are not Thrift: drop this client only
            stats.count_exception("protocol_error")
            log.info("closing connection from %s: undecodable request: %r", peer, e)
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()
            self._metrics.close_connection(stats)

    def _drain(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        with self._lock:
            connections = dict(self._connections)
        for conn in connections:
            # Ends reads only: a call already read still writes its reply.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
        for thread in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = len(self._connections)
        if left:
            log.warning("%d connection(s) still busy after %.1f s; exiting anyway", left, grace_s)
