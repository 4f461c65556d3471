"""One client connection on the event loop, whatever its protocol: bytes in, replies
out, in order, fair by work, bounded in time and memory.

The connection knows no protocol. A :class:`Protocol` plugged into it (Thrift's
framing, HTTP/1.1) says where a request ends, answers it and renders a refusal;
the connection owns everything else, the same for both:

- **Fairness**: each request is priced by the loop time it took (see
  :mod:`.fairness`); a connection that has spent its credit stops being read and
  waits its turn in the server's :class:`~.fairness.TurnQueue`.
- **Back-pressure and memory**: it stops reading while its unsent replies exceed
  ``_WRITE_HIGH`` bytes (a client that does not read its replies stops being
  served) or a call of its own runs on a thread.
- **Deadlines**: a connection that sends nothing for ``idle_timeout`` is closed;
  a request whose first byte arrived must be whole within ``request_timeout``
  (a client trickling a byte at a time is closed, whatever the idle timeout).
- **Calls that wait** (a clock stepped back, a reservation to renew:
  ``WouldBlock``) are made again on a worker thread while this connection waits
  and every other goes on; a call that met the generator held by such a thread
  (``Contended``) tries again on the loop half a ms later, rather than queueing
  behind the threads' calls.
- **TLS** over memory buffers (:mod:`.tls`), its handshake bounded in time.
- **Stop**: :meth:`Connection.drain` serves what was received, then closes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, cast
from typing import Protocol as Interface

from .._ids.clocks import METER
from .._ids.generator import Contended, WouldBlock
from .._observability.metrics import NO_METHOD, ConnectionStats, ServiceMetrics
from .fairness import TurnQueue
from .refusal import Cause, Refused
from .tls import TlsSession

__all__ = ["Connection", "Listener", "Protocol", "Shared"]

log = logging.getLogger(__name__)

_WRITE_HIGH = 64 * 1024  # unsent reply bytes at which a connection stops being read
_CHECKS = 4  # looks per deadline: a connection is closed within a quarter more
_CONTENDED_RETRY_S = 0.0005  # a call that met a busy generator tries again after this
HANDSHAKE_TIMEOUT_S = 5.0


class Protocol(Interface):
    """What a connection needs from a protocol: one instance per connection.

    ``next_request`` and ``reply`` may raise :class:`~.refusal.Refused`;
    ``reply`` may raise ``WouldBlock`` having done nothing (it is then made again
    on a worker thread, where it must not touch the connection's buffer).
    """

    closes: bool
    """The last reply asked for the connection to close after it (HTTP ``Connection: close``)."""

    def fast(self, data: bytes) -> bytes | None:
        """The reply to ``data`` if it is exactly one request answered without
        buffering (a plain connection with nothing buffered), else None."""

    def next_request(self, buf: bytearray, pos: int) -> tuple[Any, int]:
        """The request at ``pos`` of ``buf`` (None if none is whole yet) and where the
        bytes it consumed end (``pos``: it needs more bytes)."""

    def reply(self, request: Any) -> bytes:
        """The bytes that answer ``request``."""

    def refusal(self, error: Refused) -> bytes:
        """The bytes that tell the client why it is refused, before the close."""

    def pending(self, buf: bytearray) -> bool:
        """Bytes or requests were received and not yet answered (part of a request:
        the request deadline runs)."""


@dataclass(eq=False)
class Shared:
    """What every connection of one server uses, whatever its listener."""

    loop: asyncio.AbstractEventLoop
    metrics: ServiceMetrics
    executor: Executor
    turns: TurnQueue
    connections: set[Connection] = field(default_factory=set)
    on_closed: Callable[[], None] = lambda: None


@dataclass(eq=False)
class Listener:
    """One listening port's protocol and limits."""

    name: str
    """The protocol's name in metrics and logs: ``thrift`` or ``http``."""
    make_protocol: Callable[[ConnectionStats], Protocol]
    max_connections: int
    idle_timeout: float  # 0: never
    request_timeout: float  # 0: never
    tls: ssl.SSLContext | None
    shared: Shared
    open: set[Connection] = field(default_factory=set)
    admit: Callable[[Connection], bool] = lambda _connection: True
    """Registers a new connection; False if the listener is full (it counts and logs)."""


class Connection(asyncio.Protocol):
    """An ``asyncio.Protocol`` serving one client with a :class:`Protocol`; see the
    module docstring."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._shared = shared = listener.shared
        self._turns = shared.turns
        self._clock = shared.turns.clock
        self._transport: asyncio.Transport | None = None
        self._tls: TlsSession | None = None
        self._write: Callable[[bytes], object]  # set by connection_made
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._buf = bytearray()
        self._inbox = bytearray()  # received while waiting for a turn (TLS: still encrypted)
        self._stats: ConnectionStats | None = None
        self._protocol: Protocol | None = None
        self._fast_reply: Callable[[bytes], bytes | None] | None = None
        self._peer: object = None
        # No credit until its first turn: a connection's first request is as yet unpriced,
        # and a flood of new connections (one costly request each, or a TLS handshake:
        # a signature) is paced by the turn queue, not served as fast as it arrives.
        self.credit = 0.0
        self._waiting = False  # in the turn queue
        self._reading = True
        self._writable = True
        self._busy = False  # one of its calls runs on a worker thread
        # The server stops, or its client asked to close (Connection: close, a TLS
        # close_notify): read nothing more, serve what was received, then close.
        self._draining = False
        self._closing = False
        self._finished = False
        self._lost = False  # gone while a call of its own ran on a thread
        self._read = False  # something was read since the deadline timer last looked
        self._served = 0  # requests served, for the request deadline
        self._served_seen = 0
        self._quiet_checks = 0
        self._partial_checks = 0
        self._timer: asyncio.TimerHandle | None = None
        self._fast = False  # the protocol's fast path applies now
        self._make_protocol = listener.make_protocol
        self._held: Any = None  # a request taken in whose call met a busy generator
        self._backoff: asyncio.TimerHandle | None = None  # until it tries that call again
        self._expiry: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ---------------------------------------------------------

    @property
    def protocol(self) -> Protocol | None:
        """What serves this connection's requests, made once it is connected."""
        return self._protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._transport = transport
        self._peer = transport.get_extra_info("peername")
        listener = self._listener
        if not listener.admit(self):
            self._closing = True
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=_WRITE_HIGH)
        self._stats = stats = self._shared.metrics.open_connection(listener.name)
        self._protocol = protocol = self._make_protocol(stats)
        if listener.idle_timeout or listener.request_timeout:
            self._schedule_check()
        if listener.tls is not None:
            self._tls = TlsSession(listener.tls)
            self._write = self._write_encrypted
            self._handshake_timer = self._shared.loop.call_later(
                HANDSHAKE_TIMEOUT_S, self._handshake_expired
            )
        else:
            self._write = transport.write
            self._fast_reply = protocol.fast
        self._update_fast()

    def reserved(
        self, make_protocol: Callable[[ConnectionStats, bool], Protocol], lifetime_s: float
    ) -> None:
        """Admitted beyond the listener's limit, into its reserve: served by the protocol
        made for peer checks only, and closed after ``lifetime_s``."""
        self._make_protocol = lambda stats: make_protocol(stats, True)
        self._expiry = self._shared.loop.call_later(lifetime_s, self._expired)

    def _expired(self) -> None:
        self._expiry = None
        log.debug("closing connection from %s: its reserved slot expired", self._peer)
        self._close()
        self._abort_if_stuck()

    def data_received(self, data: bytes) -> None:
        self._read = True
        if self._fast:
            fast = self._fast_reply(data)  # type: ignore[misc]  # set with _fast
            if fast is not None:
                self._write(fast)
                return
        if self._closing:
            return  # refused or closed: what it still sends is not read
        turns = self._turns
        if self._waiting or self.credit <= 0 or turns.spent >= turns.budget_s:
            self._inbox += data
            self._wait_turn()
            return
        self.credit = turns.quantum_s  # a fresh turn
        self._serve(data)

    def eof_received(self) -> bool:
        return False  # close: a client that half-closes gets nothing more

    def pause_writing(self) -> None:
        self._writable = False
        self._update_fast()
        self._update_reading()

    def resume_writing(self) -> None:
        self._writable = True
        if not self._waiting:  # else served at its turn
            self._serve(b"")

    def connection_lost(self, exc: Exception | None) -> None:
        tls = self._tls
        if self._stats is not None and not self._closing and tls and tls.mid_handshake:
            self._stats.count_exception("tls_error", NO_METHOD)
            log.info("closing connection from %s: it hung up during its TLS handshake", self._peer)
        elif self._stats is not None and not self._closing and self._pending():
            self._stats.count_exception("protocol_error", NO_METHOD)
            log.info("closing connection from %s: it hung up in the middle of a call", self._peer)
        elif exc is not None:
            log.debug("connection from %s ended: %s", self._peer, exc)
        self._finish()

    # -- serving ------------------------------------------------------------------

    def take_turn(self) -> None:
        """The turn queue's visit: serve what was received, with the credit it gave."""
        self._waiting = False
        if self._finished:
            return
        data, self._inbox = bytes(self._inbox), bytearray()
        self._serve(data)

    def _wait_turn(self) -> None:
        if not self._waiting:
            self._waiting = True
            self._turns.wait(self)
        self._update_fast()
        self._update_reading()

    def _serve(self, data: bytes) -> None:
        """Take in ``data``, then serve the whole requests received while this
        connection's credit and the turn's budget last; then wait for a turn, read
        on, or close (draining, with nothing left)."""
        turns = self._turns
        clock, meter = self._clock, METER
        started, owed = clock(), meter.owed
        if data:
            if self._tls is not None:
                data = self._decrypt(self._tls, data)
            self._buf += data
        buf, protocol = self._buf, self._protocol
        pos = 0
        need_more = False  # what is left is not a whole request yet
        try:
            while (
                protocol is not None
                and self._writable
                and not (self._busy or self._closing or self._backoff)
                and self.credit > 0
                and turns.spent < turns.budget_s
            ):
                if self._held is not None:
                    request, self._held = self._held, None
                else:
                    request, end = protocol.next_request(buf, pos)
                    if end == pos and request is None:
                        need_more = True
                        break
                    pos = end
                if request is not None:
                    self._served += 1
                    try:
                        reply = protocol.reply(request)
                    except Contended:
                        # A worker thread's call holds the generator: try again on the
                        # loop a moment later, not queued behind the threads' calls.
                        self._held = request
                        self._backoff = self._shared.loop.call_later(
                            _CONTENDED_RETRY_S, self._retry
                        )
                        break
                    except WouldBlock:
                        self._to_thread(request)
                        break
                    self._write(reply)
                    if protocol.closes:
                        self._draining = True  # close after this reply, as asked
                        break
                now, now_owed = clock(), meter.owed
                # The turn pays the loop time; the connection its price (see .fairness).
                turns.charge(now - started)
                self.credit -= (now - started) + (now_owed - owed)
                started, owed = now, now_owed
        except Refused as e:
            self._refuse(e)
        except Exception:  # a bug: this client is told and closed, every other one goes on
            log.exception("closing connection from %s: serving its request failed", self._peer)
            self._refuse(Refused("internal_error", "internal error", Cause.INTERNAL))
        finally:
            if pos:
                del buf[:pos]
        now = clock()
        turns.charge(now - started)
        self.credit -= (now - started) + (meter.owed - owed)
        self._after_serving(need_more)

    def _after_serving(self, need_more: bool) -> None:
        """Wait for a turn if whole requests are left and no credit or budget for them;
        close a draining connection with none left; else read as the state allows."""
        if self._closing or self._busy or self._backoff:
            self._update_reading()
            self._update_fast()
            return
        turns = self._turns
        if self._held is not None or (not need_more and self._has_work()):
            if self.credit <= 0 or turns.spent >= turns.budget_s:
                self._wait_turn()
                return
        elif self._draining:
            self._close()
            return
        self._update_reading()
        self._update_fast()

    def _retry(self) -> None:
        self._backoff = None
        if not (self._finished or self._closing):
            self._serve(b"")

    def _has_work(self) -> bool:
        return self._held is not None or self._pending()

    def _pending(self) -> bool:
        """Bytes or requests received and not yet answered: in its protocol's hands, in
        its inbox while it waits for a turn, or an unfinished TLS record."""
        protocol, tls = self._protocol, self._tls
        return (
            bool(self._inbox)
            or (protocol is not None and protocol.pending(self._buf))
            or (tls is not None and tls.buffered)
        )

    def _to_thread(self, request: Any) -> None:
        """Make the call again on a worker thread; this connection waits for it."""
        shared = self._shared
        assert self._protocol is not None
        try:
            future = shared.loop.run_in_executor(shared.executor, self._protocol.reply, request)
        except RuntimeError as e:
            # No thread takes it (the pool is shut down, or none could be started): this
            # client is told and closed; the loop and every other connection go on.
            raise Refused(
                "unavailable", f"no thread to run this call on: {e}", Cause.UNAVAILABLE
            ) from None
        self._busy = True
        future.add_done_callback(self._after_thread)

    def _after_thread(self, future: asyncio.Future[bytes]) -> None:
        self._busy = False
        error = None if future.cancelled() else future.exception()
        if self._lost:
            self._finish()  # now that the call's counts are all in its stats
            return
        if self._closing:
            return  # its slot expired, or its client is gone: the answer has nowhere to go
        if isinstance(error, Refused):
            self._refuse(error)
            return
        if future.cancelled():
            # The server stopped before the call ran: the client is told, then closed.
            self._refuse(Refused("unavailable", "the server is stopping", Cause.UNAVAILABLE))
            return
        if error is not None:
            # A bug, the request having decoded once already: told, logged, closed.
            log.error("closing connection from %s: its call failed: %r", self._peer, error)
            self._refuse(Refused("internal_error", "internal error", Cause.INTERNAL))
            return
        self._write(future.result())
        assert self._protocol is not None
        if self._protocol.closes:
            self._draining = True
        self._serve(b"")

    def _update_reading(self) -> None:
        """Read only while this connection can serve what arrives."""
        transport = self._transport
        if transport is None or self._closing:
            return
        wanted = self._writable and not (
            self._busy or self._waiting or self._draining or self._backoff
        )
        if wanted != self._reading:
            self._reading = wanted
            if wanted:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def _refuse(self, error: Refused) -> None:
        if self._closing:
            return  # already told why, or gone: nothing more is written
        assert self._stats is not None and self._protocol is not None
        self._stats.count_exception(error.kind, NO_METHOD)
        log.info("closing connection from %s: %s", self._peer, error)
        self._write(self._protocol.refusal(error))
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

    # -- TLS ----------------------------------------------------------------------

    def _decrypt(self, tls: TlsSession, data: bytes) -> bytes:
        """The plaintext in ``data``; handshake replies are sent on the way."""
        assert self._transport is not None
        try:
            plaintext, to_send = tls.receive(data)
        except ssl.SSLError as e:
            assert self._stats is not None
            self._stats.count_exception("tls_error", NO_METHOD)
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
        return plaintext

    def _write_encrypted(self, plaintext: bytes) -> None:
        assert self._tls is not None and self._transport is not None
        if not self._closing:  # after the close_notify nothing more can be encrypted
            self._transport.write(self._tls.encrypt(plaintext))

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        log.debug(
            "closing connection from %s: no TLS handshake within %.0f s",
            self._peer, HANDSHAKE_TIMEOUT_S,
        )  # fmt: skip
        self._closing = True
        self.abort()

    # -- deadlines ----------------------------------------------------------------

    def _update_fast(self) -> None:
        self._fast = not self._buf and self._fast_if_unbuffered()

    def _fast_if_unbuffered(self) -> bool:
        """The protocol's fast path would apply now, but for the bytes buffered."""
        return self.credit > 0 and self._fast_if_paid()

    def _fast_if_paid(self) -> bool:
        """The protocol's fast path would apply now, but for the bytes buffered and the
        connection's credit."""
        return (
            self._fast_reply is not None
            and self._held is None
            and self._backoff is None
            and not (self._inbox or self._busy or self._closing or self._draining)
            and not self._waiting
            and self._writable
        )

    def check_deadlines(self) -> None:
        """One look at the idle and request deadlines: the connection's timer makes it
        every quarter of the shorter one (a test makes each look itself)."""
        # A flag per read and a count of requests served, looked at: no clock read per call.
        if self._timer is not None:
            self._timer.cancel()  # one timer chain, whoever looks (cancelling its own: harmless)
            self._timer = None
        if self._finished:
            return
        listener = self._listener
        if self._read or self._busy:
            self._read = False
            self._quiet_checks = 0
        else:
            self._quiet_checks += 1
        # The request deadline: the same request still partly received, however many
        # bytes trickled in meanwhile (a TLS handshake has its own timer).
        tls = self._tls
        handshaking = tls is not None and tls.mid_handshake
        # Not while the server holds it back (a call on a thread, its replies unread, its
        # turn or a retry awaited): the deadline is the client's, for its own bytes.
        held_back = self._busy or handshaking or self._waiting or self._backoff
        if not self._pending() or self._served != self._served_seen:
            self._partial_checks = 0  # nothing partial, or progress since the last look
        elif self._writable and not held_back:
            self._partial_checks += 1
        # else the server holds it back: the count waits (neither runs nor starts over)
        self._served_seen = self._served
        period = self._period()
        # First seen partial at most a period after its first byte: (n - 1) periods
        # later it is at least that old.
        late = listener.request_timeout and (
            (self._partial_checks - 1) * period >= listener.request_timeout
        )
        idle = listener.idle_timeout and self._quiet_checks * period >= listener.idle_timeout
        if self._closing:
            if late or idle:
                self._closing = True
                self.abort()  # its close waits on replies it does not read
                return
        elif late:
            self._refuse(
                Refused(
                    "request_timeout",
                    f"no whole request within --request-timeout {listener.request_timeout:g} s",
                    Cause.TOO_SLOW,
                )
            )
            self._abort_if_stuck()
        elif idle:
            log.debug("closing connection from %s: idle for %g s", self._peer,
                      listener.idle_timeout)  # fmt: skip
            self._close()
            self._abort_if_stuck()
        self._schedule_check()

    def _abort_if_stuck(self) -> None:
        transport = self._transport
        if not self._writable or (transport and transport.get_write_buffer_size()):
            # Replies it does not read would hold the close (and the slot) forever.
            self._closing = True
            self.abort()

    def _period(self) -> float:
        listener = self._listener
        deadlines = [t for t in (listener.idle_timeout, listener.request_timeout) if t]
        return min(deadlines) / _CHECKS

    def _schedule_check(self) -> None:
        self._timer = self._shared.loop.call_later(self._period(), self.check_deadlines)

    # -- life cycle ---------------------------------------------------------------

    def drain(self) -> None:
        """The server stops: read nothing more, serve the requests already received
        (in turns, as ever), then close (after their replies)."""
        if self._finished or self._closing:
            return
        self._draining = True
        self._update_fast()
        self._update_reading()
        if not (self._waiting or self._busy or self._backoff):
            self._serve(b"")  # served at its turn otherwise, then closed

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
        for timer in (self._timer, self._handshake_timer, self._expiry, self._backoff):
            if timer is not None:
                timer.cancel()
        shared = self._shared
        self._turns.forget(self)
        if self._stats is not None:
            shared.metrics.close_connection(self._stats, self._listener.name)
        self._listener.open.discard(self)
        if self in shared.connections:
            shared.connections.discard(self)
            shared.on_closed()
        self._buf.clear()
        self._inbox.clear()
