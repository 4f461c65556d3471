"""A threaded Thrift server: one thread per connection, hardened, stopped gracefully.

Unlike thriftpy2's ``make_server`` it does not drop a client idle for 3 s (the
idle timeout is a setting), it reports the port it bound (so port 0 works),
and it sets SO_REUSEPORT only when asked (a port clash is otherwise an error,
not a silent second server). Against hostile clients: a frame longer than
``max_frame_size`` is refused before any of it is allocated (and a buffered
request reading more than that many bytes is cut off), at most
``max_connections`` connections are served at once, and TLS handshakes run in
the connection's own thread with a time limit, so no client can stall the
accept loop. :meth:`ThriftServer.request_shutdown` stops it within a bounded
time: no new connections, calls in flight finish and get their reply.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from snowflake_thrift_client._transports import Transport, address_family, binary_protocol
from thriftpy2.thrift import TApplicationException, TMessageType
from thriftpy2.transport import TSocket, TTransportException

from .._config.settings import ThriftSettings
from .._errors import ConfigurationError
from .._observability.metrics import ConnectionStats, ServiceMetrics
from .handler import Processor

__all__ = ["FrameTooLarge", "ThriftServer", "listen_socket"]

log = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 5.0
_REJECT_LOG_EVERY_S = 10.0


def listen_socket(
    host: str, port: int, *, reuse_port: bool, backlog: int | None = None
) -> socket.socket:
    """A TCP socket bound to ``host:port``, listening if ``backlog`` is given.

    ``reuse_port`` lets several processes share the port (SO_REUSEPORT); without
    it a port in use is an error, not a silent second server. Raises
    ``ConfigurationError`` naming the address.
    """
    sock = socket.socket(address_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if backlog is not None:
            sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise ConfigurationError(f"cannot listen on {host}:{port}: {e}") from None
    return sock


class FrameTooLarge(TTransportException):
    """A client announced or sent a request larger than the server accepts."""


class _GuardedSocket(TSocket):
    """A server-side socket that refuses oversized requests as the bytes arrive.

    On framed transport it reads each 4-byte frame length as it passes and
    refuses one that is not in 1..limit before the transport sees it (the
    transport would allocate the whole frame at once). On any transport it
    refuses a request that reads more than ``limit`` bytes.
    """

    def __init__(self, conn: socket.socket, limit: int, framed: bool) -> None:
        super().__init__(sock=conn)  # type: ignore[no-untyped-call]  # thriftpy2 is untyped
        self._limit = limit
        self._framed = framed
        self._count = 0
        self._left = 0  # bytes of the current frame still to come
        self._header = b""

    def request_done(self) -> None:
        self._count = 0

    @property
    def mid_request(self) -> bool:
        """Whether some bytes of a request were read and the request is not done: a
        peer that hangs up now truncated its call."""
        return self._count > 0

    def read(self, sz: int) -> bytes:
        # TSocket.read, without its BSD special case; Python retries EINTR itself.
        data: bytes = self.sock.recv(sz)
        if not data:
            raise TTransportException(
                type=TTransportException.END_OF_FILE, message="TSocket read 0 bytes"
            )
        self._count += len(data)
        if self._framed:
            self._scan(data)
        elif self._count > self._limit:
            raise FrameTooLarge(message=f"request exceeds --max-frame-size {self._limit} bytes")
        return data

    def _scan(self, data: bytes) -> None:
        n = len(data)
        if not self._left and not self._header and n > 4:
            # The usual chunk: exactly one whole request frame.
            size = int.from_bytes(data[:4], "big", signed=True)
            if size + 4 == n and 0 < size <= self._limit:
                return
        i = 0
        while i < n:
            if self._left:
                step = min(self._left, n - i)
                self._left -= step
                i += step
                continue
            need = 4 - len(self._header)
            self._header += data[i : i + need]
            i += need
            if len(self._header) == 4:
                size = int.from_bytes(self._header, "big", signed=True)
                self._header = b""
                if not 0 < size <= self._limit:
                    raise FrameTooLarge(
                        message=f"frame of {size} bytes refused: --max-frame-size is "
                        f"{self._limit} bytes"
                    )
                self._left = size


class _Connection:
    __slots__ = ("sock", "thread")

    def __init__(self, sock: socket.socket, thread: threading.Thread) -> None:
        self.sock = sock
        self.thread = thread


class ThriftServer:
    """Serves Thrift calls as ``settings`` say until :meth:`request_shutdown`.

    ``make_processor`` builds the processor of one connection around that
    connection's stats. ``settings.idle_timeout`` closes a connection that
    sends nothing for that long (0: never). ``tls`` serves TLS (with client
    certificates if the context requires them).
    """

    def __init__(
        self,
        make_processor: Callable[[ConnectionStats], Processor],
        metrics: ServiceMetrics,
        settings: ThriftSettings,
        *,
        tls: ssl.SSLContext | None = None,
        backlog: int = 1024,
    ) -> None:
        self._make_processor = make_processor
        self._metrics = metrics
        self._host = settings.host
        self._port = settings.port
        self._transport: Transport = settings.transport
        self._idle_timeout = settings.idle_timeout or None
        self._max_connections = settings.max_connections
        self._max_frame_size = settings.max_frame_size
        self._tls = tls
        self._reuse_port = settings.reuse_port
        self._backlog = backlog
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()
        self._connections: dict[int, _Connection] = {}
        self._next_key = 0
        self._last_reject_log = float("-inf")

    def bind(self) -> tuple[str, int]:
        """Bind and listen; return the address bound (the real port if 0 was asked).
        Raises ``ConfigurationError`` if the address cannot be used."""
        listener = listen_socket(
            self._host, self._port, reuse_port=self._reuse_port, backlog=self._backlog
        )
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
        with self._lock:
            full = len(self._connections) >= self._max_connections
            if not full:
                key = self._next_key
                self._next_key += 1
                thread = threading.Thread(
                    target=self._serve_connection,
                    args=(key, conn, peer),
                    name=f"conn-{peer}",
                    daemon=True,
                )
                self._connections[key] = _Connection(conn, thread)
        if full:
            conn.close()
            self._metrics.connections_rejected += 1
            now = time.monotonic()
            if now - self._last_reject_log > _REJECT_LOG_EVERY_S:
                self._last_reject_log = now
                log.warning(
                    "refusing connections: %d open, --max-connections %d (%d refused so far)",
                    self._max_connections, self._max_connections,
                    self._metrics.connections_rejected,
                )  # fmt: skip
            return
        conn.setblocking(True)
        thread.start()

    def _serve_connection(self, key: int, conn: socket.socket, peer: object) -> None:
        stats = self._metrics.open_connection()
        protocol: Any = None
        guard: _GuardedSocket | None = None
        try:
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                conn = self._handshake(key, conn, stats, peer)
            # A blocking socket with the kernel's timeouts: Python's own timeout
            # mode polls before every read and write, a fifth of a call's cost.
            conn.settimeout(None)
            if self._idle_timeout:
                _kernel_timeouts(conn, self._idle_timeout)
            guard = _GuardedSocket(conn, self._max_frame_size, self._transport == "framed")
            protocol = binary_protocol(guard, self._transport)
            processor = self._make_processor(stats)
            while not self._stopping.is_set():
                processor.process(protocol, protocol)
                guard.request_done()
        except FrameTooLarge as e:
            stats.count_exception("frame_too_large")
            log.info("closing connection from %s: %s", peer, e.message)
            _reply_error(protocol, TApplicationException.PROTOCOL_ERROR, str(e.message))
        except TTransportException as e:
            if e.type != TTransportException.END_OF_FILE:
                stats.count_exception("protocol_error")
                log.info("closing connection from %s: %s", peer, e.message or e)
            elif guard is not None and guard.mid_request:
                # A hang-up between calls is a normal close; one inside a call is not.
                stats.count_exception("protocol_error")
                log.info("closing connection from %s: it hung up in the middle of a call", peer)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError) as e:
            log.debug("closing idle connection from %s: %s", peer, e)  # the kernel timeout
        except ssl.SSLError as e:
            stats.count_exception("tls_error")
            log.info("closing connection from %s: TLS: %s", peer, e)
        except OSError as e:  # reset by peer, handshake timeout
            log.debug("connection from %s ended: %s", peer, e)
        except Exception as e:  # noqa: BLE001 - bytes that are not Thrift: drop this client only
            stats.count_exception("protocol_error")
            log.info("closing connection from %s: undecodable request: %r", peer, e)
        finally:
            with self._lock:
                self._connections.pop(key, None)
            conn.close()
            self._metrics.close_connection(stats)

    def _handshake(
        self, key: int, conn: socket.socket, stats: ConnectionStats, peer: object
    ) -> socket.socket:
        assert self._tls is not None
        conn.settimeout(_HANDSHAKE_TIMEOUT_S)  # a silent client cannot hold a thread for long
        wrapped = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        with self._lock:
            record = self._connections.get(key)
            if record is not None:
                record.sock = wrapped  # shut down the TLS socket at drain time
        try:
            wrapped.do_handshake()
        except BaseException:
            # wrap_socket detached `conn`: closing it closes nothing, so close this one.
            wrapped.close()
            raise
        return wrapped

    def _drain(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        with self._lock:
            connections = list(self._connections.values())
        for connection in connections:
            # Ends reads only: a call already read still writes its reply. The base
            # class's shutdown, so that a TLS socket keeps encrypting that reply.
            with contextlib.suppress(OSError):
                socket.socket.shutdown(connection.sock, socket.SHUT_RD)
        for connection in connections:
            connection.thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = len(self._connections)
        if left:
            log.warning("%d connection(s) still busy after %.1f s; exiting anyway", left, grace_s)


def _kernel_timeouts(conn: socket.socket, seconds: float) -> None:
    """Reads and writes that wait longer than ``seconds`` fail with EAGAIN."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _reply_error(protocol: Any, kind: int, message: str) -> None:
    """Tell the client why its connection is closed, if the socket still takes it."""
    if protocol is None:
        return
    with contextlib.suppress(Exception):
        protocol.write_message_begin("", TMessageType.EXCEPTION, 0)
        TApplicationException(kind, message).write(protocol)
        protocol.write_message_end()
        protocol.trans.flush()
