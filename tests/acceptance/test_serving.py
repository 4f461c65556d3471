"""The serving core against real server processes (issue 23): slots per protocol, a
deadline for a whole request, a joining node's peer check on a full node, a Thrift
call past its work bound, HTTP/1.1 as strict as its parser, and readiness that sees
a loop that does not turn.

Each test reproduces a finding of the issue; the numbers it measures are printed
(``pytest -s -k serving``) as ``SERVING <scenario>: ...``.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from snowflake_thrift_client._idl import snowflake_thrift
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.thrift import TApplicationException, TMessageType
from thriftpy2.transport import TMemoryBuffer

from tests.support.endpoints import encode_call, read_to_close
from tests.support.processes import ServerProcess, failures, parse_metrics, start_server
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

thrift = snowflake_thrift()

RESERVE = 8  # Thrift slots kept beyond --max-connections for joining nodes' peer checks


def show(scenario: str, what: str) -> None:
    print(f"SERVING {scenario}: {what}")


def metric(server: ServerProcess, name: str) -> float:
    return parse_metrics(server.metrics()).get(name, 0.0)


def open_connections(server: ServerProcess, protocol: str) -> float:
    return metric(server, f'snowflake_connections_open{{protocol="{protocol}"}}')


def rejected(server: ServerProcess, protocol: str) -> float:
    return metric(server, f'snowflake_connections_rejected_total{{protocol="{protocol}"}}')


def http_address(server: ServerProcess) -> tuple[str, int]:
    assert server.http is not None, "started without --http-port"
    return server.http


def hold(stack: ExitStack, address: tuple[str, int], n: int) -> list[socket.socket]:
    """``n`` idle connections to ``address``, closed when ``stack`` unwinds."""
    return [stack.enter_context(socket.create_connection(address, timeout=5)) for _ in range(n)]


def closed_at_once(address: tuple[str, int]) -> bool:
    """A new connection to ``address`` is closed by the server without a byte."""
    with socket.create_connection(address, timeout=5) as extra:
        return read_to_close(extra) == b""


def exchange(address: tuple[str, int], request: bytes, timeout_s: float = 5.0) -> bytes:
    """Send ``request`` on a new connection; all the server says until it closes."""
    with socket.create_connection(address, timeout=timeout_s) as raw:
        raw.sendall(request)
        return read_to_close(raw)


def http_get(address: tuple[str, int], path: str) -> tuple[int, bytes]:
    """One ``GET`` on a new connection (closed after it): its status and body."""
    request = f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode()
    [(status, _, body)] = responses(exchange(address, request))
    return status, body


def responses(data: bytes, heads: int = 0) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP/1.1 responses in ``data``, in order: (status, headers, body). Every
    response of this server has a Content-Length (none is chunked); the first ``heads``
    answer HEAD requests (no body, whatever their Content-Length says)."""
    out: list[tuple[int, dict[str, str], bytes]] = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"a response cut short: {data[:200]!r}"
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = 0 if len(out) < heads else int(headers["content-length"])
        out.append((int(status_line.split()[1]), headers, rest[:length]))
        data = rest[length:]
    return out


def application_error(reply: bytes) -> TApplicationException:
    """The Thrift application error in a framed ``reply``."""
    protocol: Any = TBinaryProtocol(TMemoryBuffer(reply[4:]))  # type: ignore[no-untyped-call]
    _, mtype, _ = protocol.read_message_begin()
    assert mtype == TMessageType.EXCEPTION, f"not refused: {reply[:120]!r}"
    error = TApplicationException()
    error.read(protocol)
    return error


def get_id_answer(reply: bytes) -> int:
    """The id in a framed ``get_id`` reply."""
    protocol: Any = TBinaryProtocol(TMemoryBuffer(reply[4:]))  # type: ignore[no-untyped-call]
    name, mtype, _ = protocol.read_message_begin()
    assert (name, mtype) == ("get_id", TMessageType.REPLY), f"not an answer: {reply[:120]!r}"
    result = thrift.Snowflake.get_id_result()
    result.read(protocol)
    assert isinstance(result.success, int)
    return result.success


_think = threading.Event()  # never set: a client's pause between its bytes or calls


def pause(seconds: float) -> None:
    """A client's own pause (the scenario's input: a trickle, think time), not a wait
    for the server."""
    _think.wait(seconds)


