"""A fuzz target for the server's request decoder, for the suite (a few hundred inputs)
and ``make soak`` (as many as fit in its time).

Inputs are binary-protocol calls built to reach both paths of the server: the
``get_id`` fast path (a framed call of exactly its shape) and the generic path
behind the scanner (every other method, unknown and mistyped fields, nested
containers, unknown type codes, the old non-strict header), on the framed or the
buffered transport; announcing lengths and counts they do not hold; pipelined,
mutated, cut short, and sent in pieces. Each input goes on a connection of its
own; for each, :class:`RequestFuzz` checks that the server answers with whole
Thrift replies or closes, within a bound, and that a well-behaved client on
another connection is served meanwhile. The caller bounds memory over the run.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.thrift import TMessageType, TType

from tests.support.endpoints import BytesReader, Endpoints, encode_call

__all__ = ["ANSWER_BOUND_S", "RequestFuzz", "requests"]

ANSWER_BOUND_S = 5.0
"""A safety bound, not a target: the server answers or closes in milliseconds."""

_FIXED = {2: 1, 3: 1, 4: 8, 6: 2, 8: 4, 10: 8}  # bool, byte, double, i16, i32, i64
_STRING, _STRUCT, _MAP = 11, 12, 13
_CONTAINERS = (12, 13, 14, 15)  # struct, map, set, list
_UNKNOWN = (0, 1, 5, 7, 9, 16, 99, 255)  # not a type (0 is a struct's stop byte)
_HUGE = (2**31 - 1, 2**30, 2**20, 65537, -1, -(2**31))
_METHODS = ("get_id", "get_ids", "get_worker_id", "get_timestamp", "get_datacenter_id",
            "get_layout", "no_such_method", "")  # fmt: skip
_VALID = (
    encode_call("get_id", framed=False, useragent="fuzz"),
    encode_call("get_ids", framed=False, useragent="fuzz", count=3),
    encode_call("get_worker_id", framed=False),
    encode_call("get_layout", framed=False),
)
_GET_ID = struct.pack(">II", 0x80010001, 6) + b"get_id"


def _i32(n: int) -> bytes:
    return struct.pack(">i", n)


def _declared(draw: st.DrawFn, actual: int) -> int:
    """A length or count: mostly the truth, sometimes far more (or less) than follows."""
    if draw(st.integers(0, 9)) < 7:
        return actual
    return draw(st.sampled_from(_HUGE) | st.integers(-(2**31), 2**31 - 1))


@st.composite
def _type(draw: st.DrawFn, depth: int) -> int:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(_UNKNOWN))
    simple = [*_FIXED, _STRING]
    return draw(st.sampled_from(simple + list(_CONTAINERS) if depth < 3 else simple))


@st.composite
def _value(draw: st.DrawFn, ttype: int, depth: int) -> bytes:
    fixed = _FIXED.get(ttype)
    if fixed is not None:
        return draw(st.binary(min_size=fixed, max_size=fixed))
    if ttype == _STRING:
        data = draw(st.binary(max_size=24) | st.text(max_size=12).map(str.encode))
        return _i32(_declared(draw, len(data))) + data
    if ttype == _STRUCT:
        return draw(_fields(depth + 1))
    types = [draw(_type(depth + 1)) for _ in range(2 if ttype == _MAP else 1)]
    if any(t in _UNKNOWN for t in types):
        # Elements that cannot be written: the bomb announces 2^31 of them.
        return bytes(types) + _i32(draw(st.sampled_from(_HUGE) | st.integers(0, 3)))
    count = draw(st.integers(0, 4))
    elements = [draw(_value(t, depth + 1)) for _ in range(count) for t in types]
    return bytes(types) + _i32(_declared(draw, count)) + b"".join(elements)


@st.composite
def _fields(draw: st.DrawFn, depth: int = 0) -> bytes:
    out = bytearray()
    for _ in range(draw(st.integers(0, 3 if depth < 3 else 1))):
        ttype = draw(_type(depth))
        out += bytes([ttype]) + struct.pack(">h", draw(st.integers(-2, 4)))
        if ttype not in _UNKNOWN:
            out += draw(_value(ttype, depth))
    if draw(st.integers(0, 19)):
        out.append(0)  # the stop byte, nearly always
    return bytes(out)


@st.composite
def _call(draw: st.DrawFn) -> bytes:
    """One message, unframed: the fast path's get_id, a valid call, or any call."""
    shape = draw(st.sampled_from(["get_id", "valid", "built"]))
    seqid = _i32(draw(st.integers(-(2**31), 2**31 - 1)))
    if shape == "get_id":
        agent = draw(
            st.sampled_from([b"fuzz", b"a" * 128, b"a" * 129, b"", b"1bad", b"\xff\xfe"])
            | st.binary(max_size=40)
        )
        return _GET_ID + seqid + b"\x0b\x00\x01" + _i32(len(agent)) + agent + b"\x00"
    if shape == "valid":
        return draw(st.sampled_from(_VALID))
    name = draw(st.sampled_from(_METHODS)).encode()
    mtype = draw(st.sampled_from([1, 1, 1, 1, 2, 3, 4, 7]))
    if draw(st.integers(0, 9)):
        head = struct.pack(">I", 0x80010000 | mtype) + _i32(_declared(draw, len(name))) + name
    else:  # the old non-strict header
        head = _i32(len(name)) + name + bytes([mtype])
    return head + seqid + draw(_fields())


