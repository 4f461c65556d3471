"""The real server process, end to end over real sockets."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Literal, cast

import pytest
import thriftpy2
from snowflake_thrift_client._idl import snowflake_thrift
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TTransportException

from snowflake_server import ConfigurationError, ServerSettings, decompose
from snowflake_server._ids.clocks import wall_clock_ms
from snowflake_server._serving.listeners import started_threads
from snowflake_server._thrift.server import ThriftServer
from tests.support.endpoints import encode_call
from tests.support.fakes import FakeClock
from tests.support.inprocess import InProcessServer
from tests.support.processes import DATA, failures, parse_metrics, start_server, twitter_idl
from tests.support.waiting import wait_until

thrift = snowflake_thrift()


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_every_method_over_each_transport(transport: Any) -> None:
    server = start_server("--worker-id", "9", "--datacenter-id", "4", transport=transport)
    try:
        client = server.raw_client()
        before = wall_clock_ms()
        id_ = client.get_id("infra-dm")
        parts = decompose(id_)
        assert (parts.worker_id, parts.datacenter_id) == (9, 4)
        assert before <= parts.timestamp_ms <= wall_clock_ms()
        assert (client.get_worker_id(), client.get_datacenter_id()) == (9, 4)
        assert abs(client.get_timestamp() - wall_clock_ms()) < 1000
        ids = client.get_ids("infra-dm", 4096)
        assert len(ids) == 4096 and ids == sorted(ids) and ids[0] > id_
        layout = client.get_layout()
        assert (layout.epoch_ms, layout.timestamp_bits, layout.sequence_bits) == (
            1288834974657,
            41,
            12,
        )
        assert (layout.datacenter_id, layout.worker_id) == (4, 9)
    finally:
        assert server.stop() == 0


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
            lambda: parse_metrics(server.metrics())["snowflake_connections_open"] == 0,
            "the closed connections counted out",
            5,
        )
        counts = parse_metrics(server.metrics())
        assert failures(counts, "protocol_error") == 2


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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_within_2_seconds_and_lets_calls_finish(sig: int) -> None:
    server = start_server()
    idle = server.raw_client()
    idle.get_id("idle")
    busy = server.raw_client()
    results: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            try:
                results.extend(busy.get_ids("busy", 4096))
            except (TTransportException, OSError) as e:
                failures.append(e)
                return

    thread = threading.Thread(target=hammer)
    thread.start()
    wait_until(lambda: len(results) >= 4096 * 3, "three batches served")
    started = time.monotonic()
    server.process.send_signal(sig)
    code = server.process.wait(5)
    elapsed = time.monotonic() - started
    stop.set()
    thread.join(5)
    server.stop()
    assert code == 0, server.log()
    assert elapsed < 2.0
    # Every reply that arrived was whole: ids are unique and increasing.
    assert len(results) % 4096 == 0
    assert results == sorted(set(results))


def test_busy_port_is_a_clear_start_up_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AssertionError, match="cannot listen"):
            start_server("--port", str(port))


def test_epoch_in_the_future_is_a_clear_start_up_error() -> None:
    with pytest.raises(AssertionError, match="in the future"):
        start_server("--epoch", str(wall_clock_ms() + 3_600_000))


def test_server_runs_as_the_console_script(tmp_path: Any) -> None:
    import shutil
    import subprocess
    import sys

    script = shutil.which("snowflake-server", path=os.path.dirname(sys.executable))
    assert script, "the console script is installed"
    out = subprocess.run([script, "--help"], capture_output=True, text=True, check=True).stdout
    assert "SNOWFLAKE_WORKER_ID" in out and "--metrics-port" in out


def test_the_thrift_port_refuses_connections_until_it_listens() -> None:
    server = ThriftServer(
        cast(Any, None), cast(Any, None), ServerSettings(port=0).thrift
    )  # bind and listen use neither the processors nor the metrics
    try:
        _, port = server.bind()
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # queued in the backlog until served
    finally:
        server.close()


def test_a_port_taken_between_bind_and_listen_is_a_configuration_error() -> None:
    # SO_REUSEADDR lets two sockets bind one port while neither listens: the one that
    # listens second learns of the clash only then.
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        port = other.getsockname()[1]
        server = ThriftServer(cast(Any, None), cast(Any, None), ServerSettings(port=port).thrift)
        try:
            server.bind()
            other.listen()
            with pytest.raises(ConfigurationError, match=f"cannot listen on 127.0.0.1:{port}"):
                server.listen()
        finally:
            server.close()


def test_a_stop_asked_before_the_loop_runs_keeps_its_delay() -> None:
    # SIGTERM right after the ready line: the drain still runs before the stop.
    server = ThriftServer(cast(Any, None), cast(Any, None), ServerSettings(port=0).thrift)
    try:
        server.bind()
        started = time.monotonic()  # the delay counts from the request
        server.request_shutdown(after_s=0.3)
        server.request_shutdown(after_s=60)  # a later, longer one does not delay it
        server.serve_forever()
        # Not at once: after the delay, less the loop clock's granularity (uvloop's
        # timers count whole ms from the loop's cached time: 0.2994 s was seen).
        assert time.monotonic() - started >= 0.3 - 0.01
    finally:
        server.close()


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