@pytest.fixture
def servers() -> Iterator[Callable[..., ServerProcess]]:
    """``servers(*flags)`` starts a server; each is stopped (cleanly) after the test."""
    started: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        started.append(start_server(*flags))
        return started[-1]

    yield start
    for server in started:
        assert server.stop() == 0, server.log()


# -- 1. slots per protocol --------------------------------------------------------------


def test_idle_http_connections_do_not_lock_thrift_clients_out(
    servers: Callable[..., ServerProcess],
) -> None:
    server = servers("--max-connections", "20", "--http-max-connections", "20", "--http-port", "0")
    http = http_address(server)
    with ExitStack() as stack:
        hold(stack, http, 20)
        wait_until(lambda: open_connections(server, "http") == 20, "20 HTTP connections open")
        ids = [server.raw_client().get_id(f"thrift-{i}") for i in range(10)]
        assert all(i > 0 for i in ids) and len(set(ids)) == 10, "10 of 10 Thrift clients served"
        status, body = server.http_get("/readyz")
        assert status == 200, body
        assert closed_at_once(http), "the 21st HTTP connection is closed at once"
        counts = parse_metrics(server.metrics())
        show("idle http", f"20 HTTP held; 10/10 Thrift get_id; /readyz {status}")
        assert counts['snowflake_connections_rejected_total{protocol="http"}'] == 1
        assert counts['snowflake_connections_rejected_total{protocol="thrift"}'] == 0
        assert counts['snowflake_connections_open{protocol="http"}'] == 20
        assert counts['snowflake_connections_limit{protocol="http"}'] == 20


def test_idle_thrift_connections_do_not_lock_http_clients_out(
    servers: Callable[..., ServerProcess],
) -> None:
    server = servers("--max-connections", "20", "--http-max-connections", "20", "--http-port", "0")
    thrift_port = (server.host, server.port)
    with ExitStack() as stack:
        # Every slot, the peer checks' reserve too (those live 5 s: the test is quicker).
        hold(stack, thrift_port, 20 + RESERVE)
        wait_until(
            lambda: open_connections(server, "thrift") == 20 + RESERVE,
            f"{20 + RESERVE} Thrift connections open",
        )
        answers = [http_get(http_address(server), f"/v1/id?agent=http-{i}") for i in range(10)]
        assert [status for status, _ in answers] == [200] * 10, answers
        assert closed_at_once(thrift_port), "the next Thrift connection is closed at once"
        status, body = server.http_get("/readyz")
        assert status == 200, body
        show("idle thrift", f"{20 + RESERVE} Thrift held; 10/10 HTTP GET /v1/id; /readyz {status}")
        assert rejected(server, "thrift") == 1
        assert rejected(server, "http") == 0


# -- 2. a deadline for a whole request ----------------------------------------------------

_IDLE_S, _REQUEST_S, _TRICKLE_S = 2.0, 3.0, 1.5
_CLOSED_BY_S = _REQUEST_S * 1.25 + 0.5  # checked every quarter of the shorter deadline
_NOT_BEFORE_S = _REQUEST_S - _IDLE_S / 4  # its first byte may come just before a check


def trickle(address: tuple[str, int], request: bytes) -> tuple[float, bytes]:
    """Send ``request`` a byte every 1.5 s until the server closes (at most 2.5 times the
    request deadline): the seconds from the first byte to the close, and the answer."""
    with socket.create_connection(address, timeout=5) as raw:
        first = time.monotonic()
        answer = b""
        for byte in request:
            if time.monotonic() - first > _REQUEST_S * 2.5:
                break
            try:
                raw.sendall(bytes([byte]))
            except OSError:
                break  # closed (reset) while our byte was on its way
            raw.settimeout(_TRICKLE_S)  # the pause between bytes, cut short by a close
            try:
                answer = read_to_close(raw)
            except TimeoutError:
                continue  # still open: the next byte
            return time.monotonic() - first, answer
    raise AssertionError(f"still open {time.monotonic() - first:.1f} s after its first byte")


