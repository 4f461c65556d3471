"""One client connection on the event loop: requests in, replies out, in order.

Each connection serves its requests one at a time and in order, on the loop's
thread. A request is a frame (framed transport) or a message found by the
:class:`~.scanner.MessageScanner` (buffered). A framed ``get_id`` matched from
its bytes takes the fast path; everything else goes through thriftpy2's
processor. A call that would have to wait (a clock stepped back, a reservation
to renew: ``WouldBlock``) is made again on a worker thread while this
connection waits for it and every other connection goes on.

Fairness and memory: a connection serves at most ``_BATCH`` requests per turn
of the loop, then yields to the others; it stops reading while its unsent
replies exceed ``_WRITE_HIGH`` bytes (a client that does not read its replies
stops being served, and its memory stays bounded) or a call of its own runs
on a thread. A frame longer than the limit is refused from its length alone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import cast

from thriftpy2.thrift import TApplicationException

from .._ids.generator import WouldBlock
from .._observability.metrics import ConnectionStats, ServiceMetrics
from .._serving.tls import TlsSession
from .fastpath import SEQID_AT, SEQID_END, match_get_id
from .processor import Processor, encode_error, frame
from .scanner import Malformed, MessageScanner, TooLarge

__all__ = ["Connection", "Shared"]

log = logging.getLogger("snowflake_server._thrift.server")

_BATCH = 32  # requests served per turn of the loop before the other connections' turn
_BATCH_BYTES = 64 * 1024  # or this many bytes of requests, whichever comes first
_WRITE_HIGH = 64 * 1024  # unsent reply bytes at which a connection stops being read
_IDLE_CHECKS = 4  # looks per idle timeout
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(eq=False)
class Shared:
    """What every connection of one server uses."""

    loop: asyncio.AbstractEventLoop
    make_processor: Callable[[ConnectionStats], Processor]
    metrics: ServiceMetrics
    executor: Executor
    framed: bool
    max_frame_size: int
    idle_timeout: float  # 0: never
    tls: ssl.SSLContext | None
    admit: Callable[[Connection], bool]
    """Registers a new connection; False if the server is full (it counts and logs)."""
    connections: set[Connection] = field(default_factory=set)
    on_closed: Callable[[], None] = lambda: None


class Refused(Exception):
    """A request the connection cannot serve: reply with an error, then close.
    ``kind`` is what the metrics count it as; ``status`` the HTTP status, for the
    HTTP connection's answer; ``app_error`` the Thrift application error's type."""

    def __init__(
        self,
        kind: str,
        message: str,
        status: int = 400,
        app_error: int = TApplicationException.PROTOCOL_ERROR,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.app_error = app_error


class Connection(asyncio.Protocol):
    """An ``asyncio.Protocol`` serving one client; see the module docstring."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self._framed = shared.framed
        self._limit = shared.max_frame_size
        self._transport: asyncio.Transport | None = None
        self._tls: TlsSession | None = None
        self._write: Callable[[bytes], object]  # set by connection_made
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._buf = bytearray()
        self._scanner: MessageScanner | None = None  # buffered: the message coming in
        self._stats: ConnectionStats | None = None
        self._processor: Processor | None = None
        self._peer: object = None
        self._reading = True
        self._writable = True
        self._busy = False  # one of its calls runs on a worker thread
        self._turn_scheduled = False
        self._draining = False  # the server stops: serve what was received, then close
        self._closing = False
        self._finished = False
        self._lost = False  # gone while a call of its own ran on a thread
        self._read = False  # something was read since the idle timer last looked
        self._quiet_checks = 0
        self._idle_timer: asyncio.TimerHandle | None = None
        # The fast path applies: framed, plain, admitted, nothing buffered or waiting.
        self._fast = False
        self._get_id_frame: Callable[[bytes, bytes], bytes]  # set by connection_made
        self._last_head = self._last_tail = self._last_agent = b"\xff"  # no request matches

    # -- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._transport = transport
        self._peer = transport.get_extra_info("peername")
        shared = self._shared
        if not shared.admit(self):
            self._closing = True
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=_WRITE_HIGH)
        self._stats = stats = shared.metrics.open_connection()
        self._processor = shared.make_processor(stats)
        self._get_id_frame = self._processor.get_id_frame
        if shared.idle_timeout:
            self._schedule_idle_check()
        if shared.tls is not None:
            self._tls = TlsSession(shared.tls)
            self._write = self._write_encrypted
            self._handshake_timer = shared.loop.call_later(
                HANDSHAKE_TIMEOUT_S, self._handshake_expired
            )
        else:
            self._write = transport.write
        self._update_fast()

    def data_received(self, data: bytes) -> None:
        self._read = True
        if self._fast:
            # The common case first: one whole get_id frame and nothing else, most
            # often the same as this connection's last one but for its seqid.
            if data[SEQID_END:] == self._last_tail and data[:SEQID_AT] == self._last_head:
                call: tuple[bytes, bytes] | None = (data[SEQID_AT:SEQID_END], self._last_agent)
            else:
                call = match_get_id(data, self._limit)
                if call is not None:
                    self._last_head, self._last_tail = data[:SEQID_AT], data[SEQID_END:]
                    self._last_agent = call[1]
            if call is not None:
                try:
                    self._write(self._get_id_frame(*call))
                    return
                except WouldBlock:
                    pass  # served below, as any request that must wait
        self._received(data)

    def _received(self, data: bytes) -> None:
        if self._closing:
            return  # refused or closed: what it still sends is not read
        if self._tls is not None:
            data = self._decrypt(self._tls, data)
            if self._closing or not (data or self._draining):
                return
        self._buf += data
        self._serve()

    def eof_received(self) -> bool:
        return False  # close: a client that half-closes gets nothing more

    def pause_writing(self) -> None:
        self._writable = False
        self._update_fast()
        self._update_reading()

    def resume_writing(self) -> None:
        self._writable = True
        self._serve()

    def connection_lost(self, exc: Exception | None) -> None:
        tls = self._tls
        if self._stats is not None and not self._closing and tls and tls.mid_handshake:
            self._stats.count_exception("tls_error")
            log.info("closing connection from %s: it hung up during its TLS handshake", self._peer)
        elif self._stats is not None and not self._closing and self._buf:
            self._stats.count_exception("protocol_error")
            log.info("closing connection from %s: it hung up in the middle of a call", self._peer)
        elif exc is not None:
            log.debug("connection from %s ended: %s", self._peer, exc)
        self._finish()

    # -- serving ------------------------------------------------------------------

    def _serve(self) -> None:
        """Serve the whole requests received, up to ``_BATCH`` this turn."""
        buf = self._buf
        pos = served = 0
        try:
            while not (self._busy or self._closing) and (self._writable or self._draining):
                end = self._request_end(buf, pos)
                if end is None:
                    break
                if (served == _BATCH or pos >= _BATCH_BYTES) and not self._draining:
                    self._next_turn()
                    break
                request = bytes(buf[pos:end])
                pos = end
                served += 1
                try:
                    reply = self._reply(request)
                except WouldBlock:
                    self._to_thread(request)
                    break
                self._write(reply)
        except Refused as e:
            self._refuse(e)
        finally:
            if pos:
                del buf[:pos]
        if self._draining and not (self._busy or self._closing):
            self._close()
        else:
            self._update_reading()
        self._update_fast()

    def _request_end(self, buf: bytearray, pos: int) -> int | None:
        """Where the request starting at ``pos`` ends, if it is all in ``buf``."""
        if self._framed:
            if len(buf) - pos < 4:
                return None
            size = int.from_bytes(buf[pos : pos + 4], "big", signed=True)
            if not 0 < size <= self._limit:
                raise Refused(
                    "frame_too_large",
                    f"frame of {size} bytes refused: --max-frame-size is {self._limit} bytes",
                )
            end = pos + 4 + size
            return end if end <= len(buf) else None
        scanner = self._scanner
        if scanner is None:
            if pos == len(buf):
                return None
            scanner = self._scanner = MessageScanner(self._limit)
        try:
            length = scanner.feed(buf, pos)
        except TooLarge as e:
            raise Refused("frame_too_large", str(e)) from None
        except Malformed as e:
            raise Refused("protocol_error", f"undecodable request: {e}") from None
        if length is None:
            return None
        self._scanner = None
        return pos + length

    def _reply(self, request: bytes) -> bytes:
        """The reply to one whole request. Runs on the loop, or on a worker thread
        when it raised ``WouldBlock`` there."""
        processor = self._processor
        assert processor is not None
        if not self._framed:
            return self._generic(processor, request)
        call = match_get_id(request, self._limit)
        if call is not None:
            return processor.get_id_frame(*call)
        message = request[4:]
        try:
            length = MessageScanner(self._limit).feed(message, 0)
        except (Malformed, TooLarge) as e:
            # Anything announced past the frame is malformed: a call never spans frames.
            raise Refused("protocol_error", f"undecodable request: {e}") from None
        if length is None:
            raise Refused("protocol_error", "undecodable request: the frame ends inside its call")
        if length != len(message):
            raise Refused(
                "protocol_error",
                f"undecodable request: {len(message) - length} bytes after the call in its frame",
            )
        return frame(self._generic(processor, message))

    @staticmethod
    def _generic(processor: Processor, message: bytes) -> bytes:
        try:
            return processor.process_message(message)
        except WouldBlock:
            raise
        except Exception as e:  # noqa: BLE001 - bytes thriftpy2 cannot decode: refuse this client only
            raise Refused("protocol_error", f"undecodable request: {e!r}") from None

    def _to_thread(self, request: bytes) -> None:
        """Make the call again on a worker thread; this connection waits for it."""
        shared = self._shared
        try:
            future = shared.loop.run_in_executor(shared.executor, self._reply, request)
        except RuntimeError as e:
            # No thread takes it (the pool is shut down, or none could be started): this
            # client is told and closed; the loop and every other connection go on.
            raise Refused(
                "unavailable", f"no thread to run this call on: {e}", 503,
                TApplicationException.INTERNAL_ERROR,
            ) from None  # fmt: skip
        self._busy = True
        future.add_done_callback(self._after_thread)

    def _after_thread(self, future: asyncio.Future[bytes]) -> None:
        self._busy = False
        error = None if future.cancelled() else future.exception()
        if self._lost:
            self._finish()  # now that the call's counts are all in its stats
            return
        if isinstance(error, Refused):
            self._refuse(error)
            return
        if future.cancelled() or error is not None:
            # Cancelled: the server stopped before the call ran. An error: a bug, the
            # request having decoded once already. Either way this client gets no reply.
            log.error("closing connection from %s: its call failed: %r", self._peer, error)
            self._close()
            return
        self._write(future.result())
        self._serve()

    def _next_turn(self) -> None:
        if not self._turn_scheduled:
            self._turn_scheduled = True
            self._shared.loop.call_soon(self._take_turn)

    def _take_turn(self) -> None:
        self._turn_scheduled = False
        if not self._finished:
            self._serve()

    def _update_reading(self) -> None:
        """Read only while this connection can serve what arrives."""
        transport = self._transport
        if transport is None or self._closing:
            return
        wanted = self._writable and not (self._busy or self._turn_scheduled or self._draining)
        if wanted != self._reading:
            self._reading = wanted
            if wanted:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def _refuse(self, error: Refused) -> None:
        assert self._stats is not None
        self._stats.count_exception(error.kind)
        log.info("closing connection from %s: %s", self._peer, error)
        reply = encode_error(error.app_error, str(error))
        self._write(frame(reply) if self._framed else reply)
        self._close()

    def _close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._update_fast()
        transport = self._transport
        if transport is None:
            return
        if self._tls is not None:
            transport.write(self._tls.close())
        transport.close()  # after the replies already written

    # -- life cycle ---------------------------------------------------------------

    def _decrypt(self, tls: TlsSession, data: bytes) -> bytes:
        """The plaintext in ``data``; handshake replies are sent on the way."""
        assert self._transport is not None
        try:
            plaintext, to_send = tls.receive(data)
        except ssl.SSLError as e:
            assert self._stats is not None
            self._stats.count_exception("tls_error")
            log.info("closing connection from %s: TLS: %s", self._peer, e)
            self._close()  # after the alert saying why, if any
            return b""
        if to_send:
            self._transport.write(to_send)
        if tls.established and self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        if tls.closed_by_peer:
            # Serve what came before the close_notify, then close (as the server's stop does).
            self._draining = True
            self._update_fast()
        return plaintext

    def _write_encrypted(self, plaintext: bytes) -> None:
        assert self._tls is not None and self._transport is not None
        self._transport.write(self._tls.encrypt(plaintext))

    def _update_fast(self) -> None:
        self._fast = (
            self._framed
            and self._tls is None
            and not (self._buf or self._busy or self._closing or self._draining)
            and self._writable
        )

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        log.debug(
            "closing connection from %s: no TLS handshake within %.0f s",
            self._peer, HANDSHAKE_TIMEOUT_S,
        )  # fmt: skip
        self._closing = True
        self.abort()

    def _check_idle(self) -> None:
        # A flag per read and a look every quarter of the timeout: no clock read per
        # call. A connection quiet for the timeout is closed within a quarter more.
        self._idle_timer = None
        if self._finished:
            return
        if self._read or self._busy:
            self._read = False
            self._quiet_checks = 0
        else:
            self._quiet_checks += 1
            if self._quiet_checks >= _IDLE_CHECKS:
                timeout = self._shared.idle_timeout
                log.debug("closing connection from %s: idle for %g s", self._peer, timeout)
                transport = self._transport
                if not self._writable or (transport and transport.get_write_buffer_size()):
                    # Replies it does not read would hold the close (and the slot) forever.
                    self._closing = True
                    self.abort()
                else:
                    self._close()
                return
        self._schedule_idle_check()

    def _schedule_idle_check(self) -> None:
        shared = self._shared
        self._idle_timer = shared.loop.call_later(
            shared.idle_timeout / _IDLE_CHECKS, self._check_idle
        )

    def drain(self) -> None:
        """The server stops: read nothing more, serve the requests already received,
        then close (after their replies)."""
        if self._finished or self._closing:
            return
        self._draining = True
        self._update_fast()
        if self._transport is not None and self._reading:
            self._reading = False
            self._transport.pause_reading()
        self._serve()

    def abort(self) -> None:
        """Close at once, replies unsent or not (the server's grace ran out)."""
        if self._transport is not None:
            self._transport.abort()

    def _finish(self) -> None:
        if self._finished:
            return
        if self._busy:
            # Its call still runs on a thread: the connection's stats are closed (and
            # the server may stop) only once that call has counted its ids.
            self._lost = True
            return
        self._finished = True
        for timer in (self._idle_timer, self._handshake_timer):
            if timer is not None:
                timer.cancel()
        shared = self._shared
        if self._stats is not None:
            shared.metrics.close_connection(self._stats)
        if self in shared.connections:
            shared.connections.discard(self)
            shared.on_closed()
        self._buf.clear()
