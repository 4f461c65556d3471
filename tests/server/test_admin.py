"""The admin endpoint: the probes' answers, and prometheus_client's own exposition."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
from collections.abc import Iterator

import pytest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from snowflake_server._config.settings import AdminSettings
from snowflake_server._errors import ConfigurationError
from snowflake_server._http.admin import AdminConnection, AdminServer
from tests.support.endpoints import read_to_close
from tests.support.processes import parse_metrics
from tests.support.waiting import wait_until


class _Calls(Collector):
    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("snowflake_calls", "Calls.", value=3)


class _State:
    def __init__(self) -> None:
        self.ready: str | None = None
        self.live: str | None = None
        self.broken: Exception | None = None  # raised by the readiness check: a bug

    def readiness(self) -> tuple[str | None, dict[str, object]]:
        if self.broken is not None:
            raise self.broken
        return self.ready, {"worker_id": 4}


@pytest.fixture
def admin() -> Iterator[tuple[AdminServer, _State]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Calls())
    state = _State()
    server = AdminServer(
        registry,
        AdminSettings("127.0.0.1", 0, 10),
        ready=state.readiness,
        live=lambda: state.live,
    )
    server.start()
    yield server, state
    server.stop()


def request(
    server: AdminServer, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(*server.address, timeout=5)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_readyz_and_health_say_why_ids_cannot_be_had(admin: tuple[AdminServer, _State]) -> None:
    server, state = admin
    for path in ("/readyz", "/health"):
        status, headers, body = request(server, path)
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert json.loads(body) == {"status": "ok", "worker_id": 4}
    state.ready = "draining: the node is stopping; clients should move to other nodes"
    for path in ("/readyz", "/health"):
        status, _, body = request(server, path)
        assert status == 503
        assert json.loads(body) == {"status": "unavailable", "reason": state.ready, "worker_id": 4}


def test_livez_ignores_readiness(admin: tuple[AdminServer, _State]) -> None:
    server, state = admin
    state.ready = "the ZooKeeper session is lost"
    assert request(server, "/livez")[0] == 200
    state.live = "the serving loop has not turned for 31.0 s"
    status, _, body = request(server, "/livez")
    assert status == 503 and json.loads(body)["reason"] == state.live


def test_probes_answer_head_and_refuse_other_methods(admin: tuple[AdminServer, _State]) -> None:
    server, _ = admin
    status, headers, body = request(server, "/readyz", "HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
    assert request(server, "/readyz", "POST")[0] == 405


def test_unknown_paths_name_the_routes(admin: tuple[AdminServer, _State]) -> None:
    status, _, body = request(admin[0], "/nope")
    assert status == 404 and b"/metrics, /livez, /readyz, /health" in body


def test_metrics_negotiate_openmetrics_and_gzip(admin: tuple[AdminServer, _State]) -> None:
    server, _ = admin
    status, headers, body = request(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b"snowflake_calls_total 3.0" in body
    status, headers, body = request(
        server, "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    status, headers, body = request(server, "/metrics", headers={"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip"
    assert b"snowflake_calls_total 3.0" in gzip.decompress(body)
    status, _, body = request(server, "/metrics?name[]=nothing_here")
    assert status == 200 and b"snowflake_calls" not in body


def test_a_port_in_use_is_a_configuration_error(admin: tuple[AdminServer, _State]) -> None:
    host, port = admin[0].address
    with pytest.raises(ConfigurationError, match=f"cannot listen on {host}:{port}"):
        AdminServer(
            CollectorRegistry(), AdminSettings(host, port, 10), ready=lambda: (None, {}),
            live=lambda: None,
        )  # fmt: skip


def _server(**kwargs: float) -> AdminServer:
    registry = CollectorRegistry(auto_describe=False)
    server = AdminServer(
        registry, AdminSettings("127.0.0.1", 0, 10), ready=lambda: (None, {}),
        live=lambda: None, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip
    registry.register(server)
    return server


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def _exchange(server: AdminServer, data: bytes) -> bytes:
    """Send ``data``; all the server answers before it closes (or resets) the connection."""
    with socket.create_connection(server.address, timeout=5) as conn:
        conn.sendall(data)
        return read_to_close(conn)


def test_a_slow_loris_neither_starves_the_probes_nor_starts_threads() -> None:
    server = _server(max_connections=8)
    server.start()
    threads = set(threading.enumerate())
    loris: list[socket.socket] = []
    try:
        for _ in range(50):
            conn = socket.create_connection(server.address, timeout=5)
            conn.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never ends its head
            loris.append(conn)
        assert request(server, "/livez")[0] == 200
        # No thread per connection: a host out of threads could not refuse one.
        assert set(threading.enumerate()) <= threads
        # Each newcomer past 8 made room by closing the oldest one still sending.
        assert server.closed_full == 50 + 1 - 8
        assert _closed(loris[0])
        counts = parse_metrics(request(server, "/metrics")[2].decode())
        assert counts['snowflake_admin_connections_rejected_total{reason="full"}'] == 43
    finally:
        for conn in loris:
            conn.close()
        server.stop()


def test_a_request_not_sent_in_time_is_closed_and_counted() -> None:
    server = _server(request_timeout=0.2)
    server.start()
    try:
        assert _exchange(server, b"GET /livez HTTP/1.1\r\n") == b""  # closed unanswered
        wait_until(lambda: server.closed_slow == 1, "the slow connection counted", 5)
        counts = parse_metrics(request(server, "/metrics")[2].decode())
        assert counts['snowflake_admin_connections_rejected_total{reason="slow"}'] == 1
    finally:
        server.stop()


def test_requests_that_cannot_be_answered_are_told_why(admin: tuple[AdminServer, _State]) -> None:
    server, state = admin
    assert _exchange(server, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    trickled = b"GET /livez HTTP/1.1\r\nHost: x\r\nX: " + b"x" * 9000
    huge = b"GET /livez HTTP/1.1\r\nX: " + b"x" * 9000
    assert _exchange(server, huge).startswith(b"HTTP/1.1 431 ")
    with socket.create_connection(server.address, timeout=5) as conn:
        for at in range(0, len(trickled), 1000):  # a head over the limit, in pieces
            conn.sendall(trickled[at : at + 1000])
        assert read_to_close(conn).startswith(b"HTTP/1.1 431 ")

    state.broken = RuntimeError("a bug")
    assert request(server, "/readyz")[0] == 500
    assert request(server, "/livez")[0] == 200  # the next request is served as ever


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /livez HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /livez HTTP/1.1\nHost: x\n\n", 400),  # bare LF
        (
            b"GET /livez HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            400,
        ),
        (b"GET /livez HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501),
        (b"GET /livez HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    ],
)
def test_a_malformed_request_gets_its_status_and_a_close(
    admin: tuple[AdminServer, _State], raw: bytes, status: int
) -> None:
    answer = _exchange(admin[0], raw + b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status) and b"\r\nConnection: close" in head
    # One JSON body and nothing after it: the request that followed is not answered.
    assert json.loads(body)["error"] == "bad_request"


def test_head_gets_the_headers_only(admin: tuple[AdminServer, _State]) -> None:
    for path in (b"/readyz", b"/livez", b"/metrics"):
        answer = _exchange(admin[0], b"HEAD %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
        head, end, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and end and body == b"", path
        get = _exchange(admin[0], b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
        if path != b"/metrics":  # a scrape's length changes as it counts itself
            assert head == get.partition(b"\r\n\r\n")[0]


def test_with_every_connection_being_answered_a_newcomer_is_closed() -> None:
    server = _server(max_connections=1)  # never started: admissions called by hand
    try:
        answering = AdminConnection(server)
        answering.waiting = False
        server.open[answering] = None
        assert not server.admit(AdminConnection(server))
        assert server.closed_full == 1
    finally:
        server.stop()