def test_a_thrift_frame_trickled_a_byte_at_a_time_is_closed_at_its_deadline(
    servers: Callable[..., ServerProcess],
) -> None:
    server = servers("--idle-timeout", f"{_IDLE_S:g}", "--request-timeout", f"{_REQUEST_S:g}")
    polite = PoliteClient(server)
    took, answer = trickle((server.host, server.port), encode_call("get_id", useragent="slow"))
    show("slowloris thrift", f"closed {took:.2f} s after its first byte")
    assert _NOT_BEFORE_S <= took <= _CLOSED_BY_S
    error = application_error(answer)
    assert error.type == TApplicationException.PROTOCOL_ERROR
    assert "--request-timeout 3 s" in str(error)
    assert failures(parse_metrics(server.metrics()), "request_timeout") == 1
    calls = polite.stop()
    show("polite thrift", f"{calls} get_id 1.5 s apart on one connection, all answered")


class PoliteClient:
    """A well-behaved client beside the slowloris: one connection, a get_id every 1.5 s
    (idle less than --idle-timeout, each request whole at once), from its start until
    :meth:`stop`; it must never be closed."""

    def __init__(self, server: ServerProcess) -> None:
        self._client = server.raw_client()
        self._stop = threading.Event()
        self.calls = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 30  # stops by itself whatever the test does
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                assert self._client.get_id("polite") > 0
            except Exception as e:  # noqa: BLE001 - handed to the test
                self.error = e
                return
            self.calls += 1
            self._stop.wait(_TRICKLE_S)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        assert self.error is None, f"the well-behaved client failed: {self.error!r}"
        assert self.calls >= 3, "it called across the request and idle deadlines"
        return self.calls


def test_an_http_head_trickled_a_byte_at_a_time_gets_408_at_its_deadline(
    servers: Callable[..., ServerProcess],
) -> None:
    server = servers(
        "--idle-timeout", f"{_IDLE_S:g}", "--request-timeout", f"{_REQUEST_S:g}",
        "--http-port", "0",
    )  # fmt: skip
    request = b"GET /v1/id?agent=slow HTTP/1.1\r\nHost: t\r\n\r\n"
    took, answer = trickle(http_address(server), request)
    show("slowloris http", f"closed {took:.2f} s after its first byte, answer {answer[:12]!r}")
    assert _NOT_BEFORE_S <= took <= _CLOSED_BY_S
    [(status, headers, body)] = responses(answer)
    assert status == 408 and headers.get("connection") == "close"
    assert json.loads(body)["error"] == "request_timeout"
    assert failures(parse_metrics(server.metrics()), "request_timeout") == 1


# -- 3. a joining node's peer check on a full node ----------------------------------------


@pytest.mark.zookeeper
@pytest.mark.slow
def test_a_node_joins_beside_a_node_whose_slots_are_full(
    zookeeper: ZooKeeper, zk_path: str, servers: Callable[..., ServerProcess]
) -> None:
    cluster = zookeeper.node_flags(zk_path)
    full = servers(*cluster, "--worker-id", "1", "--max-connections", "4")
    with ExitStack() as stack:
        hold(stack, (full.host, full.port), 4)
        wait_until(lambda: open_connections(full, "thrift") == 4, "the full node's 4 slots held")
        started = time.monotonic()
        joined = servers(*cluster, "--worker-id", "2")
        took = time.monotonic() - started
        show("peer check on a full node", f"node B ready {took:.2f} s after its start")
        assert joined.raw_client().get_worker_id() == 2
        assert "1 peer(s) sane" in joined.log()
        assert rejected(full, "thrift") == 0


@pytest.mark.zookeeper
@pytest.mark.slow
def test_a_node_joins_once_a_held_reserve_slot_expires(
    zookeeper: ZooKeeper, zk_path: str, servers: Callable[..., ServerProcess]
) -> None:
    cluster = zookeeper.node_flags(zk_path)
    full = servers(*cluster, "--worker-id", "1", "--max-connections", "4")
    with ExitStack() as stack:
        # The reserve held too: the check is refused until a reserved slot's 5 s run out,
        # and passes on a retry.
        hold(stack, (full.host, full.port), 4 + RESERVE)
        wait_until(lambda: open_connections(full, "thrift") == 4 + RESERVE, "every slot of A held")
        held = time.monotonic()
        joined = servers(*cluster, "--worker-id", "2")
        took = time.monotonic() - held
        refused = rejected(full, "thrift")
        show("peer check, reserve held", f"node B ready {took:.2f} s after the reserve was "
             f"held; {refused:g} of its tries refused")  # fmt: skip
        assert refused > 0, "B's first tries met a full node"
        assert joined.raw_client().get_worker_id() == 2
        assert "1 peer(s) sane" in joined.log()


