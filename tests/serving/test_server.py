"""The serving core's server (snowflake_server/_serving/server.py) in this process, over
real sockets: a whole node's (InProcessServer), and the core alone: its ports, their
slots and reserve, its loop's ticks, its stop. A server process end to end is in
tests/acceptance (test_server_process.py, test_start_and_stop.py)."""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import thriftpy2
import trustme
from prometheus_client import generate_latest
from snowflake_thrift_client._idl import snowflake_thrift
from snowflake_thrift_client._transports import open_client
from thriftpy2.thrift import TApplicationException

from snowflake_server import (
    ConfigurationError,
    GeneratorSettings,
    IdGenerator,
    ServerSettings,
)
from snowflake_server._http.protocol import HttpProtocol
from snowflake_server._ids.clocks import wall_clock_ms
from snowflake_server._observability.metrics import ConnectionStats, ServiceMetrics
from snowflake_server._service import SnowflakeHandler
from snowflake_server._serving import server as server_module
from snowflake_server._serving.listeners import listen_socket, started_threads
from snowflake_server._serving.server import Endpoint, Server
from snowflake_server._thrift.processor import Processor, service_methods
from snowflake_server._thrift.protocol import thrift_protocols
from tests.support.endpoints import encode_call, read_to_close
from tests.support.fakes import FakeClock
from tests.support.inprocess import InProcessServer
from tests.support.processes import DATA, failures, parse_metrics, twitter_idl
from tests.support.waiting import wait_until

thrift = snowflake_thrift()
OPEN = 'snowflake_connections_open{protocol="thrift"}'


def test_declared_errors_keep_the_connection_usable(server: InProcessServer) -> None:
    client = server.raw_client()
    for agent in ["", "1", "1asdf", "a b", "foo_bar", "x" * 129, "ünï"]:
        with pytest.raises(thrift.InvalidUserAgentError, match="letter followed by letters"):
            client.get_id(agent)
    for count in [0, 4097, -3]:
        with pytest.raises(thrift.InvalidCountError, match=r"1\.\.4096"):
            client.get_ids("infra-dm", count)
    with pytest.raises(thrift.InvalidUserAgentError, match="user agent missing"):
        client.get_id(None)
    assert client.get_id("infra-dm") > 0


def test_twitters_original_idl_client_works_unchanged(server: InProcessServer) -> None:
    original = twitter_idl()
    client = server.raw_client(original.Snowflake)
    first = client.get_id("infra-dm")
    assert client.get_id("infra-dm") > first
    assert (client.get_worker_id(), client.get_datacenter_id()) == (0, 0)
    assert abs(client.get_timestamp() - wall_clock_ms()) < 1000
    # The old IDL declares no throws: the error arrives as "missing result",
    # and the connection stays usable.
    with pytest.raises(TApplicationException) as info:
        client.get_id("foo_bar")
    assert info.value.type == TApplicationException.MISSING_RESULT
    assert client.get_id("infra-dm") > first


def test_unknown_method_is_an_application_error(server: InProcessServer) -> None:
    newer = thriftpy2.load(str(DATA / "future_snowflake.thrift"), module_name="future_sf_thrift")
    client = server.raw_client(newer.Snowflake)
    with pytest.raises(TApplicationException, match="unknown method 'get_id_v9'") as info:
        client.get_id_v9("infra-dm")
    assert info.value.type == TApplicationException.UNKNOWN_METHOD
    assert client.get_id("infra-dm") > 0
    counts = parse_metrics(server.metrics())
    assert failures(counts, "unknown_method") == 1