@st.composite
def requests(draw: st.DrawFn, framed: bool) -> list[bytes]:
    """What a client sends on one connection, in the pieces it sends it in."""
    data = bytearray()
    for call in draw(st.lists(_call(), min_size=1, max_size=3)):
        data += _i32(_declared(draw, len(call))) + call if framed else call
    for _ in range(draw(st.integers(0, 2))):
        action = draw(st.sampled_from(["flip", "cut", "append"]))
        at = draw(st.integers(0, len(data)))
        if action == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif action == "cut":
            del data[at:]
        else:
            data += draw(st.binary(min_size=1, max_size=16))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=3))))
    return [bytes(data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


class RequestFuzz:
    """Sends fuzzed requests to ``server`` (see the module docstring); counts what it saw."""

    def __init__(self, server: Endpoints) -> None:
        self._server = server
        self._framed = server.transport == "framed"
        self._good = server.raw_client(timeout_s=ANSWER_BOUND_S)
        self.sent = self.replies = self.silent_closes = 0
        self.slowest_s = 0.0

    def run(self, examples: int) -> None:
        """``examples`` inputs; an ``AssertionError`` (after hypothesis has shrunk the
        input) if one of them was neither answered nor closed in time, or was answered
        with bytes that are not whole replies, or held up the well-behaved client."""

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(pieces=requests(self._framed))
        def one(pieces: list[bytes]) -> None:
            self.send(pieces)

        one()

    def send(self, pieces: list[bytes]) -> None:
        server = self._server
        with socket.create_connection((server.host, server.port), ANSWER_BOUND_S) as raw:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with contextlib.suppress(OSError):  # closed on us: its answer is on its way
                for piece in pieces:
                    raw.sendall(piece)
            # Served while this connection is open, whatever it sent.
            assert self._good.get_id("fuzz-well-behaved") > 0
            started = time.monotonic()
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_WR)  # no more: answer what you have, then close
            answer, reset = self._read_to_close(raw, started + ANSWER_BOUND_S)
        self.slowest_s = max(self.slowest_s, time.monotonic() - started)
        self.sent += 1
        replies = self._whole_replies(answer, reset)
        self.replies += replies
        self.silent_closes += replies == 0

    @staticmethod
    def _read_to_close(raw: socket.socket, deadline: float) -> tuple[bytes, bool]:
        answer = bytearray()
        while True:
            raw.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                chunk = raw.recv(65536)
            except ConnectionResetError:
                return bytes(answer), True
            except TimeoutError:
                raise AssertionError(
                    f"neither answered nor closed within {ANSWER_BOUND_S} s "
                    f"(answered so far: {bytes(answer[:80])!r})"
                ) from None
            if not chunk:
                return bytes(answer), False
            answer += chunk

    def _whole_replies(self, answer: bytes, reset: bool) -> int:
        """How many replies ``answer`` holds; each must be a whole REPLY or EXCEPTION
        message (a reset may cut the last one short)."""
        reader = BytesReader(answer)
        protocol: Any = TBinaryProtocol(reader, decode_response=False)  # type: ignore[no-untyped-call]
        replies = 0
        while (at := reader.position) < len(answer):
            try:
                if self._framed:
                    (length,) = struct.unpack(">i", reader.read(4))
                    at += 4
                # The head by hand: the name is the call's, bytes that need not be UTF-8.
                version, name_length = struct.unpack(">Ii", reader.read(8))
                reader.read(name_length + 4)  # the name and the seqid
                protocol.skip(TType.STRUCT)
            except (EOFError, struct.error) as e:
                assert reset, f"not a whole reply at byte {at}: {answer[at : at + 80]!r} ({e!r})"
                break
            assert version & 0xFFFF0000 == 0x80010000, answer[at : at + 80]
            assert version & 0xFF in (TMessageType.REPLY, TMessageType.EXCEPTION), answer[
                at : at + 80
            ]
            if self._framed:
                assert reader.position - at == length, "a reply that does not fill its frame"
            replies += 1
        return replies