# -- 4. a Thrift call past its work bound -------------------------------------------------

_GET_ID_HEAD = struct.pack(">iI", -2147418111, 6) + b"get_id" + struct.pack(">i", 1)


def get_id_with_structs(n: int, agent: bytes = b"attacker") -> bytes:
    """A framed get_id whose unknown field 2 is a list of ``n`` empty structs: 2 + ``n``
    values walked."""
    message = (
        _GET_ID_HEAD
        + b"\x0b\x00\x01" + struct.pack(">i", len(agent)) + agent
        + b"\x0f\x00\x02\x0c" + struct.pack(">i", n) + b"\x00" * n
        + b"\x00"
    )  # fmt: skip
    return struct.pack(">i", len(message)) + message


def test_a_call_of_a_thousand_empty_structs_is_refused_and_others_are_served(
    servers: Callable[..., ServerProcess],
) -> None:
    server = servers()
    other = server.raw_client()
    assert other.get_id("other") > 0
    hostile = get_id_with_structs(1022)
    assert len(hostile) == 1068  # the issue's frame
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        raw.sendall(hostile)
        assert other.get_id("other") > 0, "served while the hostile connection is open"
        answer = read_to_close(raw)  # returns: the server closed it
    error = application_error(answer)
    show("1,022 empty structs", f"refused: {error}")
    assert error.type == TApplicationException.PROTOCOL_ERROR
    assert "more than 64 values" in str(error)
    assert failures(parse_metrics(server.metrics()), "protocol_error") == 1
    # Under the bound, the unknown field is skipped and the call answered.
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        raw.sendall(get_id_with_structs(58))  # 60 values
        assert get_id_answer(raw.recv(65536)) > 0
    assert other.get_id("other") > 0


# -- 5. HTTP/1.1 on the live server --------------------------------------------------------

_CLOSE = b"GET /v1/layout HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"


def ids_generated(server: ServerProcess) -> float:
    return metric(server, "snowflake_ids_generated_total")


@pytest.fixture(scope="module")
def http_server() -> Iterator[ServerProcess]:
    server = start_server("--http-port", "0")
    yield server
    assert server.stop() == 0


def test_a_request_hidden_in_a_get_body_is_not_served(http_server: ServerProcess) -> None:
    hidden = b"GET /v1/id?agent=smuggled HTTP/1.1\r\nHost: t\r\n\r\n"
    smuggler = (
        b"GET /v1/id?agent=front HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(hidden)
        + hidden
    )
    before = ids_generated(http_server)
    # A last request that closes: whatever the server answers comes before its close.
    answers = responses(exchange(http_address(http_server), smuggler + _CLOSE))
    show("smuggling", f"{len(answers) - 1} response(s) to it, then the closing request's")
    assert [status for status, _, _ in answers] == [200, 200]
    assert "id" in json.loads(answers[0][2]) and "timestamp_bits" in str(answers[1][2])
    assert ids_generated(http_server) - before == 1, "one id: the hidden request never ran"


def test_a_request_smuggled_behind_two_lengths_is_refused(http_server: ServerProcess) -> None:
    # A proxy taking the last Content-Length forwards the hidden request as this one's
    # body; a server taking the first (0) would run it: two responses to one request.
    hidden = b"GET /v1/id?agent=smuggled HTTP/1.1\r\nHost: t\r\n\r\n"
    smuggler = (
        b"GET /v1/id?agent=front HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n"
        b"Content-Length: %d\r\n\r\n" % len(hidden) + hidden
    )
    before = ids_generated(http_server)
    answers = responses(exchange(http_address(http_server), smuggler + _CLOSE))
    show("smuggling, CL.CL", f"{[status for status, _, _ in answers]}")
    assert [status for status, _, _ in answers] == [400], "one answer, then the close"
    assert ids_generated(http_server) == before