def test_garbage_bytes_leave_the_server_serving_others(server: InProcessServer) -> None:
    good = server.raw_client()
    assert good.get_id("before") > 0
    # (bytes, how the server counts it): a call cut off mid-message is a protocol
    # error too (a client hanging up between calls is not).
    junk: list[tuple[bytes, str | None]] = [
        (b"\x00\x00\x00\x05hello", "protocol_error"),  # a frame that is no Thrift message
        (b"\xff" * 64, "frame_too_large"),  # a negative frame length
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "frame_too_large"),  # 1.2 GB "frame"
        (b"\x00\x00\x00\x08\x80\x01\x00\x01\x00\x00\x00\xff", "protocol_error"),  # name past frame
        (bytes(range(256)) * 4, "frame_too_large"),  # 66,051 bytes announced
        (b"\x00\x00\x00\x0c\x80\x01\x00\x01\x00\x00\x00\x06get_id", "protocol_error"),  # cut off
    ]
    for payload, _ in junk:
        with socket.create_connection((server.host, server.port), timeout=5) as raw:
            raw.sendall(payload)
            raw.shutdown(socket.SHUT_WR)
            while raw.recv(1024):  # any explanation the server sends, then its close
                pass
        assert good.get_id("between") > 0
    assert server.raw_client().get_id("after") > 0
    counts = parse_metrics(server.metrics())
    for kind in ("protocol_error", "frame_too_large"):
        expected = sum(1 for _, counted in junk if counted == kind)
        assert failures(counts, kind) == expected, kind


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_a_call_cut_off_is_a_protocol_error_and_a_close_between_calls_is_not(
    transport: Literal["framed", "buffered"], tmp_path: Path
) -> None:
    with InProcessServer(ServerSettings(transport=transport), tmp_path) as server:
        request = encode_call("get_id", framed=transport == "framed", useragent="cut")
        for cut in (len(request) // 2, len(request) - 1):
            with socket.create_connection((server.host, server.port), timeout=5) as raw:
                raw.sendall(request[:cut])
                raw.shutdown(socket.SHUT_WR)
                assert raw.recv(1024) == b"", "closed without a reply"
        client = server.raw_client()
        assert client.get_id("whole") > 0
        client.close()  # between calls: a normal close
        wait_until(
            lambda: (
                parse_metrics(server.metrics())['snowflake_connections_open{protocol="thrift"}']
                == 0
            ),
            "the closed connections counted out",
            5,
        )
        counts = parse_metrics(server.metrics())
        assert failures(counts, "protocol_error") == 2


@pytest.mark.slow  # seconds of real time
def test_an_idle_client_is_not_dropped_after_3_seconds(server: InProcessServer) -> None:
    client = server.raw_client(timeout_s=10)
    first = client.get_id("idle")
    time.sleep(3.5)  # the thing under test is the passage of real time (thriftpy2 drops at 3 s)
    assert client.get_id("idle") > first


def test_idle_timeout_closes_quiet_connections(tmp_path: Path) -> None:
    with InProcessServer(ServerSettings(idle_timeout=0.2), tmp_path) as server:
        with socket.create_connection((server.host, server.port), timeout=5) as quiet:
            started = time.monotonic()
            assert quiet.recv(1) == b"", "the server closes the connection"
            assert 0.15 < time.monotonic() - started < 4
        assert server.raw_client().get_id("fresh") > 0


def test_internal_errors_reach_the_client_as_application_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(wall_clock_ms())
    # A layout whose 20 timestamp bits run out 1 s (of the fake clock) after the start.
    settings = ServerSettings(epoch=clock() - 2**20 + 1000, timestamp_bits=20)
    with InProcessServer(settings, tmp_path, clock=clock) as server:
        client = server.raw_client()
        assert client.get_id("overflow") > 0
        clock.now += 2000
        with pytest.raises(TApplicationException) as raised:
            client.get_id("overflow")
        assert raised.value.type == TApplicationException.INTERNAL_ERROR
        assert "TimestampOverflowError" in str(raised.value)
        assert client.get_worker_id() == 0, "the connection stays usable"
        counts = parse_metrics(server.metrics())
        assert failures(counts, "internal_error") == 1
    assert "internal error in get_id" in caplog.text


class _Bare:
    """The serving core alone (no Node): a Thrift endpoint and an HTTP one on free
    loopback ports, served from a thread by :meth:`start` until :meth:`stop`."""

    def __init__(
        self,
        *,
        thrift_max: int = 10,
        http_max: int = 10,
        reserve: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        ticks: Any = None,
    ) -> None:
        generator = IdGenerator(GeneratorSettings())
        self.metrics = metrics = ServiceMetrics(generator, service_methods(), max_agents=8)

        def handler(stats: ConnectionStats) -> SnowflakeHandler:
            return SnowflakeHandler(generator, metrics, stats, wall_clock_ms)

        self.endpoints = [
            Endpoint(
                "thrift",
                listen_socket("127.0.0.1", 0, reuse_port=False),
                thrift_protocols(
                    lambda stats: Processor(handler(stats), stats), framed=True, limit=65536
                ),
                thrift_max,
                reserve=reserve,
            ),
            Endpoint(
                "http",
                listen_socket("127.0.0.1", 0, reuse_port=False),
                lambda stats, _peer_check_only: HttpProtocol(handler(stats), stats),
                http_max,
            ),
        ]
        self.thrift, self.http = (e.address for e in self.endpoints)
        self.server = Server(self.endpoints, metrics, clock=clock, ticks=ticks)
        self._thread: threading.Thread | None = None
        self._clients: list[Any] = []

    def start(self) -> _Bare:
        self.server.listen()
        self._thread = threading.Thread(target=self.server.serve_forever, name="bare-server")
        self._thread.start()
        return self

    def client(self) -> Any:
        client = open_client(*self.thrift, "framed", 5.0)
        self._clients.append(client)
        return client

    def counts(self) -> dict[str, float]:
        return parse_metrics(generate_latest(self.metrics.registry()).decode())

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        self.server.request_shutdown()
        if self._thread is not None:
            self._thread.join(10)
            assert not self._thread.is_alive(), "the server did not stop within 10 s"
        self.server.close()

    def __enter__(self) -> _Bare:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def test_the_ports_refuse_connections_until_the_server_listens() -> None:
    bare = _Bare()
    try:
        for host, port in (bare.thrift, bare.http):
            with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
                probe.connect((host, port))
        bare.server.listen()
        for address in (bare.thrift, bare.http):
            with socket.create_connection(address, timeout=5):
                pass  # queued in the backlog until served
    finally:
        bare.server.close()


def test_a_port_taken_between_bind_and_listen_is_a_configuration_error() -> None:
    # SO_REUSEADDR lets two sockets bind one port while neither listens: the one that
    # listens second learns of the clash only then.
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        port = other.getsockname()[1]
        sock = listen_socket("127.0.0.1", port, reuse_port=False)
        server = Server([Endpoint("thrift", sock, _no_protocol, 1)], _metrics())
        try:
            other.listen()
            with pytest.raises(ConfigurationError, match=f"cannot listen on 127.0.0.1:{port}"):
                server.listen()
        finally:
            server.close()


def test_a_stop_asked_before_the_loop_runs_keeps_its_delay() -> None:
    # SIGTERM right after the ready line: the drain still runs before the stop.
    sock = listen_socket("127.0.0.1", 0, reuse_port=False)
    server = Server([Endpoint("thrift", sock, _no_protocol, 1)], _metrics())
    try:
        started = time.monotonic()  # the delay counts from the request
        server.request_shutdown(after_s=0.3)
        server.request_shutdown(after_s=60)  # a later, longer one does not delay it
        server.serve_forever()
        # Not at once: after the delay, less the loop clock's granularity (uvloop's
        # timers count whole ms from the loop's cached time: 0.2994 s was seen).
        assert time.monotonic() - started >= 0.3 - 0.01
    finally:
        server.close()


def _metrics() -> ServiceMetrics:
    return ServiceMetrics(IdGenerator(GeneratorSettings()), service_methods(), max_agents=8)


def _no_protocol(stats: ConnectionStats, peer_check_only: bool) -> Any:
    raise AssertionError("no connection is served")


def _closed_at_once(address: tuple[str, int]) -> bool:
    with socket.create_connection(address, timeout=5) as sock:
        return read_to_close(sock) == b""


def test_idle_http_connections_do_not_take_the_thrift_ports_slots() -> None:
    with _Bare(thrift_max=2, http_max=2) as bare:
        idle = [socket.create_connection(bare.http, timeout=5) for _ in range(2)]
        try:
            wait_until(
                lambda: bare.counts()['snowflake_connections_open{protocol="http"}'] == 2,
                "both HTTP connections admitted",
            )
            clients = [bare.client() for _ in range(2)]  # the old server refused both
            assert all(client.get_id("thrift") > 0 for client in clients)
            assert _closed_at_once(bare.http)  # a third HTTP one: its port is full
            counts = bare.counts()
            assert counts['snowflake_connections_rejected_total{protocol="http"}'] == 1
            assert counts['snowflake_connections_rejected_total{protocol="thrift"}'] == 0
            assert counts['snowflake_connections_open{protocol="thrift"}'] == 2
            assert counts['snowflake_connections_limit{protocol="http"}'] == 2
            assert counts['snowflake_connections_limit{protocol="thrift"}'] == 2
            # And the other way round: a full Thrift port leaves HTTP served.
            assert _closed_at_once(bare.thrift)
            for sock in idle:
                sock.close()
            status, body = _http_get(bare.http, "/v1/id?agent=web")
            assert status == 200 and int(body["id"]) > 0
        finally:
            for sock in idle:
                sock.close()


def _http_get(address: tuple[str, int], path: str) -> tuple[int, Any]:
    host, port = address
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def test_a_full_thrift_port_keeps_its_reserve_for_peer_checks_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with _Bare(thrift_max=1, reserve=1) as bare:
        first = bare.client()
        assert first.get_id("first") > 0  # admitted: the one slot is taken
        reserved = bare.client()
        assert reserved.get_worker_id() == 0  # a joining node's check passes
        assert reserved.get_layout().worker_id == 0
        with pytest.raises(thrift.UnavailableError, match="may only check the node's ids"):
            reserved.get_id("reserved")
        assert reserved.get_worker_id() == 0, "the reserved connection stays usable"
        with caplog.at_level(logging.WARNING, logger="snowflake_server._serving.server"):
            assert _closed_at_once(bare.thrift)  # beyond the limit and the reserve
            assert _closed_at_once(bare.thrift)
        assert caplog.text.count("refusing thrift connections") == 1  # logged once per 10 s
        counts = bare.counts()
        assert counts['snowflake_connections_rejected_total{protocol="thrift"}'] == 2
        assert first.get_id("first") > 0


def test_a_reserved_connection_is_closed_when_its_time_is_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_module, "RESERVED_FOR_S", 0.2)
    with _Bare(thrift_max=1, reserve=1) as bare:
        assert bare.client().get_id("first") > 0
        with socket.create_connection(bare.thrift, timeout=5) as reserved:
            assert read_to_close(reserved) == b""  # closed after 0.2 s, never asked a thing


