"""The floor (bench/native/floor.c): it answers the fast path's get_id byte for byte as
snowflake_server/_thrift/fastpath.py does, with ids of the default layout, and closes the
connection on anything else (never its speed)."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from snowflake_thrift_client import decompose
from snowflake_thrift_client._idl import snowflake_thrift
from thriftpy2.protocol import TCyBinaryProtocol
from thriftpy2.transport import TCyMemoryBuffer

from bench.servers import Server, start_native_floor
from snowflake_server._thrift.fastpath import get_id_reply, match_get_id
from snowflake_server._thrift.processor import frame

WORKER, DATACENTER = 7, 3
LIMIT = 64 * 1024  # the floor's --max-frame-size default, the server's
REPLY_SIZE = 34
TIMEOUT_S = 10.0
_HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def floor(floor_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One floor with two threads, so that connections land on both."""
    logs = tmp_path_factory.mktemp("floor-logs")
    server = start_native_floor(
        "floor", logs, floor_binary.parent, WORKER, "--datacenter-id", str(DATACENTER),
        "--threads", "2",
    )  # fmt: skip
    yield server
    server.stop()


def get_id_frame(agent: str | bytes, seqid: int) -> bytes:
    """A get_id call as thriftpy2 (and Twitter's clients) frame it."""
    out: Any = TCyMemoryBuffer()
    protocol: Any = TCyBinaryProtocol(out)  # type: ignore[no-untyped-call]
    protocol.write_message_begin("get_id", 1, seqid)
    snowflake_thrift().Snowflake.get_id_args(useragent=agent).write(protocol)
    protocol.write_message_end()
    protocol.trans.flush()
    return frame(out.getvalue())


def get_ids_frame(count: int) -> bytes:
    out: Any = TCyMemoryBuffer()
    protocol: Any = TCyBinaryProtocol(out)  # type: ignore[no-untyped-call]
    protocol.write_message_begin("get_ids", 1, 1)
    snowflake_thrift().Snowflake.get_ids_args(useragent="a", count=count).write(protocol)
    protocol.trans.flush()
    return frame(out.getvalue())