@pytest.mark.parametrize(
    ("name", "request_"),
    [
        ("two different Content-Length",
         b"GET /v1/id HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"),
        ("HTTP/1.1 without Host", b"GET /v1/id HTTP/1.1\r\n\r\n"),
        ("Content-Length 1_0", b"GET /v1/id HTTP/1.1\r\nHost: t\r\nContent-Length: 1_0\r\n\r\n"),
        ("Content-Length +1", b"GET /v1/id HTTP/1.1\r\nHost: t\r\nContent-Length: +1\r\n\r\na"),
        ("bare LF", b"GET /v1/id HTTP/1.1\nHost: t\n\n"),
    ],
)  # fmt: skip
def test_malformed_requests_get_400_at_once(
    http_server: ServerProcess, name: str, request_: bytes
) -> None:
    before = ids_generated(http_server)
    started = time.monotonic()
    answer = exchange(http_address(http_server), request_, timeout_s=1.0)
    took = time.monotonic() - started
    status_line = answer.partition(b"\r\n")[0].decode()
    show(f"http {name}", f"{status_line} in {took * 1000:.0f} ms")
    [(status, headers, _)] = responses(answer)
    assert status == 400 and headers.get("connection") == "close"
    assert ids_generated(http_server) == before


def test_head_of_an_id_is_refused_and_issues_none(http_server: ServerProcess) -> None:
    before = ids_generated(http_server)
    answer = exchange(
        http_address(http_server), b"HEAD /v1/id HTTP/1.1\r\nHost: t\r\n\r\n" + _CLOSE
    )
    # No body after the HEAD's 405: the layout's response follows its blank line.
    [(status, headers, _), (after_status, _, _)] = responses(answer, heads=1)
    show("HEAD /v1/id", f"{status}, Allow: {headers.get('allow')}")
    assert status == 405 and headers.get("allow") == "GET"
    assert after_status == 200
    assert ids_generated(http_server) == before


def test_pipelined_requests_are_answered_in_order(http_server: ServerProcess) -> None:
    pipelined = (
        b"GET /v1/ids?count=3&agent=pipe HTTP/1.1\r\nHost: t\r\n\r\n"
        b"GET /v1/id?agent=pipe HTTP/1.1\r\nHost: t\r\n\r\n" + _CLOSE
    )
    answers = responses(exchange(http_address(http_server), pipelined))
    assert [status for status, _, _ in answers] == [200, 200, 200]
    batch, single, layout = (json.loads(body) for _, _, body in answers)
    assert len(batch["ids"]) == 3 and int(single["id"]) > max(map(int, batch["ids"]))
    assert "timestamp_bits" in layout


# -- 6. readiness sees a loop that does not turn ------------------------------------------


def test_a_stalled_loop_makes_the_node_unready_not_dead(
    servers: Callable[..., ServerProcess],
) -> None:
    server = servers("--ready-max-lag", "0.05")
    assert server.http_get("/readyz")[0] == 200
    # The ready line comes before the loop runs; a stall before its first tick would be
    # start-up, not lag. A call answered: the loop runs (its first tick comes before it
    # accepts a connection).
    assert server.raw_client().get_id("before-the-stall") > 0
    # A real stall: the whole process stopped, then let go. The loop's lag is the median
    # over 5 s: a stall covering more than half of that reads as lag at once.
    server.process.send_signal(signal.SIGSTOP)
    try:
        pause(3.5)
    finally:
        server.process.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    assert server.http_get("/readyz")[0] == 503
    counts = parse_metrics(server.metrics())
    show("stalled 3.5 s", f"lag {counts['snowflake_loop_lag_seconds']:.2f} s, "
         f"overloaded {counts['snowflake_loop_overloaded']:g}")  # fmt: skip
    assert counts["snowflake_loop_overloaded"] == 1
    assert counts["snowflake_loop_lag_seconds"] >= 3.0
    # The stall also held the high-water mark's renewal, and /readyz names the first
    # reason it finds: that one clears in milliseconds, the lag's after 2.5 s of turns.
    reasons: list[str] = []

    def says_overloaded() -> bool:
        status, body = server.http_get("/readyz")
        reasons.append(f"{status} {json.loads(body).get('reason')}")
        return reasons[-1].startswith("503 overloaded: the serving loop has lagged")

    wait_until(says_overloaded, "/readyz 503 for the loop's lag", 2.0)
    show("stalled 3.5 s", f"/readyz answers {reasons}")
    assert server.http_get("/livez")[0] == 200, "a stall shorter than --live-max-stall"
    assert server.raw_client().get_id("after-the-stall") > 0
    wait_until(lambda: server.http_get("/readyz")[0] == 200, "ready again once the loop turns")
    show("stalled 3.5 s", f"ready again {time.monotonic() - resumed:.2f} s after SIGCONT")
