"""A pure-Python model of the native listener (``_core.Listener``) in step mode: the
reference its C machine is diffed against, and what lets the Python shim
(:mod:`snowflake_server._serving.native`) be tested without it.

It implements the whole contract of /work/briefs/native-api-27.md for ``threads=0``:
``adopt`` real sockets, ``step(timeout_ms)`` (one ``select`` and the work for what it
returned and for the closes asked meanwhile), the event list on an eventfd, every
command, the lease and its give-back. Frames are judged as step 1's ``scan_prefix``
judges them (:func:`scan_prefix`, written again here in Python), matched exactly as
``fastpath.match_get_id``, answered with ``fastpath.get_id_reply``, and the ids come from
a callable given to :meth:`ModelListener.set_state` (None: SLOW).

Small and obviously right first, fast never: it is test support.
"""

from __future__ import annotations

import contextlib
import errno as errnos
import os
import select
import socket
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from snowflake_server._service import MAX_USER_AGENT_LENGTH
from snowflake_server._thrift.fastpath import get_id_reply, match_get_id

__all__ = [
    "EV_DATA",
    "EV_EOF",
    "EV_LOST",
    "EV_THREAD_DIED",
    "EV_WRITABLE",
    "HANDOVER",
    "MATCH",
    "NATIVE_MAX_FRAME",
    "NATIVE_READ",
    "NEED_MORE",
    "ModelListener",
    "ModelRegistry",
    "scan_prefix",
]

EV_DATA, EV_WRITABLE, EV_LOST, EV_THREAD_DIED, EV_EOF = 1, 2, 3, 4, 5
NEED_MORE, MATCH, HANDOVER = 0, 1, 2
NATIVE_READ = 4096
_OVERHEAD = 30  # every byte of a get_id frame but its agent's
NATIVE_MAX_FRAME = _OVERHEAD + MAX_USER_AGENT_LENGTH
_HEAD = struct.pack(">II", 0x80010001, 6) + b"get_id"  # frame bytes 4..18
_FIELD = b"\x0b\x00\x01"  # frame bytes 22..25
_SEQID_AT, _AGENT_AT = 18, 29


def scan_prefix(buf: bytes, limit: int) -> tuple[int, str, int]:
    """``(result, why, frame_len)`` for the first frame of ``buf``, as step 1's
    ``sf_scan_prefix`` decides: MATCH (a whole native ``get_id``, ``frame_len`` bytes),
    NEED_MORE (a proper prefix of one), HANDOVER (never one; ``why`` is ``length`` or
    ``request``)."""
    if not buf:
        return NEED_MORE, "", 0
    most = min(NATIVE_MAX_FRAME - 4, limit)
    if len(buf) < 4:
        # The length's first bytes: zero for any length native serves (< 256).
        if most < _OVERHEAD - 4 or any(buf):
            return HANDOVER, "length", 0
        return NEED_MORE, "", 0
    size = int.from_bytes(buf[:4], "big")
    if not _OVERHEAD - 4 <= size <= most:
        return HANDOVER, "length", 0
    n = size + 4
    # What the frame must hold but its seqid and agent, byte for byte, as far as it came.
    fixed = dict(enumerate(_HEAD, 4))
    fixed |= dict(enumerate(_FIELD, 22))
    fixed |= dict(enumerate((n - _OVERHEAD).to_bytes(4, "big"), 25))
    if any(buf[i] != b for i, b in fixed.items() if i < len(buf)):
        return HANDOVER, "request", 0
    if len(buf) < n:
        return NEED_MORE, "", 0
    if buf[n - 1] != 0:
        return HANDOVER, "request", 0
    assert match_get_id(bytes(buf[:n]), limit) is not None  # the model's own check
    return MATCH, "", n


