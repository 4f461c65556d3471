"""The Thrift protocol plugged into the serving core (snowflake_server/_thrift/protocol.py):
the bound on values walked, the reserved slots' peer-check-only protocol, and what a
frame or a buffered message may not be; through a driven Connection (its replies as a
client reads them) or the protocol alone."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
from thriftpy2.thrift import TApplicationException, TMessageType

from snowflake_server import GeneratorSettings, IdGenerator
from snowflake_server._ids.generator import WouldBlock, forbid_waiting
from snowflake_server._observability.metrics import NO_METHOD, ServiceMetrics
from snowflake_server._service import SnowflakeHandler
from snowflake_server._serving.refusal import Cause, Refused
from snowflake_server._thrift.processor import Processor, frame, service_methods
from snowflake_server._thrift.protocol import ThriftProtocol
from snowflake_server._thrift.scanner import MAX_VALUES
from tests.support.endpoints import encode_call
from tests.support.fakes import FakeClock
from tests.support.serving import Driven

T0 = 1_700_000_000_000
_STRING, _STRUCT, _LIST, _STOP = 11, 12, 15, 0


def _get_id_with_structs(count: int, seqid: int = 1) -> bytes:
    """An unframed get_id("agent") whose unknown field 9 is a list of ``count`` empty
    structs: valid Thrift, and each struct a value to walk."""
    name = b"get_id"
    head = struct.pack(">iI", -0x7FFEFFFF, len(name)) + name + struct.pack(">i", seqid)
    agent = struct.pack(">bhI", _STRING, 1, 5) + b"agent"
    structs = struct.pack(">bhbi", _LIST, 9, _STRUCT, count) + bytes([_STOP]) * count
    return head + agent + structs + bytes([_STOP])


@pytest.mark.parametrize("framed", [True, False])
def test_a_call_walking_more_than_max_values_is_refused_with_a_protocol_error(
    framed: bool,
) -> None:
    # The field, the list and its elements: MAX_VALUES - 2 structs is the most a call
    # may carry (a 1,068-byte get_id of 1,022 structs held the loop 0.38 ms).
    largest = MAX_VALUES - 2
    for count, served in ((largest, True), (largest + 1, False)):
        made = Driven(framed=framed)
        try:
            message = _get_id_with_structs(count)
            made.connection.data_received(frame(message) if framed else message)
            ((name, mtype, seqid, result),) = made.replies()
            if served:
                assert (name, mtype, seqid) == ("get_id", TMessageType.REPLY, 1)
                assert result.success > 0 and not made.transport.closed
            else:
                assert mtype == TMessageType.EXCEPTION
                assert result.type == TApplicationException.PROTOCOL_ERROR
                assert f"more than {MAX_VALUES} values" in result.message
                assert made.transport.closed
                assert made.metrics.totals().exceptions == {("protocol_error", NO_METHOD): 1}
                assert made.generator.counters().ids_generated == 0
        finally:
            made.close()


@pytest.fixture
def reserved() -> Iterator[Driven]:
    made = Driven(peer_check_only=True)
    yield made
    made.close()


def test_a_reserved_connection_serves_the_peer_checks(reserved: Driven) -> None:
    for seqid, method in enumerate(["get_worker_id", "get_datacenter_id", "get_layout"]):
        reserved.connection.data_received(_call(method, seqid))
        ((name, mtype, got, result),) = reserved.replies()
        assert (name, mtype, got) == (method, TMessageType.REPLY, seqid)
        assert result.success is not None
    reserved.connection.data_received(_call("get_timestamp", 9))
    ((_, mtype, _, result),) = reserved.replies()
    assert mtype == TMessageType.REPLY and result.success > 0


def test_a_reserved_connection_gets_unavailable_for_ids_and_stays_open(reserved: Driven) -> None:
    conn = reserved.connection
    get_id = _call("get_id", 1, useragent="joiner")
    assert conn.protocol is not None
    assert conn.protocol.fast(get_id) is None  # no fast path: it would issue an id
    conn.data_received(get_id)
    conn.data_received(_call("get_ids", 2, useragent="joiner", count=5))
    replies = reserved.replies()
    assert [(r[0], r[1], r[2]) for r in replies] == [
        ("get_id", TMessageType.REPLY, 1),
        ("get_ids", TMessageType.REPLY, 2),
    ]
    for _, _, _, result in replies:
        assert result.success is None
        assert "try another node" in result.unavailable.message  # the IDL's UnavailableError
    assert not reserved.transport.closed
    assert reserved.generator.counters().ids_generated == 0
    conn.data_received(_call("get_worker_id", 3))
    assert [r[2] for r in reserved.replies()] == [3]


def _call(method: str, seqid: int, **args: object) -> bytes:
    data = bytearray(encode_call(method, framed=True, **args))
    name_length = struct.unpack_from(">i", data, 8)[0]
    struct.pack_into(">i", data, 12 + name_length, seqid)
    return bytes(data)


# -- the protocol alone ---------------------------------------------------------------


def _protocol(*, framed: bool = True, limit: int = 1024, clock: FakeClock | None = None) -> (
    tuple[ThriftProtocol, IdGenerator]
):  # fmt: skip
    protocol, _, generator = _parts(framed=framed, limit=limit, clock=clock)
    return protocol, generator


def _parts(*, framed: bool = True, limit: int = 1024, clock: FakeClock | None = None) -> (
    tuple[ThriftProtocol, Processor, IdGenerator]
):  # fmt: skip
    """A protocol, the processor it answers with, and their generator."""
    clock = clock or FakeClock(T0)
    generator = IdGenerator(
        GeneratorSettings(max_backwards_ms=1000), clock=clock, sleep=clock.sleep
    )
    metrics = ServiceMetrics(generator, service_methods(), max_agents=8)
    stats = metrics.open_connection()
    processor = Processor(SnowflakeHandler(generator, metrics, stats, clock), stats)
    return ThriftProtocol(processor, framed=framed, limit=limit), processor, generator


def _refusal(protocol: ThriftProtocol, buf: bytes) -> Refused:
    """The refusal of ``buf``: as the core finds the request's end, or as it answers it."""
    try:
        request, _ = protocol.next_request(bytearray(buf), 0)
        assert request is not None, "a whole request"
        protocol.reply(request)
    except Refused as e:
        return e
    raise AssertionError("not refused")


