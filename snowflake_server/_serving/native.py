"""The serving core on the native listener: Python decides, native executes.

Every policy of the serving core stays in :class:`~.connection.Connection`: admission,
credit and turns, deadlines, back-pressure, drain, refusal, calls that wait. Here a
connection's socket is owned by a native listener (``_core.Listener``, or a model of it in
the tests), and what a ``Connection`` sees of it is an ordinary ``asyncio.Transport``
(:class:`NativeTransport`). The one thing native adds is the **lease**: while
``Connection._update_fast`` computes that today's fast path applies (plain, framed, nothing
buffered, credit, writable, not closing, ...) native may answer the connection's common
``get_id`` calls itself, many per read and without the GIL, for agents Python has already
validated (:meth:`NativeListener.on_agent`). It gives the lease back at the first frame
it does not serve, handing every byte from there on to Python in order
(:class:`NativeConnection` grants and revokes; it adds no policy).

The contract between the two sides is in the listener's C source
(``_native/_listener.c``) and its design note; in short: events come from
``take_events()`` when ``events_fd`` is readable (bytes for Python, writable or not, the
connection lost), commands go the other way (write, grant, revoke, consume, reading,
close, abort, free), and every call takes a connection's **handle**, stale handles doing
nothing.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from .._observability.metrics import NO_METHOD
from .connection import _WRITE_HIGH, Connection, Listener

__all__ = [
    "ACCEPT_BATCH",
    "NativeConnection",
    "NativeListener",
    "NativeMachine",
    "NativeThreads",
    "NativeTransport",
    "serve_natively",
]

log = logging.getLogger(__name__)

ACCEPT_BATCH = 64  # connections accepted per readiness of the listening socket
_ACCEPT_PAUSE_S = (0.1, 2.0)  # out of file descriptors: accepting pauses, doubling to the most
_LOG_EVERY_S = 10.0
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class NativeMachine(Protocol):
    """What the shim uses of a native listener: ``_core.Listener`` and the tests' model
    (tests/support/native_model.py) both are one."""

    @property
    def events_fd(self) -> int: ...

    def take_events(self) -> list[tuple[Any, ...]]: ...

    def adopt(self, fd: int, /) -> int:
        """A handle for the connected socket ``fd``, now native's (closed if this raises)."""

    def write(self, handle: int, data: bytes, /) -> tuple[int, bool]: ...

    def grant(self, handle: int, consumed: int, prefix: bytes = b"", /) -> bool: ...

    def revoke(self, handle: int, /) -> None: ...

    def consume(self, handle: int, consumed: int, /) -> None: ...

    def reading(self, handle: int, on: bool, /) -> None: ...

    def close(self, handle: int, /) -> None: ...

    def abort(self, handle: int, /) -> None: ...

    def free(self, handle: int, /) -> None: ...

    def take_read_seen(self, handle: int, /) -> bool: ...

    def served(self, handle: int, /) -> int: ...

    def partial(self, handle: int, /) -> int: ...

    def out_len(self, handle: int, /) -> int: ...

    def forwarded(self, handle: int, /) -> int: ...


class NativeThreads(NativeMachine, Protocol):
    """A native listener whose threads serve (``_core.Listener`` with ``threads >= 1``)."""

    def start(self) -> None:
        """Start every thread, or raise ``OSError`` with none left running."""

    def stop(self, timeout_s: float = 1.0, /) -> bool:
        """Stop and join every thread; False if one did not end in time."""

    def ticks(self) -> list[tuple[float, float]]:
        """Per thread: seconds since its loop last turned, and the most its tick was late
        since the last call."""

    def set_state(self, state: Any, /) -> None:
        """The generator state native threads issue from (None: they hand every call over)."""


class Registry(Protocol):
    """The native agent registry (``_core.AgentRegistry``): -1 when full."""

    def add(self, agent: bytes, label_index: int, /) -> int: ...