class ModelRegistry:
    """``_core.AgentRegistry`` without its bound's memory tricks: agent bytes to an index."""

    def __init__(self, most: int = 4096) -> None:
        self._index: dict[bytes, int] = {}
        self._labels: list[int] = []
        self._most = most

    def add(self, agent: bytes, label_index: int, /) -> int:
        if len(agent) > MAX_USER_AGENT_LENGTH:
            raise ValueError(f"an agent has at most {MAX_USER_AGENT_LENGTH} bytes")
        known = self._index.get(agent)
        if known is not None:
            if self._labels[known] != label_index:
                raise ValueError("this agent is registered under another label")
            return known
        if len(self._labels) >= self._most:
            return -1
        self._index[agent] = len(self._labels)
        self._labels.append(label_index)
        return self._index[agent]

    def lookup(self, agent: bytes, /) -> int:
        return self._index.get(agent, -1)

    def label(self, index: int, /) -> int:
        return self._labels[index]

    def __len__(self) -> int:
        return len(self._labels)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    generation: int
    leased: bool = False
    reading: bool = False
    closing: str = ""  # "", "flush" (close once out is sent) or "abort"
    lost: bool = False
    eof: bool = False  # the peer half-closed: nothing more is read
    inbuf: bytearray = field(default_factory=bytearray)  # leased: at most one partial frame
    out: bytearray = field(default_factory=bytearray)
    writable: bool = True
    forwarded: int = 0
    consumed: int = 0
    served: int = 0
    read_seen: bool = False