@pytest.mark.parametrize(
    ("framed", "data", "kind", "why"),
    [
        (True, struct.pack(">i", 0), "frame_too_large", "frame of 0 bytes"),
        (True, struct.pack(">i", 1025), "frame_too_large", "--max-frame-size is 1024"),
        (True, frame(b"\x80\x01\x00\x01\x00\x00\x00\xffget_id"), "protocol_error", "undecodable"),
        (True, frame(encode_call("get_worker_id", framed=False)[:-1]), "protocol_error",
         "the frame ends inside its call"),
        (True, frame(encode_call("get_worker_id", framed=False) + b"\x00"), "protocol_error",
         "1 bytes after the call"),
        (True, frame(b"\x80\x01\x00\x01\x00\x00\x00\x01x\x00\x00\x00\x01\x0f\x00\x01\x08"
                     b"\x00\x00\x00\x01\x00\x00\x00\x07\x00\x00"), "protocol_error",
         "undecodable request: "),
        (False, b"\x80\x01\x00\x01\x00\x00\x00\x01x\x00\x00\x00\x01\x63", "protocol_error",
         "unknown type code 99"),
        (False, b"\x80\x01\x00\x01\x00\x00\x08\x00", "frame_too_large", "1024"),
    ],
)  # fmt: skip
def test_what_a_request_may_not_be(framed: bool, data: bytes, kind: str, why: str) -> None:
    protocol, generator = _protocol(framed=framed)
    refused = _refusal(protocol, data)
    assert refused.kind == kind and why in str(refused)
    assert generator.counters().ids_generated == 0


def test_a_buffered_message_is_found_whole_however_it_arrives() -> None:
    protocol, processor, _ = _parts(framed=False)
    call = encode_call("get_worker_id", framed=False)
    buf = bytearray()
    assert protocol.next_request(buf, 0) == (None, 0)
    assert not protocol.pending(buf)
    for byte in call[:-1]:
        buf.append(byte)
        assert protocol.next_request(buf, 0) == (None, 0)
        assert protocol.pending(buf)
    buf.append(call[-1])
    assert protocol.next_request(buf, 0) == (call, len(call))
    reply = protocol.reply(call)
    assert reply == processor.process_message(call)


def test_the_fast_path_reuses_a_connections_last_request_and_steps_aside_to_wait() -> None:
    clock = FakeClock(T0)
    protocol, generator = _protocol(clock=clock)
    first, second = _call("get_id", 1, useragent="fast"), _call("get_id", 2, useragent="fast")
    assert protocol.fast(first) is not None
    assert protocol.fast(second) is not None  # the same but for its seqid
    assert protocol.fast(_call("get_worker_id", 3)) is None  # not a get_id: the core's way
    assert generator.counters().ids_generated == 2
    clock.now -= 100  # the next id must wait 100 ms: never on the fast path
    forbid_waiting()
    try:
        assert protocol.fast(second) is None
        with pytest.raises(WouldBlock):
            protocol.reply(second)
        buffered, buffered_generator = _protocol(framed=False, clock=clock)
        message = encode_call("get_id", framed=False, useragent="waits")
        buffered_generator.next_id()  # the buffered one's generator too
        clock.now -= 100
        with pytest.raises(WouldBlock):
            buffered.reply(message)
    finally:
        forbid_waiting(False)
    assert generator.counters().ids_generated == 2


def test_a_refusal_is_rendered_as_the_transport_frames_it() -> None:
    for framed in (True, False):
        protocol, _ = _protocol(framed=framed)
        for cause, kind in (
            (Cause.UNAVAILABLE, TApplicationException.INTERNAL_ERROR),
            (Cause.TOO_SLOW, TApplicationException.PROTOCOL_ERROR),
            (Cause.TOO_LARGE, TApplicationException.PROTOCOL_ERROR),
        ):
            data = protocol.refusal(Refused("x", "why", cause))
            if framed:
                assert struct.unpack(">i", data[:4])[0] == len(data) - 4
                data = data[4:]
            # The exception's type is its i32 field 2, just before the closing STOP.
            assert struct.unpack(">i", data[-5:-1])[0] == kind