class _Ticks:
    interval_s = 0.01

    def __init__(self) -> None:
        self.late: list[float] = []
        self.rested = threading.Event()

    def turned(self, late_s: float) -> None:
        self.late.append(late_s)

    def rest(self) -> None:
        self.rested.set()


def test_the_loop_ticks_are_counted_and_turn_waits_exported() -> None:
    ticks = _Ticks()
    clock = iter(range(10**9))  # each request costs a whole second of a 0.1 ms quantum
    with _Bare(ticks=ticks, clock=lambda: float(next(clock))) as bare:
        wait_until(lambda: len(ticks.late) >= 3, "the loop ticks")
        client = bare.client()
        ids = [client.get_ids("costly", 2) for _ in range(3)]
        assert [len(i) for i in ids] == [2, 2, 2]
        # Every call after the first overdrew the connection: its next waits a turn.
        assert bare.counts()["snowflake_turn_waits_total"] >= 2
    assert ticks.rested.is_set() and all(late >= 0 for late in ticks.late)


def test_new_tls_connections_take_the_context_set_since() -> None:
    ca = trustme.CA()
    certs = [ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")]
    contexts = []
    for cert in certs:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(context)
        contexts.append(context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)

    def served_cert(address: tuple[str, int]) -> bytes | None:
        raw = socket.create_connection(address, timeout=5)
        with client_context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.getpeercert(binary_form=True)

    bare = _Bare()
    bare.server.set_tls(contexts[0])  # before it serves: its ports are made with it
    with bare:
        ders = [ssl.PEM_cert_to_DER_cert(c.cert_chain_pems[0].bytes().decode()) for c in certs]
        assert served_cert(bare.thrift) == served_cert(bare.http) == ders[0]
        bare.server.set_tls(contexts[1])  # a certificate reloaded while serving
        assert served_cert(bare.thrift) == served_cert(bare.http) == ders[1]


def _alive(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_the_wait_threads_start_up_front_and_run_cancel_or_refuse_calls() -> None:
    pool = started_threads(2, "test-wait-up-front")
    assert _alive("test-wait-up-front") == 2  # none is started when a call comes
    release = threading.Event()
    holding = [pool.submit(release.wait, 10) for _ in range(2)]  # both threads busy
    cancelled, queued = pool.submit(int, "1"), pool.submit(int, "x")
    assert cancelled.cancel()
    release.set()
    assert [f.result(10) for f in holding] == [True, True]
    with pytest.raises(ValueError, match="invalid literal"):
        queued.result(10)  # a call's error reaches whoever waits on it
    assert not cancelled.running() and cancelled.cancelled()
    release.clear()
    holding = [pool.submit(release.wait, 10) for _ in range(2)]
    left = pool.submit(int, "2")
    pool.shutdown(wait=False, cancel_futures=True)
    assert left.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(int, "3")
    release.set()
    pool.shutdown()  # again: nothing more
    wait_until(lambda: _alive("test-wait-up-front") == 0, "the wait threads ended", 10)


def test_wait_threads_that_cannot_all_start_stop_those_that_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The one place a thread start is made to fail by hand: the black-box test in
    # tests/acceptance/test_hardening.py runs the server under a real pids limit.
    start = threading.Thread.start
    started: list[threading.Thread] = []

    def start_once(thread: threading.Thread) -> None:
        if started:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_once)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        started_threads(3, "test-wait-not-all")
    started[0].join(10)
    assert not started[0].is_alive() and _alive("test-wait-not-all") == 0
