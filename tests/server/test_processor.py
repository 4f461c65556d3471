"""The Thrift dispatch (snowflake_server/_thrift/processor.py), driven directly: requests
encoded as a Thrift client encodes them, answered by a real handler over a real
generator on a fake clock with real metrics, and the replies read back with the IDL.

Every outcome is a reply with the call's seqid: a method's result, one of its declared
exceptions, or a Thrift application error (an unknown method, a message type other than
CALL, a bug: INTERNAL_ERROR on a processor that goes on serving). Only bytes that are no
Thrift message, and ``WouldBlock``, leave the processor as exceptions."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from snowflake_thrift_client._idl import snowflake_thrift
from thriftpy2.protocol import TCyBinaryProtocol
from thriftpy2.thrift import TApplicationException, TMessageType
from thriftpy2.transport import TCyMemoryBuffer

from snowflake_server import GeneratorSettings, IdGenerator, Layout, decompose
from snowflake_server._ids.generator import WouldBlock, forbid_waiting
from snowflake_server._observability.audit import AuditLog
from snowflake_server._observability.metrics import NO_METHOD, ConnectionStats, ServiceMetrics
from snowflake_server._service import SnowflakeHandler
from snowflake_server._thrift.processor import (
    Processor,
    encode_error,
    frame,
    service_methods,
)
from snowflake_server._thrift.protocol import PEER_CHECK_METHODS
from tests.support.endpoints import encode_call
from tests.support.fakes import FakeClock
from tests.support.serving import ThriftReader

T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z
CALL, REPLY, EXCEPTION, ONEWAY = (
    TMessageType.CALL,
    TMessageType.REPLY,
    TMessageType.EXCEPTION,
    TMessageType.ONEWAY,
)
_VERSION_1 = -0x7FFF0000  # 0x80010000 as an i32: the strict binary protocol's version word


def message(name: str, mtype: int, seqid: int, body: bytes = b"\x00") -> bytes:
    """One binary-protocol message, unframed: its header, then ``body`` (the argument
    struct's bytes; an empty struct by default)."""
    raw = name.encode()
    head = struct.pack(">iI", _VERSION_1 | mtype, len(raw)) + raw + struct.pack(">i", seqid)
    return head + body


def request(method: str, seqid: int = 1, mtype: int = CALL, **args: object) -> bytes:
    """``method(**args)`` as thriftpy2's client encodes it, unframed, but with ``seqid``
    and message type ``mtype`` in its header."""
    body = encode_call(method, framed=False, **args)[12 + len(method) :]
    return message(method, mtype, seqid, body)


class _Recv:
    """``recv`` over fixed bytes, for :class:`ThriftReader`."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def recv(self, n: int) -> bytes:
        chunk, self._data = self._data[:n], self._data[n:]
        return chunk


def decode(reply: bytes) -> tuple[str, int, int, Any]:
    """(method name, message type, seqid, result struct or application error) of the
    one whole reply in ``reply``, unframed."""
    reader = ThriftReader(_Recv(reply), framed=False)
    decoded = reader.reply()
    assert not reader.pending(), "bytes after the reply"
    return decoded


class BreakableClock(FakeClock):
    """A fake clock that raises once broken: a bug under the handler, not a request error."""

    broken = False

    def __call__(self) -> int:
        if self.broken:
            raise RuntimeError("the clock broke")
        return super().__call__()


@dataclass
class Served:
    processor: Processor
    generator: IdGenerator
    metrics: ServiceMetrics
    stats: ConnectionStats
    clock: BreakableClock

    def call(self, method: str, seqid: int = 1, mtype: int = CALL, /, **args: object) -> Any:
        """The decoded reply to ``method(**args)`` sent with ``seqid`` and ``mtype``."""
        return decode(self.processor.process_message(request(method, seqid, mtype, **args)))

    def calls(self) -> dict[str, int]:
        """The calls observed so far, per method."""
        return {method: sum(h.counts) for method, h in self.stats.latency.items()}

    def issued(self) -> int:
        return self.generator.counters().ids_generated


def serve(settings: GeneratorSettings | None = None, *, audit: AuditLog | None = None) -> Served:
    clock = BreakableClock(T0)
    generator = IdGenerator(
        settings or GeneratorSettings(datacenter_id=2, worker_id=5),
        clock=clock,
        sleep=clock.sleep,
    )
    metrics = ServiceMetrics(generator, service_methods(), max_agents=100)
    stats = metrics.open_connection()
    processor = Processor(SnowflakeHandler(generator, metrics, stats, clock, audit), stats)
    return Served(processor, generator, metrics, stats, clock)


@pytest.fixture
def served() -> Served:
    return serve()


@pytest.fixture
def no_waiting() -> Iterator[None]:
    """This thread may not wait (as the event loop's): a wait raises ``WouldBlock``."""
    forbid_waiting()
    try:
        yield
    finally:
        forbid_waiting(False)


# -- every method's success -------------------------------------------------------------


def test_the_methods_are_the_idl_s_in_its_order() -> None:
    assert service_methods() == (
        "get_worker_id",
        "get_timestamp",
        "get_id",
        "get_datacenter_id",
        "get_ids",
        "get_layout",
    )
    assert list(service_methods()) == list(snowflake_thrift().Snowflake.thrift_services)


def test_each_method_replies_its_result_counted_once_and_no_failure(served: Served) -> None:
    replies = {
        "get_id": served.call("get_id", 1, useragent="alpha"),
        "get_ids": served.call("get_ids", 2, useragent="beta", count=3),
        "get_worker_id": served.call("get_worker_id", 3),
        "get_datacenter_id": served.call("get_datacenter_id", 4),
    }
    served.clock.now += 1234
    replies["get_timestamp"] = served.call("get_timestamp", 5)
    replies["get_layout"] = served.call("get_layout", 6)
    assert set(replies) == set(service_methods()), "a method of the IDL is not tried here"
    for seqid, (method, (name, mtype, got, _)) in enumerate(replies.items(), 1):
        assert (name, mtype, got) == (method, REPLY, seqid)

    first = replies["get_id"][3].success
    parts = decompose(first)
    assert (parts.timestamp_ms, parts.datacenter_id, parts.worker_id) == (T0, 2, 5)
    batch = replies["get_ids"][3].success
    assert batch == [first + 1, first + 2, first + 3]
    assert replies["get_worker_id"][3].success == 5
    assert replies["get_datacenter_id"][3].success == 2
    assert replies["get_timestamp"][3].success == T0 + 1234
    assert replies["get_layout"][3].success is not None

    assert served.issued() == 4
    assert served.stats.agent_ids == {"alpha": 1, "beta": 3}
    assert served.calls() == dict.fromkeys(service_methods(), 1)
    assert served.stats.exceptions == {}


def test_get_layout_replies_the_idl_struct_with_every_field_of_the_layout() -> None:
    layout = Layout(
        epoch_ms=T0 - 10_000,
        timestamp_bits=39,
        datacenter_id_bits=4,
        worker_id_bits=6,
        sequence_bits=11,
        clock_sequence_bits=3,
    )
    served = serve(GeneratorSettings(datacenter_id=3, worker_id=9, layout=layout))
    name, mtype, seqid, result = served.call("get_layout", 42)
    assert (name, mtype, seqid) == ("get_layout", REPLY, 42)
    assert result.success == snowflake_thrift().Layout(
        epoch_ms=T0 - 10_000,
        timestamp_bits=39,
        datacenter_id_bits=4,
        worker_id_bits=6,
        sequence_bits=11,
        datacenter_id=3,
        worker_id=9,
        clock_sequence_bits=3,
    )


@pytest.mark.parametrize("seqid", [0, 7, 2**31 - 1, -(2**31)])
def test_every_reply_echoes_the_call_s_seqid(served: Served, seqid: int) -> None:
    def broken_get_id() -> bytes:
        served.clock.broken = True
        try:
            return served.processor.process_message(request("get_id", seqid, useragent="a"))
        finally:
            served.clock.broken = False

    replies = [
        served.processor.process_message(request("get_worker_id", seqid)),  # a result
        served.processor.process_message(request("get_ids", seqid, useragent="a", count=0)),
        served.processor.process_message(message("no_such_method", CALL, seqid)),
        served.processor.process_message(request("get_id", seqid, ONEWAY, useragent="a")),
        broken_get_id(),  # INTERNAL_ERROR
    ]
    assert [decode(reply)[1:3] for reply in replies] == [
        (REPLY, seqid),
        (REPLY, seqid),
        (EXCEPTION, seqid),
        (EXCEPTION, seqid),
        (EXCEPTION, seqid),
    ]


# -- the declared exceptions ------------------------------------------------------------


def _clock_behind(served: Served) -> None:
    served.generator.next_id()
    served.clock.now -= 1000  # past the 5 ms waited out


def _shut_down(served: Served) -> None:
    served.generator.seal()  # ReservationError: an UnavailableError


def _as_is(served: Served) -> None:
    pass


@pytest.mark.parametrize(
    ("setup", "method", "args", "field", "kind", "said"),
    [
        (_as_is, "get_id", {"useragent": "9lives"}, "agent_error", "invalid_user_agent",
         "invalid user agent '9lives'"),
        (_as_is, "get_ids", {"useragent": "a b", "count": 2}, "agent_error",
         "invalid_user_agent", "invalid user agent 'a b'"),
        (_as_is, "get_ids", {"useragent": "batch", "count": 4097}, "count_error",
         "invalid_count", "count must be an integer in 1..4096, got 4097"),
        (_as_is, "get_ids", {"useragent": "batch", "count": 0}, "count_error",
         "invalid_count", "got 0"),
        (_clock_behind, "get_id", {"useragent": "late"}, "clock_error", "invalid_system_clock",
         "Refusing to generate id for 1000 milliseconds"),
        (_clock_behind, "get_ids", {"useragent": "late", "count": 2}, "clock_error",
         "invalid_system_clock", "Refusing to generate id for 1000 milliseconds"),
        (_shut_down, "get_id", {"useragent": "late"}, "unavailable", "unavailable",
         "the generator is shut down"),
        (_shut_down, "get_ids", {"useragent": "late", "count": 2}, "unavailable",
         "unavailable", "the generator is shut down"),
    ],
)  # fmt: skip
def test_a_request_error_is_the_declared_exception_in_a_reply(
    served: Served,
    setup: Callable[[Served], None],
    method: str,
    args: dict[str, object],
    field: str,
    kind: str,
    said: str,
) -> None:
    setup(served)
    issued = served.issued()
    name, mtype, seqid, result = served.call(method, 9, **args)
    assert (name, mtype, seqid) == (method, REPLY, 9)
    assert result.success is None
    declared = [f for f in ("clock_error", "agent_error", "count_error", "unavailable")
                if getattr(result, f, None) is not None]  # fmt: skip
    assert declared == [field]
    assert said in getattr(result, field).message
    assert served.issued() == issued, "a refused call issues no id"
    assert served.stats.exceptions == {(kind, method): 1}
    assert served.calls() == {method: 1}
    assert served.stats.agent_ids == {}


# -- application errors -----------------------------------------------------------------


def test_an_unknown_method_is_an_unknown_method_error_and_its_arguments_are_skipped(
    served: Served,
) -> None:
    """Its argument struct is read past, so the next call on the same input is read whole."""
    args = request("get_ids", useragent="agent", count=5)[12 + len("get_ids") :]
    stream = message("get_everything", CALL, 3, args) + request("get_worker_id", 4)
    out: Any = TCyMemoryBuffer()
    iprot: Any = TCyBinaryProtocol(TCyMemoryBuffer(stream))  # type: ignore[no-untyped-call]
    oprot: Any = TCyBinaryProtocol(out)  # type: ignore[no-untyped-call]
    served.processor.process(iprot, oprot)
    name, mtype, seqid, error = decode(out.getvalue())
    assert (name, mtype, seqid) == ("get_everything", EXCEPTION, 3)
    assert error.type == TApplicationException.UNKNOWN_METHOD
    assert error.message == "unknown method 'get_everything'"
    out = TCyMemoryBuffer()
    served.processor.process(iprot, TCyBinaryProtocol(out))  # type: ignore[no-untyped-call]
    assert decode(out.getvalue())[1:] == (
        REPLY,
        4,
        snowflake_thrift().Snowflake.get_worker_id_result(success=5),
    )
    assert served.stats.exceptions == {("unknown_method", NO_METHOD): 1}
    assert served.calls() == {"get_worker_id": 1}
    assert served.issued() == 0


def test_an_unknown_method_sent_oneway_is_still_an_unknown_method(served: Served) -> None:
    name, mtype, seqid, error = decode(
        served.processor.process_message(message("get_idd", ONEWAY, 5))
    )
    assert (name, mtype, seqid) == ("get_idd", EXCEPTION, 5)
    assert error.type == TApplicationException.UNKNOWN_METHOD
    assert served.stats.exceptions == {("unknown_method", NO_METHOD): 1}


@pytest.mark.parametrize("mtype", [ONEWAY, REPLY, EXCEPTION])
def test_a_method_sent_as_anything_but_a_call_is_refused_and_not_run(
    served: Served, mtype: int
) -> None:
    """A ONEWAY get_id would issue an id nobody receives: only CALL is served."""
    name, got, seqid, error = served.call("get_id", 6, mtype, useragent="oneway")
    assert (name, got, seqid) == ("get_id", EXCEPTION, 6)
    assert error.type == TApplicationException.INVALID_MESSAGE_TYPE
    assert error.message == f"message type {mtype} for 'get_id'; only CALL is served"
    assert served.issued() == 0
    assert served.stats.exceptions == {("protocol_error", "get_id"): 1}
    assert served.calls() == {}
    # Its arguments were read past: the processor serves the next call.
    assert served.call("get_id", 7, useragent="call")[1:3] == (REPLY, 7)


def test_a_bug_under_a_call_is_an_internal_error_and_the_processor_serves_on(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    served.clock.broken = True  # the generator's and the handler's clock: a bug, not a refusal
    with caplog.at_level(logging.ERROR, logger="snowflake_server._thrift.processor"):
        replies = [
            served.call("get_id", 1, useragent="alpha"),
            served.call("get_ids", 2, useragent="alpha", count=2),
            served.call("get_timestamp", 3),  # a method that declares no exception
        ]
    for (name, mtype, seqid, error), method, n in zip(
        replies, ("get_id", "get_ids", "get_timestamp"), (1, 2, 3), strict=True
    ):
        assert (name, mtype, seqid) == (method, EXCEPTION, n)
        assert error.type == TApplicationException.INTERNAL_ERROR
        assert error.message == f"internal error in {method}: RuntimeError: the clock broke"
    assert [r.getMessage() for r in caplog.records] == [
        "internal error in get_id",
        "internal error in get_ids",
        "internal error in get_timestamp",
    ]
    assert all(r.exc_info and r.exc_info[0] is RuntimeError for r in caplog.records)
    assert served.stats.exceptions == {
        ("internal_error", "get_id"): 1,
        ("internal_error", "get_ids"): 1,
        ("internal_error", "get_timestamp"): 1,
    }
    served.clock.broken = False
    assert served.call("get_id", 4, useragent="alpha")[1:3] == (REPLY, 4)
    assert served.issued() == 1


def test_ids_past_the_layout_s_timestamp_bits_are_an_internal_error() -> None:
    """``TimestampOverflowError`` is no request error: the IDL declares nothing for it."""
    layout = Layout(epoch_ms=T0, timestamp_bits=10)
    served = serve(GeneratorSettings(layout=layout))
    served.clock.now = layout.max_timestamp_ms + 1
    name, mtype, seqid, error = served.call("get_id", 8, useragent="late")
    assert (name, mtype, seqid) == ("get_id", EXCEPTION, 8)
    assert error.type == TApplicationException.INTERNAL_ERROR
    assert error.message.startswith("internal error in get_id: TimestampOverflowError: ")
    assert served.stats.exceptions == {("internal_error", "get_id"): 1}


# -- malformed arguments and bytes --------------------------------------------------------

_STRING, _I32, _STOP = 11, 8, 0


@pytest.mark.parametrize(
    ("method", "body", "field", "said"),
    [
        # useragent sent as an i32: read past as a field of the wrong type, so missing
        ("get_id", struct.pack(">bhi", _I32, 1, 7) + bytes([_STOP]), "agent_error",
         "user agent missing (field 1 must be a string)"),
        ("get_id", bytes([_STOP]), "agent_error", "user agent missing"),
        ("get_id", struct.pack(">bhI", _STRING, 1, 2) + b"\xff\xfe" + bytes([_STOP]),
         "agent_error", "user agent is not valid UTF-8"),
        # count sent as a string
        ("get_ids", struct.pack(">bhI", _STRING, 1, 1) + b"a"
         + struct.pack(">bhI", _STRING, 2, 1) + b"5" + bytes([_STOP]), "count_error",
         "count must be an integer in 1..4096, got None"),
    ],
)  # fmt: skip
def test_a_malformed_argument_struct_is_the_method_s_declared_exception(
    served: Served, method: str, body: bytes, field: str, said: str
) -> None:
    name, mtype, seqid, result = decode(
        served.processor.process_message(message(method, CALL, 11, body))
    )
    assert (name, mtype, seqid) == (method, REPLY, 11)
    assert said in getattr(result, field).message
    assert served.issued() == 0


def test_unknown_fields_and_any_field_order_are_served(served: Served) -> None:
    body = (
        struct.pack(">bhi", _I32, 2, 3)  # count before the agent
        + struct.pack(">bhI", _STRING, 9, 3) + b"why"  # a field the IDL does not have
        + struct.pack(">bhI", _STRING, 1, 5) + b"agent"
        + bytes([_STOP])
    )  # fmt: skip
    name, mtype, seqid, result = decode(
        served.processor.process_message(message("get_ids", CALL, 12, body))
    )
    assert (name, mtype, seqid) == ("get_ids", REPLY, 12)
    assert len(result.success) == 3
    assert served.stats.agent_ids == {"agent": 3}


def test_bytes_that_are_no_thrift_message_propagate_for_the_caller_to_close(
    served: Served,
) -> None:
    with pytest.raises(Exception, match="No protocol version header"):
        served.processor.process_message(b"\x00\x00\x00\x06get_id\x00\x00\x00\x01\x00")
    assert served.calls() == {} and served.stats.exceptions == {}


# -- the peer-check reserve ---------------------------------------------------------------


def test_allow_only_refuses_ids_with_unavailable_and_serves_the_peer_checks(
    served: Served,
) -> None:
    assert not served.processor.restricted
    served.processor.allow_only(PEER_CHECK_METHODS)
    assert served.processor.restricted
    for seqid, (method, args) in enumerate(
        [("get_id", {"useragent": "joiner"}), ("get_ids", {"useragent": "joiner", "count": 5})]
    ):
        name, mtype, got, result = served.call(method, seqid, **args)
        assert (name, mtype, got, result.success) == (method, REPLY, seqid, None)
        assert result.unavailable.message == (
            "this node serves all the connections it may (--max-connections): this "
            "connection may only check the node's ids; try another node"
        )
    assert served.issued() == 0
    assert served.stats.exceptions == {("unavailable", "get_id"): 1, ("unavailable", "get_ids"): 1}
    checks = {method: served.call(method, 20)[1:] for method in sorted(PEER_CHECK_METHODS)}
    assert all(mtype == REPLY and seqid == 20 for mtype, seqid, _ in checks.values())
    assert checks["get_worker_id"][2].success == 5
    assert checks["get_datacenter_id"][2].success == 2
    assert checks["get_timestamp"][2].success == T0
    assert checks["get_layout"][2].success.worker_id == 5
    assert served.issued() == 0


def test_a_refusal_a_method_does_not_declare_is_an_internal_error(served: Served) -> None:
    """``get_timestamp`` declares no ``UnavailableError``: refused, it can only be an
    application error (the reserve never refuses it; this pins what would happen)."""
    served.processor.allow_only({"get_id"})
    name, mtype, seqid, error = served.call("get_timestamp", 13)
    assert (name, mtype, seqid) == ("get_timestamp", EXCEPTION, 13)
    assert error.type == TApplicationException.INTERNAL_ERROR
    assert error.message.startswith("internal error in get_timestamp: UnavailableError: ")
    assert served.stats.exceptions == {("internal_error", "get_timestamp"): 1}
    assert served.call("get_id", 14, useragent="allowed")[3].success > 0


# -- WouldBlock: made again elsewhere ---------------------------------------------------


@pytest.mark.usefixtures("no_waiting")
def test_a_call_that_would_wait_raises_would_block_having_issued_and_counted_nothing(
    served: Served,
) -> None:
    served.call("get_id", 1, useragent="first")
    served.clock.now -= 3  # within the 5 ms waited out, but a wait of more than 1 ms
    before = (served.issued(), served.calls(), dict(served.stats.exceptions))
    get_id = request("get_id", 2, useragent="waits")
    attempts: list[Callable[[], bytes]] = [
        lambda: served.processor.process_message(get_id),
        lambda: served.processor.get_id_frame(struct.pack(">i", 2), b"waits"),
    ]
    for attempt in attempts:
        with pytest.raises(WouldBlock):
            attempt()
        assert (served.issued(), served.calls(), dict(served.stats.exceptions)) == before
    forbid_waiting(False)  # a worker thread's turn: it may wait out the 3 ms
    name, mtype, seqid, result = decode(served.processor.process_message(get_id))
    assert (name, mtype, seqid) == ("get_id", REPLY, 2)
    assert decompose(result.success).timestamp_ms == T0


# -- the get_id fast path: the same bytes as the reference path ---------------------------


@pytest.fixture
def audits(tmp_path: Path) -> Iterator[list[AuditLog]]:
    """Two audit trails, their writers not started (close() writes what was queued),
    closed after the test whatever happens."""
    made = [AuditLog(str(tmp_path / name)) for name in ("fast.jsonl", "reference.jsonl")]
    yield made
    for audit in made:
        audit.close()


def test_get_id_frame_writes_what_the_reference_path_writes_framed(
    audits: list[AuditLog],
) -> None:
    """Also for the agents it remembers (their label and agent not checked again) and
    past as many as it remembers: the same ids counted and audited for the same agents."""
    fast, reference = (serve(audit=audit) for audit in audits)
    calls: list[bytes] = [b"alpha", b"alpha", b"beta-2", b"9lives", b"\xff\xfe", b""]
    calls += [f"agent-{i}".encode() for i in range(70)] * 2  # past the agents cached
    for seqid, agent in enumerate(calls, -6):  # the refused ones: negative seqids
        got = fast.processor.get_id_frame(struct.pack(">i", seqid), agent)
        useragent: str | bytes = agent if agent == b"\xff\xfe" else agent.decode()
        assert got == frame(reference.processor.process_message(request(
            "get_id", seqid, useragent=useragent
        ))), agent  # fmt: skip
    for each in (fast, reference):
        each.clock.now -= 1000  # refused: InvalidSystemClock
    got = fast.processor.get_id_frame(struct.pack(">i", -99), b"late")
    want = frame(reference.processor.process_message(request("get_id", -99, useragent="late")))
    assert got == want and decode(got[4:])[3].clock_error is not None
    assert fast.stats.agent_ids == reference.stats.agent_ids
    assert fast.stats.agent_ids["agent-69"] == 2
    assert (
        fast.stats.exceptions
        == reference.stats.exceptions
        == {
            ("invalid_user_agent", "get_id"): 3,
            ("invalid_system_clock", "get_id"): 1,
        }
    )
    assert fast.calls() == reference.calls() == {"get_id": len(calls) + 1}
    assert fast.issued() == reference.issued() == len(calls) - 3
    for audit in audits:
        audit.close()
    trails = [Path(audit.path).read_text(encoding="utf-8").splitlines() for audit in audits]
    assert trails[0] == trails[1]
    assert [json.loads(line)["useragent"] for line in trails[0]] == [
        agent.decode() for agent in calls if agent not in (b"9lives", b"\xff\xfe", b"")
    ]


def test_frame_and_an_error_tied_to_no_call() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"
    name, mtype, seqid, error = decode(
        encode_error(TApplicationException.PROTOCOL_ERROR, "undecodable request")
    )
    assert (name, mtype, seqid) == ("", EXCEPTION, 0)
    assert (error.type, error.message) == (
        TApplicationException.PROTOCOL_ERROR,
        "undecodable request",
    )
