"""The get_id fast path against the generic processor: the same request, the same
reply bytes and the same counts, for generated requests valid and invalid."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from snowflake_thrift_client._idl import snowflake_thrift
from thriftpy2.protocol import TCyBinaryProtocol
from thriftpy2.transport import TCyMemoryBuffer

from snowflake_server import GeneratorSettings, IdGenerator
from snowflake_server._observability.metrics import ConnectionStats, ServiceMetrics
from snowflake_server._service import SnowflakeHandler
from snowflake_server._thrift.fastpath import match_get_id
from snowflake_server._thrift.processor import Processor, frame, service_methods
from tests.support.fakes import FakeClock

T0 = 1_700_000_000_000
LIMIT = 64 * 1024


class _Broken:
    """An id source with a bug in it: every call must become INTERNAL_ERROR."""

    settings = GeneratorSettings()

    def next_id(self) -> int:
        raise RuntimeError("a bug")

    def next_ids(self, count: int) -> list[int]:
        raise RuntimeError("a bug")


def _processor(source_kind: str) -> tuple[Processor, ConnectionStats]:
    clock = FakeClock(T0)
    source: Any
    if source_kind == "broken":
        source = _Broken()
    else:
        source = IdGenerator(GeneratorSettings(worker_id=5), clock=clock, sleep=clock.sleep)
        if source_kind == "clock_behind":
            source.next_id()
            clock.now -= 10_000  # refused: InvalidSystemClock
    metrics = ServiceMetrics(source, service_methods(), max_agents=8)
    stats = metrics.open_connection()
    return Processor(SnowflakeHandler(source, metrics, stats, clock), stats), stats


def _snapshot(stats: ConnectionStats) -> tuple[object, ...]:
    calls = {method: sum(h.counts) for method, h in stats.latency.items()}
    return dict(stats.agent_ids), dict(stats.exceptions), calls


def get_id_frame(agent: str | bytes, seqid: int) -> bytes:
    """A get_id call as thriftpy2 (and Twitter's clients) frame it."""
    out: Any = TCyMemoryBuffer()
    protocol: Any = TCyBinaryProtocol(out)  # type: ignore[no-untyped-call]
    protocol.write_message_begin("get_id", 1, seqid)
    snowflake_thrift().Snowflake.get_id_args(useragent=agent).write(protocol)
    protocol.write_message_end()
    protocol.trans.flush()
    return frame(out.getvalue())


def _both_paths(request: bytes, source_kind: str) -> None:
    call = match_get_id(request, LIMIT)
    if call is None:
        return
    fast, fast_stats = _processor(source_kind)
    generic, generic_stats = _processor(source_kind)
    for _ in range(2):  # the second call finds the agent in the fast path's cache
        assert fast.get_id_frame(*call) == frame(generic.process_message(request[4:]))
        assert _snapshot(fast_stats) == _snapshot(generic_stats)


agents = st.one_of(
    st.from_regex(r"[a-zA-Z][a-zA-Z\-0-9]{0,140}", fullmatch=True),
    st.text(max_size=40),
    st.binary(max_size=40),  # mostly not UTF-8: refused as the generic path refuses it
)
seqids = st.integers(-(2**31), 2**31 - 1)


@pytest.mark.parametrize("source_kind", ["ok", "clock_behind", "broken"])
@given(agent=agents, seqid=seqids)
@settings(max_examples=150, deadline=None)
@example(agent="", seqid=0)
@example(agent=b"\xff\xfe", seqid=-1)
@example(agent="x" * 129, seqid=7)
def test_every_common_request_takes_the_fast_path_with_the_generic_reply(
    source_kind: str, agent: str | bytes, seqid: int
) -> None:
    request = get_id_frame(agent, seqid)
    assert match_get_id(request, LIMIT) is not None
    _both_paths(request, source_kind)


@st.composite
def mutated_requests(draw: st.DrawFn) -> bytes:
    """A get_id frame with one change: a byte replaced, bytes inserted or cut, or
    the field's type, id or length altered."""
    request = bytearray(get_id_frame(draw(agents), draw(seqids)))
    at = draw(st.integers(0, len(request) - 1))
    how = draw(st.sampled_from(["replace", "insert", "delete", "append", "truncate"]))
    if how == "replace":
        request[at] = draw(st.integers(0, 255).filter(lambda b: b != request[at]))
    elif how == "insert":
        request[at:at] = draw(st.binary(min_size=1, max_size=8))
    elif how == "delete":
        del request[at : at + draw(st.integers(1, 4))]
    elif how == "append":
        request += draw(st.binary(min_size=1, max_size=8))
    else:
        del request[at:]
    if draw(st.booleans()):  # keep the frame length consistent, or not
        request[:4] = struct.pack(">i", len(request) - 4)
    return bytes(request)


@given(request=mutated_requests())
@settings(max_examples=400, deadline=None)
def test_whatever_the_fast_path_claims_it_answers_as_the_generic_path(request: bytes) -> None:
    _both_paths(request, "ok")


def test_other_requests_are_left_to_the_generic_path() -> None:
    out: Any = TCyMemoryBuffer()
    protocol: Any = TCyBinaryProtocol(out)  # type: ignore[no-untyped-call]
    protocol.write_message_begin("get_ids", 1, 1)
    snowflake_thrift().Snowflake.get_ids_args(useragent="a", count=2).write(protocol)
    protocol.trans.flush()
    assert match_get_id(frame(out.getvalue()), LIMIT) is None
    request = get_id_frame("agent", 1)
    assert match_get_id(request, len(request) - 5) is None  # over the frame limit
    assert match_get_id(request + b"\x00", LIMIT) is None  # two requests' worth of bytes
