"""Where one binary-protocol message ends, and whether it is well formed, found by
reading each byte once before any decoder sees it.

The buffered transport has no frames: a server learns where a call ends only by
parsing it, and bytes arrive in pieces. :class:`MessageScanner` walks the
message as far as the bytes received allow, keeps its place, and goes on when
more arrive, so a call trickled in a byte at a time costs no more than one sent
whole. On the framed transport it checks that a frame holds exactly one
message.

It also bounds what thriftpy2's decoder will do, and what it does itself, per
request rather than per byte or frame: thriftpy2 (0.7) skips an unknown field's
container by looping over its announced count with no bytes behind it (one
header of 2^31 elements froze a process for seconds). The scanner refuses a type
code that does not exist, a container that announces more elements than bytes
could follow, a nesting deeper than ``MAX_DEPTH``, more than ``MAX_VALUES``
values walked one by one, and a message longer than the limit the moment a
length announces it, before the bytes are received. Its own work is a constant
per step whatever the nesting (one walk with its own stack, not a generator per
level): 64 KiB of empty structs nested 60 deep held the loop for half a second.
"""

from __future__ import annotations

from collections.abc import Generator

__all__ = ["MAX_DEPTH", "MAX_VALUES", "Malformed", "MessageScanner", "TooLarge"]

MAX_DEPTH = 64
MAX_VALUES = 64
"""Fields and container elements a message may hold, a container of fixed-size
elements counting as one value (it is skipped in one step). This service's calls
carry at most two; the rest is room for fields a later IDL adds. The binary
protocol gives a struct no length, so unknown fields cannot be skipped by length:
each value is a step of the walk and of thriftpy2's decoder, and a 1,068-byte
frame of 1,022 empty structs held the loop 0.38 ms (twenty plain calls). Past the
bound a message is refused with a Thrift PROTOCOL_ERROR before it is decoded."""

# Type codes of the binary protocol, and the bytes a value of each fixed-size one takes.
_STOP, _STRING, _STRUCT, _MAP, _SET, _LIST = 0, 11, 12, 13, 14, 15
_FIXED = {2: 1, 3: 1, 4: 8, 6: 2, 8: 4, 10: 8}  # bool, byte, double, i16, i32, i64
_KNOWN = {*_FIXED, _STRING, _STRUCT, _MAP, _SET, _LIST}
_VERSION_MASK, _VERSION_1 = 0xFFFF0000, 0x80010000

# What the walk yields: n > 0 asks for the next n bytes (sent back), n < 0 skips -n.
_Walk = Generator[int, bytes, None]


class Malformed(ValueError):
    """The bytes are not a binary-protocol message (or one too costly to decode)."""


class TooLarge(ValueError):
    """The message is longer than the limit (announced or received)."""


class MessageScanner:
    """Finds the end of one message in a buffer that grows; make one per message.

    ``limit``: the most bytes a message may take (``--max-frame-size``).
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._walk = _message()
        self._need = next(self._walk)
        self._length = 0  # bytes of the message walked so far

    def feed(self, buf: bytes | bytearray, start: int) -> int | None:
        """The message's length if it is complete in ``buf`` from ``start`` on (the
        message's first byte, the same on every call, though ``buf`` may have grown),
        else ``None``. Raises ``Malformed`` or ``TooLarge``."""
        available = len(buf) - start
        while True:
            need = self._need
            size = need if need > 0 else -need
            end = self._length + size
            if end > self._limit:
                raise TooLarge(
                    f"request exceeds --max-frame-size {self._limit} bytes (at least {end})"
                )
            if end > available:
                return None
            at = start + self._length
            self._length = end
            try:
                self._need = self._walk.send(bytes(buf[at : at + size]) if need > 0 else b"")
            except StopIteration:
                return end


def _message() -> _Walk:
    head = int.from_bytes((yield 4), "big")
    if head & 0x80000000:
        if head & _VERSION_MASK != _VERSION_1:
            raise Malformed(f"bad protocol version {head >> 16:#06x} (binary protocol 0x8001)")
        yield -_length((yield 4), "method name")
    else:
        yield -head  # the name of an old, non-strict message
        yield -1  # its message type
    yield -4  # the seqid
    # What is open, innermost last: None for a struct (fields until its stop byte), or
    # a container's [values left, its element type(s)] (a map's alternate key, value).
    open_: list[list[int] | None] = [None]
    values = 0
    while open_:
        inner = open_[-1]
        if inner is None:
            ttype = (yield 1)[0]
            if ttype == _STOP:
                open_.pop()
                continue
            if ttype not in _KNOWN:
                raise Malformed(f"unknown type code {ttype}")
            yield -2  # the field id
        elif inner[0]:
            inner[0] -= 1
            ttype = inner[len(inner) - 1 - inner[0] % (len(inner) - 1)]
        else:
            open_.pop()
            continue
        values += 1
        if values > MAX_VALUES:
            raise Malformed(f"more than {MAX_VALUES} values in one message")
        fixed = _FIXED.get(ttype)
        if fixed is not None:
            yield -fixed
        elif ttype == _STRING:
            yield -_length((yield 4), "string")
        elif ttype == _STRUCT:
            _nest(open_, None)
        else:
            is_map = ttype == _MAP
            header = yield 6 if is_map else 5
            types = [header[0], header[1]] if is_map else [header[0]]
            count = _length(header[len(types) :], "map" if is_map else "list")
            if not count:
                continue  # some writers leave an empty container's element types unset
            for element in types:
                if element not in _KNOWN:
                    raise Malformed(f"unknown element type code {element}")
            if all(t in _FIXED for t in types):
                # Fixed-size elements: skipped in one step, so a huge count is refused at once.
                yield -count * sum(_FIXED[t] for t in types)
            else:
                _nest(open_, [count * len(types), *types])


def _nest(open_: list[list[int] | None], opened: list[int] | None) -> None:
    if len(open_) >= MAX_DEPTH:
        raise Malformed(f"nested deeper than {MAX_DEPTH} levels")
    open_.append(opened)


def _length(raw: bytes, what: str) -> int:
    n = int.from_bytes(raw, "big", signed=True)
    if n < 0:
        raise Malformed(f"negative {what} length {n}")
    return n