class ModelListener:
    """``_core.Listener(threads=0, ...)`` in Python; see the module docstring.

    ``stats`` and ``budget`` are accepted for the contract's signature and not used:
    the model counts in :attr:`calls` and :attr:`handoffs` instead.
    """

    def __init__(
        self,
        threads: int,
        registry: Any,
        stats: Any,
        limit: int,
        *,
        budget: Any = None,
        high: int = 65536,
        low: int = 16384,
        forward_high: int = 65536,
        max_conns: int = 65536,
    ) -> None:
        if threads != 0:
            raise ValueError("the model runs in step mode only (threads=0)")
        self._registry = registry
        self._limit = limit
        self.high, self.low, self.forward_high = high, low, forward_high
        self._max_conns = max_conns
        self._slots: list[_Conn | None] = []
        self._generations: list[int] = []
        self._events: list[tuple[Any, ...]] = []
        self._events_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ids: Callable[[], int | None] | None = None
        self.calls = 0
        self.handoffs: Counter[str] = Counter()
        self.strict = True  # Python never writes while native holds the lease
        self.stopped = False

    # -- set-up and events ----------------------------------------------------------

    @property
    def events_fd(self) -> int:
        return self._events_fd

    def set_state(self, state: Callable[[], int | None] | None) -> None:
        """The model's state is an id source: a new id, or None for SLOW."""
        self._ids = state

    def take_events(self) -> list[tuple[Any, ...]]:
        events, self._events = self._events, []
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._events_fd)
        return events

    def _post(self, *event: Any) -> None:
        if not self._events:
            os.eventfd_write(self._events_fd, 1)
        self._events.append(event)

    def adopt(self, fd: int) -> int:
        sock = socket.socket(fileno=fd)  # owned from here on: closed if no slot is free
        sock.setblocking(False)
        free = [slot for slot, conn in enumerate(self._slots) if conn is None]
        if free:
            slot = free[0]
        else:
            if len(self._slots) >= self._max_conns:
                sock.close()
                raise OSError(errnos.EMFILE, "no free connection slot")
            slot = len(self._slots)
            self._slots.append(None)
            self._generations.append(0)
        self._generations[slot] += 1
        self._slots[slot] = _Conn(sock, self._generations[slot])
        return slot | self._generations[slot] << 32

    def _conn(self, handle: int) -> _Conn | None:
        slot, generation = handle & 0xFFFFFFFF, handle >> 32
        conn = self._slots[slot] if slot < len(self._slots) else None
        return conn if conn is not None and conn.generation == generation else None

    # -- commands -------------------------------------------------------------------

    def write(self, handle: int, data: bytes) -> tuple[int, bool]:
        c = self._conn(handle)
        if c is None or c.lost or c.closing:
            return 0, False
        if c.leased and self.strict:
            # Legal for the C listener (``out`` keeps the order of the appends), but with
            # native threads a reply Python writes while native holds the lease could pass
            # one native is about to append for an earlier frame: the shim never does it.
            raise AssertionError("Python wrote while native held the lease")
        was_empty, below = not c.out, len(c.out) <= self.high
        c.out += data
        if was_empty:
            self._flush(handle, c, post=False)
        became_paused = below and c.writable and len(c.out) > self.high
        if became_paused:
            c.writable = False  # Python pauses itself (asyncio's contract): no event
        return len(c.out), became_paused

    def grant(self, handle: int, consumed: int, prefix: bytes = b"") -> bool:
        c = self._conn(handle)
        if c is None:
            return False
        c.consumed = max(c.consumed, consumed)  # a grant says what consume() says
        if c.leased and not prefix:
            return consumed == c.forwarded  # held already (C's decision: True again)
        if c.lost or c.closing or c.eof or c.inbuf or consumed != c.forwarded:
            return False
        if prefix and (
            c.leased
            or len(prefix) > NATIVE_MAX_FRAME
            or scan_prefix(prefix, self._limit)[0] != NEED_MORE
        ):
            return False  # kept only if it can lead to a frame native serves
        c.leased = True
        c.inbuf += prefix
        return True

    def revoke(self, handle: int) -> None:
        c = self._conn(handle)
        if c is not None and c.leased:
            self._give_back(handle, c, 0, None)

    def consume(self, handle: int, consumed: int) -> None:
        c = self._conn(handle)
        if c is not None:
            c.consumed = max(c.consumed, consumed)

    def reading(self, handle: int, on: bool) -> None:
        c = self._conn(handle)
        if c is not None:
            c.reading = on

    def close(self, handle: int) -> None:
        c = self._conn(handle)
        if c is not None and not c.lost and not c.closing:
            c.closing = "flush"  # with bytes out: done by a step once they are sent
            c.leased = False
            c.inbuf.clear()  # a kept partial frame is dropped, not posted
            if not c.out:
                self._finish_close(handle, c)  # nothing to send: at once, as C does

    def abort(self, handle: int) -> None:
        c = self._conn(handle)
        if c is not None and not c.lost:
            c.closing = "abort"
            c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._lose(handle, c, 0)

    def free(self, handle: int) -> None:
        c = self._conn(handle)
        if c is not None and c.lost:
            self._slots[handle & 0xFFFFFFFF] = None

    def take_read_seen(self, handle: int) -> bool:
        c = self._conn(handle)
        if c is None:
            return False
        seen, c.read_seen = c.read_seen, False
        return seen

    def served(self, handle: int) -> int:
        c = self._conn(handle)
        return 0 if c is None else c.served

    def partial(self, handle: int) -> int:
        c = self._conn(handle)
        return 0 if c is None or not c.leased else len(c.inbuf)

    def out_len(self, handle: int) -> int:
        c = self._conn(handle)
        return 0 if c is None else len(c.out)

    def forwarded(self, handle: int) -> int:
        c = self._conn(handle)
        return 0 if c is None else c.forwarded

    def leased(self, handle: int) -> bool:
        """The model's own probe (not in the contract): native holds the lease."""
        c = self._conn(handle)
        return c is not None and c.leased

    def stop(self, timeout_s: float = 1.0) -> bool:
        for slot, c in enumerate(self._slots):
            if c is not None and not c.lost:
                c.sock.close()
                c.lost = True
            self._slots[slot] = None
        if not self.stopped:
            os.close(self._events_fd)
        self.stopped = True
        return True

    # -- the owner thread's loop ------------------------------------------------------

    def step(self, timeout_ms: int) -> int:
        """One turn: ``select`` on every connection that wants reading or flushing (at most
        ``timeout_ms``), one read per readable connection, flushes, closes asked for."""
        handles = [
            slot | c.generation << 32
            for slot, c in enumerate(self._slots)
            if c is not None and not c.lost
        ]
        for h in handles:  # closes asked for with nothing left to send
            c = self._conn(h)
            if c is not None and c.closing == "flush" and not c.out:
                self._finish_close(h, c)
        live = [(h, c) for h in handles if (c := self._conn(h)) is not None and not c.lost]
        rd = [c.sock for h, c in live if self._wants_read(c)]
        wr = [c.sock for h, c in live if c.out]
        if not (rd or wr):
            return 0
        readable, writable, _ = select.select(rd, wr, [], max(timeout_ms, 0) / 1000)
        handled = 0
        for h, c in live:
            if c.sock in writable and not c.lost:
                handled += 1
                self._flush(h, c, post=True)
            if c.sock in readable and not c.lost:
                handled += 1
                self._read(h, c)
            if not c.lost and c.closing == "flush" and not c.out:
                self._finish_close(h, c)
        return handled

    def _wants_read(self, c: _Conn) -> bool:
        if not c.reading or c.closing or c.eof:
            return False
        if c.leased:
            return len(c.out) <= self.high
        return c.forwarded - c.consumed <= self.forward_high

    def _read(self, handle: int, c: _Conn) -> None:
        try:
            data = c.sock.recv(NATIVE_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._hang_up(handle, c, e.errno or errnos.EIO)
            return
        if not data:
            # Half-closed: the lease's bytes go to Python, which serves what it received
            # and closes (the connection stays open until then, as asyncio's).
            if c.leased:
                self._give_back(handle, c, 0, None)
            c.eof = True
            self._post(EV_EOF, handle, 0)
            return
        c.read_seen = True
        if not c.leased:
            c.forwarded += len(data)
            self._post(EV_DATA, handle, data)
            return
        c.inbuf += data
        self._serve(handle, c)
        if not c.lost:
            self._flush(handle, c, post=True)

    def _serve(self, handle: int, c: _Conn) -> None:
        """Answer the whole native frames at the start of ``inbuf``; give the lease back
        at the first that is not native's."""
        pos = 0
        buf = c.inbuf
        while True:
            result, why, n = scan_prefix(bytes(buf[pos : pos + NATIVE_MAX_FRAME]), self._limit)
            if result == NEED_MORE:
                break
            if result == HANDOVER:
                self._give_back(handle, c, pos, why)
                return
            agent = bytes(buf[pos + _AGENT_AT : pos + n - 1])
            if self._registry.lookup(agent) < 0:
                self._give_back(handle, c, pos, "agent")
                return
            id_ = self._ids() if self._ids is not None else None
            if id_ is None:
                self._give_back(handle, c, pos, "slow" if self._ids is not None else "gate")
                return
            c.out += get_id_reply(bytes(buf[pos + _SEQID_AT : pos + _SEQID_AT + 4]), id_)
            c.served += 1
            self.calls += 1
            pos += n
        del buf[:pos]

    def _give_back(self, handle: int, c: _Conn, pos: int, why: str | None) -> None:
        c.leased = False
        rest = bytes(c.inbuf[pos:])
        c.inbuf.clear()
        if rest:
            c.forwarded += len(rest)
            self._post(EV_DATA, handle, rest)
        if why is not None:
            self.handoffs[why] += 1

    def _flush(self, handle: int, c: _Conn, *, post: bool) -> None:
        if c.out:
            try:
                sent = c.sock.send(c.out, socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                self._hang_up(handle, c, e.errno or errnos.EIO)
                return
            del c.out[:sent]
        if not post:
            return
        if c.writable and len(c.out) > self.high:
            c.writable = False
            self._post(EV_WRITABLE, handle, False)
        elif not c.writable and len(c.out) <= self.low:
            c.writable = True
            self._post(EV_WRITABLE, handle, True)

    def _hang_up(self, handle: int, c: _Conn, error: int) -> None:
        """A read or send error: the lease's bytes go to Python, then the close."""
        if c.leased:
            self._give_back(handle, c, 0, None)
        self._lose(handle, c, error)

    def _finish_close(self, handle: int, c: _Conn) -> None:
        with contextlib.suppress(OSError):
            c.sock.shutdown(socket.SHUT_WR)
        self._lose(handle, c, 0)

    def _lose(self, handle: int, c: _Conn, error: int) -> None:
        c.sock.close()
        c.lost = True
        c.leased = False
        c.inbuf.clear()
        c.out.clear()
        self._post(EV_LOST, handle, error)