class NativeTransport(asyncio.Transport):
    """A ``Connection``'s transport over one native connection (``handle`` of ``native``).

    As asyncio's: ``write`` never blocks (native sends or queues, in order after every
    earlier reply, native's included) and pauses the protocol when the unsent bytes pass
    the high mark; bytes are not delivered while reading is paused (they wait here and come
    on resume). Besides, the lease: :meth:`grant`, :meth:`revoke`, and what the deadlines
    need to see of native's work (:meth:`take_read_seen`, :meth:`take_served`,
    :meth:`native_pending`).
    """

    def __init__(
        self,
        native: NativeMachine,
        handle: int,
        loop: asyncio.AbstractEventLoop,
        *,
        high: int,
        peername: object = None,
        sockname: object = None,
    ) -> None:
        super().__init__()
        self._native = native
        self._handle = handle
        self._loop = loop
        self._high = high
        self._extra = {"peername": peername, "sockname": sockname, "socket": None}
        self._protocol: asyncio.Protocol | None = None
        self._closing = False
        self._lost = False
        self._paused = False  # the protocol paused reading
        self._write_paused = False  # the protocol was told to pause writing
        self._held = bytearray()  # received while paused, or before earlier bytes went up
        self._delivery: asyncio.Handle | None = None
        self._eof = False  # the peer's end of stream, not yet told
        self._served_seen = 0

    @property
    def handle(self) -> int:
        return self._handle

    # -- asyncio.Transport ------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        # No "socket": native owns it (TCP_NODELAY was set before it was handed over).
        value = self._extra.get(name)
        return default if value is None else value

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = cast(asyncio.Protocol, protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    @property
    def writing_paused(self) -> bool:
        """The protocol was told to pause writing (its unsent replies passed the mark)."""
        return self._write_paused

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Read nothing more, send what was written, then close."""
        if not self._closing:
            self._closing = True
            self._native.close(self._handle)

    def abort(self) -> None:
        """Close at once; unsent bytes are dropped."""
        self._closing = True
        self._native.abort(self._handle)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        _, became_paused = self._native.write(self._handle, bytes(data))
        if became_paused and not self._write_paused and self._protocol is not None:
            self._write_paused = True
            self._protocol.pause_writing()

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return self._native.out_len(self._handle)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._high // 4, self._high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        # The native connection's marks are fixed when its listener is made.
        if high is not None and high != self._high:
            raise ValueError(f"this transport's high mark is {self._high}, not {high}")

    def is_reading(self) -> bool:
        return not (self._paused or self._closing)

    def pause_reading(self) -> None:
        if not self._paused:
            self._paused = True
            self._native.reading(self._handle, False)

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            self._native.reading(self._handle, True)
            self._schedule_delivery()
            if self._eof and self._delivery is None:
                self._delivery = self._loop.call_soon(self._deliver)  # the end, in its turn

    # -- the lease and what the deadlines see -------------------------------------------

    def grant(self, consumed: int, prefix: bytes = b"") -> bool:
        """Let native answer this connection's frames; it takes the lease only if every
        byte it forwarded reached the protocol (``consumed``) and it holds none. ``prefix``:
        the start of a frame the protocol holds, for native to keep as the lease's partial
        frame (refused, no lease, unless it can lead to a frame native serves)."""
        return self._native.grant(self._handle, consumed, prefix)

    def revoke(self) -> None:
        """Take the lease back: the bytes of a frame native kept come as data."""
        self._native.revoke(self._handle)

    def consume(self, consumed: int) -> None:
        """The protocol has taken ``consumed`` bytes in all (native reads on past its bound)."""
        self._native.consume(self._handle, consumed)

    def take_read_seen(self) -> bool:
        """Whether native read bytes since the last call."""
        return self._native.take_read_seen(self._handle)

    def take_served(self) -> int:
        """Frames native answered since the last call."""
        served = self._native.served(self._handle)
        delta, self._served_seen = served - self._served_seen, served
        return delta

    def native_pending(self) -> bool:
        """Native holds part of a frame."""
        return self._native.partial(self._handle) > 0

    def forwarded(self) -> int:
        """Bytes native has forwarded to Python, in all (some may be on their way)."""
        return self._native.forwarded(self._handle)

    # -- events, from the listener --------------------------------------------------------

    def start(self) -> None:
        """The protocol is connected: native may read (nothing was read before the admit)."""
        if not (self._paused or self._closing):
            self._native.reading(self._handle, True)

    def data(self, data: bytes) -> None:
        """Bytes native forwarded, in order: to the protocol now if it reads, else held."""
        if self._lost:
            return
        if self._paused or self._held:
            self._held += data
            self._schedule_delivery()
            return
        assert self._protocol is not None
        self._protocol.data_received(data)

    def writable(self, writable: bool) -> None:
        """Native's own replies crossed the high mark (False) or drained below the low one."""
        protocol = self._protocol
        if protocol is None or self._lost or self._write_paused != writable:
            return  # the protocol was told already (or never paused): asyncio tells once
        self._write_paused = not writable
        if writable:
            protocol.resume_writing()
        else:
            protocol.pause_writing()

    def eof(self) -> None:
        """The peer half-closed (native reads nothing more). The end of the stream is a
        place in it: told as asyncio tells it, once the protocol reads again after every
        byte before it (a connection waiting for its turn, or for a call on a thread, has
        paused reading: an asyncio transport would not have read the end yet). A False
        answer closes, on the loop's next turn, after what the protocol still writes for
        what it received."""
        self._eof = True
        if self._paused or self._held:
            return  # told by _deliver, once reading again and the held bytes are in
        self._tell_eof()

    def _tell_eof(self) -> None:
        self._eof = False
        protocol = self._protocol
        if self._lost or self._closing or protocol is None:
            return
        if not protocol.eof_received():
            self._loop.call_soon(self.close)

    def lost(self, error: int) -> None:
        """Native closed the connection (``error``: the errno that ended it, or 0 when
        Python closed or aborted it): the protocol is told on the loop's next turn, after
        bytes already delivered or due, as asyncio's transports do."""
        if self._lost:
            return
        self._lost = self._closing = True
        protocol = self._protocol
        if protocol is None:
            return
        if self._paused and self._delivery is not None:
            self._delivery.cancel()  # never read, as a paused asyncio transport's
            self._delivery = None
        self._loop.call_soon(
            protocol.connection_lost, OSError(error, os.strerror(error)) if error else None
        )

    def _schedule_delivery(self) -> None:
        # On the next turn of the loop, as asyncio resumes reading: never inside the
        # protocol's own call that resumed it.
        if self._held and not self._paused and self._delivery is None:
            self._delivery = self._loop.call_soon(self._deliver)

    def _deliver(self) -> None:
        self._delivery = None
        if self._paused:
            return
        if self._held:
            data, self._held = bytes(self._held), bytearray()
            assert self._protocol is not None
            self._protocol.data_received(data)
        if self._eof and not (self._paused or self._held):
            self._tell_eof()


class NativeConnection(Connection):
    """A :class:`Connection` whose transport is a :class:`NativeTransport`: the same
    policies, plus the lease granted exactly while ``_fast`` holds, and native's reads,
    answers and kept bytes taken into the deadlines."""

    def __init__(
        self,
        listener: Listener,
        on_agent: Callable[[bytes, str], object] | None = None,
        *,
        max_prefix: int = 0,
    ) -> None:
        """``max_prefix``: the most of a frame's start handed to native with the lease (its
        largest frame; 0: never)."""
        super().__init__(listener)
        self._on_agent = on_agent
        self._native: NativeTransport | None = None
        self._eligible = False  # the protocol lets native serve (framed Thrift, not reserved)
        self._granted = False  # the lease was granted and no byte has come back since
        self._consumed = 0  # bytes received from the transport, in all
        self._need_more = False  # what the protocol buffers is a request's start only
        self._had_turn = False  # it has had credit once: its first requests were paced
        self._max_prefix = max_prefix

    @property
    def native_transport(self) -> NativeTransport | None:
        """Its transport, once connected."""
        return self._native

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._native = cast(NativeTransport, transport)
        super().connection_made(transport)
        protocol: Any = self._protocol
        if (
            protocol is not None
            and not self._closing
            and getattr(protocol, "native_eligible", False)
        ):
            self._eligible = True
            if self._on_agent is not None:
                protocol.register_agents_with(self._on_agent)
            self._update_fast()

    def data_received(self, data: bytes) -> None:
        # Bytes come only from a leaseless native connection: any lease was given back.
        self._granted = False
        self._consumed += len(data)
        assert self._native is not None
        self._native.consume(self._consumed)
        super().data_received(data)
        self._update_lease()  # after the fast path's reply, which updates nothing

    def _update_fast(self) -> None:
        super()._update_fast()
        self._update_lease()

    def _after_serving(self, need_more: bool) -> None:
        self._need_more = need_more  # what is buffered is the start of a request, no more
        self._had_turn = True  # served at a turn (or with credit given at one)
        super()._after_serving(need_more)

    def _update_lease(self) -> None:
        native = self._native
        if native is None:
            return
        buf = self._buf
        # Not the credit: what native answers costs the loop nothing, and every frame it
        # gives back is Python's, priced and paced by the turns as ever; a connection that
        # owes waits for its turn for those, not for the get_ids native answers. (Priced by
        # the loop's wall time, a loaded machine left most connections owing after each
        # Python-served call: native never served them.) But its first turn first: a new
        # connection's first requests are paced by the queue.
        ready = self._had_turn and self._fast_if_paid()
        if (
            self._eligible
            and ready
            and (not buf or (self._need_more and len(buf) <= self._max_prefix))
        ):
            if self._granted:
                return
            if not buf:
                self._granted = native.grant(self._consumed)
            elif native.grant(self._consumed, bytes(buf)):
                # A client whose writes end mid-frame (pipelining): the frame's start goes
                # to native with the lease, or no read would ever leave Python's buffer empty.
                buf.clear()
                self._granted = True
                self._fast = self._fast_if_unbuffered()  # nothing buffered now
        elif self._granted:
            self._granted = False
            native.revoke()

    def _refuse(self, error: Any) -> None:
        # A refusal must follow every reply native wrote, and none after it.
        if self._granted and self._native is not None:
            self._granted = False
            self._native.revoke()
        super()._refuse(error)

    def _pending(self) -> bool:
        native = self._native
        return super()._pending() or (
            native is not None and (native.native_pending() or native.forwarded() > self._consumed)
        )

    def check_deadlines(self) -> None:
        native = self._native
        if native is not None and not self._finished:
            if native.take_read_seen():
                self._read = True
            self._served += native.take_served()
        super().check_deadlines()

    def failed(self) -> None:
        """A bug in the shim: this connection is counted as ended by an internal error and
        is closing (the caller aborts it)."""
        if self._stats is not None and not self._closing:
            self._stats.count_exception("internal_error", NO_METHOD)
        self._closing = True


class NativeListener:
    """Serves one listening socket's connections on a native listener: accepts them
    (Python admits each: admission, reserve and peer names stay the serving core's),
    hands each to native, and turns native's events into each connection's calls.

    ``label_index`` maps an agent's metrics label to the index native counts it under
    (``ServiceMetrics.agent_index``); ``constants`` is the module with the event kinds
    (``_core``, or the tests' model). Step mode (tests): call :meth:`process_events`
    after ``native.step``; the loop's reader on ``events_fd`` does the same otherwise.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        native: NativeMachine,
        listener: Listener,
        *,
        constants: Any,
        registry: Registry,
        label_index: Callable[[str], int],
        sock: socket.socket | None = None,
        high: int = _WRITE_HIGH,
    ) -> None:
        if high != _WRITE_HIGH:
            raise ValueError(f"the native high mark {high} is not the connections' {_WRITE_HIGH}")
        self._loop = loop
        self._native = native
        self._listener = listener
        self._registry = registry
        self._label_index = label_index
        self._high = high
        self._ev_data = constants.EV_DATA
        self._ev_writable = constants.EV_WRITABLE
        self._ev_lost = constants.EV_LOST
        self._ev_thread_died = constants.EV_THREAD_DIED
        self._ev_eof = constants.EV_EOF
        self._max_frame: int = constants.NATIVE_MAX_FRAME
        self._transports: dict[int, NativeTransport] = {}
        self._sock = sock
        self._accepting = False
        self._accept_pause = _ACCEPT_PAUSE_S[0]
        self._accept_timer: asyncio.TimerHandle | None = None
        self._logged: dict[str, float] = {}
        self._events_fd = native.events_fd
        loop.add_reader(self._events_fd, self.process_events)
        if sock is not None:
            sock.setblocking(False)
            self.resume_accepting()

    @property
    def connections(self) -> int:
        """Connections handed to native and not yet lost."""
        return len(self._transports)

    # -- accepting ------------------------------------------------------------------------

    def resume_accepting(self) -> None:
        """Accept again after an out-of-files pause (its timer calls it)."""
        timer, self._accept_timer = self._accept_timer, None
        if timer is not None:
            timer.cancel()  # called before its time
        if self._sock is not None and not self._accepting:
            self._accepting = True
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        sock = self._sock
        assert sock is not None
        for _ in range(ACCEPT_BATCH):
            try:
                client, peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _OUT_OF_FILES:
                    self._pause_accepting(e)
                    return
                continue  # that connection is gone (ECONNABORTED, ...): the next one
            self._accept_pause = _ACCEPT_PAUSE_S[0]
            self.connect(client, peer)

    def _pause_accepting(self, error: OSError) -> None:
        """Out of file descriptors: stop accepting a while (doubling, to a bound), rather
        than spin on a socket that stays readable."""
        pause = self._accept_pause
        self._accept_pause = min(pause * 2, _ACCEPT_PAUSE_S[1])
        self._log_now_and_then(
            "accept", "cannot accept connections: %s; trying again in %.1f s", error, pause
        )
        if self._accepting and self._sock is not None:
            self._accepting = False
            self._loop.remove_reader(self._sock.fileno())
        self._accept_timer = self._loop.call_later(pause, self.resume_accepting)

    def connect(self, client: socket.socket, peer: object) -> NativeConnection | None:
        """Serve ``client`` (a connected socket, taken over): admitted or refused by the
        listener as any connection; None if native has no room for it (closed)."""
        try:
            sockname = client.getsockname()
            if client.family in (socket.AF_INET, socket.AF_INET6):
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            client.close()  # gone already
            return None
        try:
            handle = self._native.adopt(client.detach())  # it owns the fd, even if it fails
        except OSError as e:
            self._log_now_and_then("adopt", "cannot serve a connection from %s: %s", peer, e)
            return None
        transport = NativeTransport(
            self._native, handle, self._loop, high=self._high, peername=peer, sockname=sockname
        )
        connection = NativeConnection(self._listener, self.on_agent, max_prefix=self._max_frame)
        transport.set_protocol(connection)
        self._transports[handle] = transport
        try:
            connection.connection_made(transport)  # admits it, or closes it
            transport.start()
        except Exception:  # a bug: this connection ends, every other goes on
            log.exception("connection from %s failed to start", peer)
            self._native.abort(handle)
        return connection

    # -- events -----------------------------------------------------------------------

    def process_events(self) -> int:
        """Take every event native queued and hand each to its connection; a failure
        ends that connection only. Returns how many there were."""
        try:
            events = self._native.take_events()
        except Exception:
            log.exception("taking the native listener's events failed")
            return 0
        for event in events:
            try:
                self._dispatch(event)
            except Exception:
                log.exception("a native listener event %r failed", event[:2])
                self._fail(event)
        return len(events)

    def _dispatch(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == self._ev_data:
            transport = self._transports.get(event[1])
            if transport is not None:
                transport.data(event[2])
        elif kind == self._ev_writable:
            transport = self._transports.get(event[1])
            if transport is not None:
                transport.writable(bool(event[2]))
        elif kind == self._ev_lost:
            handle = event[1]
            transport = self._transports.pop(handle, None)
            try:
                if transport is not None:
                    transport.lost(int(event[2]))
            finally:
                self._native.free(handle)
        elif kind == self._ev_eof:
            transport = self._transports.get(event[1])
            if transport is not None:
                transport.eof()
        elif kind == self._ev_thread_died:
            log.error("native listener thread %s stopped: %s", event[1], os.strerror(int(event[2])))
        else:
            log.error("unknown native listener event %r", event)

    def _fail(self, event: tuple[Any, ...]) -> None:
        if event[0] not in (self._ev_data, self._ev_writable, self._ev_lost, self._ev_eof):
            return
        handle = event[1]
        transport = self._transports.get(handle)
        try:
            if transport is not None:
                protocol = transport.get_protocol()
                if isinstance(protocol, NativeConnection):
                    protocol.failed()
            self._native.abort(handle)  # its EV_LOST finishes it
        except Exception:
            log.exception("aborting a failed native connection failed")

    # -- agents ---------------------------------------------------------------------------

    def on_agent(self, agent: bytes, label: str) -> None:
        """Python validated ``agent`` and labelled it ``label``: native may serve it from
        its next call on. Never raises (native serving is only an optimisation)."""
        try:
            if self._registry.add(agent, self._label_index(label)) < 0:
                self._log_now_and_then(
                    "registry", "native agent registry full: new agents are served by Python"
                )
        except Exception as e:  # noqa: BLE001 - the agent stays on Python's path
            self._log_now_and_then("registry", "agent not registered natively: %r", e)

    # -- stop ------------------------------------------------------------------------------

    @property
    def accepting_resumes_at(self) -> float | None:
        """When accepting resumes after an out-of-files pause (the loop's time), or None."""
        timer = self._accept_timer
        return None if timer is None else timer.when()

    def close(self) -> None:
        """Accept no more connections (those open are served on, as a closed
        ``asyncio.Server``'s: the server drains them, then calls :meth:`stop`)."""
        if self._accept_timer is not None:
            self._accept_timer.cancel()
            self._accept_timer = None
        if self._accepting and self._sock is not None:
            self._accepting = False
            self._loop.remove_reader(self._sock.fileno())
        self._sock = None

    def stop(self) -> None:
        """No more events: after :meth:`close` and the drain, before native stops."""
        self.close()
        self._loop.remove_reader(self._events_fd)

    def _log_now_and_then(self, what: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._logged.get(what, float("-inf")) >= _LOG_EVERY_S:
            self._logged[what] = now
            log.warning(message, *args)


def serve_natively(
    loop: asyncio.AbstractEventLoop,
    native: NativeMachine,
    listener: Listener,
    sock: socket.socket,
    *,
    constants: Any,
    registry: Registry,
    label_index: Callable[[str], int],
) -> NativeListener:
    """What ``Server._serve_until_stopped`` calls instead of ``loop.create_server`` for an
    endpoint served natively (framed Thrift without TLS, native threads started): accepts
    on ``sock`` (listening) from now on. ``close()`` it as the asyncio server, then, after
    the drain, ``stop()`` it and stop ``native``."""
    return NativeListener(
        loop,
        native,
        listener,
        constants=constants,
        registry=registry,
        label_index=label_index,
        sock=sock,
    )