def connect(server: Server) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def receive(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes (fewer only if the floor closed the connection)."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def closed(sock: socket.socket) -> bool:
    """The floor closed the connection, sending nothing more; a timeout fails the test."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def check_reply(reply: bytes, request: bytes, before_ms: int, after_ms: int) -> int:
    """``reply`` is the fast path's reply to ``request`` for the id it carries, an id of
    the floor's node issued between the two wall-clock readings; the id."""
    call = match_get_id(request, LIMIT)
    assert call is not None
    seqid, _agent = call
    assert len(reply) == REPLY_SIZE
    [id_] = struct.unpack(">q", reply[25:33])
    assert reply == get_id_reply(seqid, id_)
    parts = decompose(id_)
    assert (parts.datacenter_id, parts.worker_id) == (DATACENTER, WORKER)
    assert before_ms <= parts.timestamp_ms <= after_ms
    return int(id_)


agents = st.one_of(
    st.from_regex(r"[a-zA-Z][a-zA-Z\-0-9]{0,140}", fullmatch=True),
    st.text(max_size=40),
    st.binary(max_size=300),  # not UTF-8 too: the match never looks at the agent's bytes
)
seqids = st.integers(-(2**31), 2**31 - 1)
_issued: list[int] = []  # every id the module's floor returned to the property below


@given(agent=agents, seqid=seqids)
@_HYPOTHESIS
@example(agent="", seqid=0)
@example(agent=b"\xff\xfe", seqid=-1)
@example(agent="x" * 4000, seqid=2**31 - 1)  # a frame longer than one read of the floor's
def test_get_id_is_answered_byte_for_byte_as_the_fast_path_does(
    floor: Server, agent: str | bytes, seqid: int
) -> None:
    request = get_id_frame(agent, seqid)
    with connect(floor) as sock:
        before = time.time_ns() // 1_000_000
        sock.sendall(request)
        reply = receive(sock, REPLY_SIZE)
        after = time.time_ns() // 1_000_000
    id_ = check_reply(reply, request, before, after)
    assert not _issued or id_ > _issued[-1]  # one generator for all connections and threads
    _issued.append(id_)


def test_pipelined_calls_are_answered_in_order_with_increasing_ids(floor: Server) -> None:
    """20,000 calls sent in one stream, faster than one millisecond's 4,096 ids: every
    reply in order, ids increasing within their millisecond's sequence. The replies pile
    up faster than they are read, so the floor also waits for room to write."""
    calls = 20_000
    requests = [get_id_frame("pipelined", seqid) for seqid in range(calls)]
    with connect(floor) as sock:
        before = time.time_ns() // 1_000_000
        sender = threading.Thread(target=sock.sendall, args=(b"".join(requests),))
        sender.start()
        replies = receive(sock, calls * REPLY_SIZE)
        after = time.time_ns() // 1_000_000
        sender.join(TIMEOUT_S)
    assert len(replies) == calls * REPLY_SIZE
    ids = [
        check_reply(replies[i * REPLY_SIZE : (i + 1) * REPLY_SIZE], request, before, after)
        for i, request in enumerate(requests)
    ]
    assert all(a < b for a, b in itertools.pairwise(ids))


@st.composite
def unserved_requests(draw: st.DrawFn) -> bytes:
    """A get_id frame with one change that the fast path does not match: a byte replaced,
    bytes inserted, cut or appended; its length always that of the frame, so that the
    floor has all of it to judge."""
    request = bytearray(get_id_frame(draw(agents), draw(seqids)))
    at = draw(st.integers(4, len(request) - 1))
    how = draw(st.sampled_from(["replace", "insert", "delete", "append"]))
    if how == "replace":
        request[at] = draw(st.integers(0, 255).filter(lambda b: b != request[at]))
    elif how == "insert":
        request[at:at] = draw(st.binary(min_size=1, max_size=8))
    elif how == "delete":
        del request[at : at + draw(st.integers(1, 4))]
    else:
        request += draw(st.binary(min_size=1, max_size=8))
    request[:4] = struct.pack(">I", len(request) - 4)
    result = bytes(request)
    assume(match_get_id(result, LIMIT) is None)
    return result


@given(request=unserved_requests())
@_HYPOTHESIS
@example(request=get_ids_frame(4))  # another method
@example(request=get_id_frame("agent", 1)[4:])  # the buffered transport: a length of 2 GiB
@example(request=struct.pack(">I", LIMIT + 1))  # over the limit: closed before its bytes come
@example(request=struct.pack(">I", 0))  # an empty frame
def test_a_request_it_does_not_serve_closes_the_connection(floor: Server, request: bytes) -> None:
    assert match_get_id(request, LIMIT) is None
    with connect(floor) as sock:
        sock.sendall(request)
        assert closed(sock)


def test_what_came_before_an_unserved_request_is_answered_first(floor: Server) -> None:
    served = get_id_frame("agent", 5)
    with connect(floor) as sock:
        before = time.time_ns() // 1_000_000
        sock.sendall(served + get_ids_frame(2))
        reply = receive(sock, REPLY_SIZE)
        after = time.time_ns() // 1_000_000
        check_reply(reply, served, before, after)
        assert closed(sock)


def test_threads_and_pinning(floor_binary: Path, tmp_path: Path) -> None:
    """--threads N runs N threads; started on one CPU, one thread by default."""
    three = start_native_floor("three", tmp_path, floor_binary.parent, 1, "--threads", "3")
    try:
        assert len(os.listdir(f"/proc/{three.process.pid}/task")) == 3
    finally:
        three.stop()
    assert "threads=3" in (tmp_path / "three.out").read_text()
    cpu = min(os.sched_getaffinity(0))
    one = start_native_floor("one", tmp_path, floor_binary.parent, 1, cpu=cpu)
    try:
        # taskset exec'd the floor: the same process, on that CPU alone
        assert os.sched_getaffinity(one.process.pid) == {cpu}
    finally:
        one.stop()
    assert "threads=1" in (tmp_path / "one.out").read_text()


@pytest.mark.parametrize(
    "flags",
    [
        ["--threads", "0"],
        ["--worker-id", "32"],
        ["--datacenter-id", "-1"],
        ["--port", "x"],
        ["--host", "localhost"],
        ["--no-such-flag"],
        ["extra"],
    ],
)
def test_bad_flags_exit_with_2(floor_binary: Path, flags: list[str]) -> None:
    done = subprocess.run(
        [str(floor_binary), *flags], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 2, done
    assert done.stdout == "" and done.stderr
