"""The C load generator (bench/native/loadgen.c): its figures add up on a real server,
and every check it makes bites (never its speed)."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.loadgen import Histogram
from bench.servers import start_floor
from tests.bench.native import assert_clean, loadgen
from tests.support.endpoints import free_port
from tests.support.inprocess import InProcessServer
from tests.support.processes import start_server


def test_get_id_on_a_real_server(loadgen_binary: Path, server: InProcessServer) -> None:
    outcome = loadgen(loadgen_binary, server.port, "--connections", "4", "--marks")
    report = assert_clean(outcome, connections=4)
    assert report["method"] == "get_id" and report["idle"] == 0
    assert report["connections_by_worker"] == {"0/0": 4}
    # --marks: the measured period's start and end, in that order, and nothing else.
    assert outcome.stderr == "loadgen: measuring\nloadgen: measured\n"
    # The histogram is bench/loadgen.py's: the harness merges rounds with that class.
    histogram = Histogram.from_json(report["histogram"])
    assert histogram.count == report["calls"]
    assert histogram.percentile(0.99) / 1e3 == pytest.approx(report["p99_us"], abs=0.01)


def test_get_ids_on_a_real_server(loadgen_binary: Path, server: InProcessServer) -> None:
    outcome = loadgen(
        loadgen_binary, server.port, "--method", "get_ids", "--count", "100",
        "--connections", "2",
    )  # fmt: skip
    report = assert_clean(outcome, connections=2, count=100)
    assert report["ids_per_s"] == pytest.approx(report["calls_per_s"] * 100, rel=1e-3)


def test_spreads_connections_over_server_processes(loadgen_binary: Path) -> None:
    server = start_server("--processes", "2", "--worker-id", "4")
    try:
        outcome = loadgen(loadgen_binary, server.port, "--connections", "4", "--spread", "2")
    finally:
        server.stop()
    report = assert_clean(outcome, connections=4)
    assert report["connections_by_worker"] == {"0/4": 2, "0/5": 2}


def test_a_constant_id_is_an_error(loadgen_binary: Path, tmp_path: Path) -> None:
    """The floor server answers every get_id with one constant: within a connection the
    ids do not increase, and across connections the same id comes twice."""
    floor = start_floor("floor", tmp_path)
    try:
        outcome = loadgen(loadgen_binary, floor.port, "--connections", "2")
    finally:
        floor.stop()
    assert outcome.code == 1 and outcome.report is not None
    assert outcome.report["errors"] > 2
    assert any("not increasing" in e for e in outcome.errors), outcome.errors
    assert any(
        "1 ids were handed out on more than one connection (the first: 1234567890123456789)" in e
        for e in outcome.errors
    ), outcome.errors


def test_a_batch_that_repeats_ids_is_an_error(loadgen_binary: Path, tmp_path: Path) -> None:
    floor = start_floor("floor", tmp_path)  # get_ids: the same prebuilt list every time
    try:
        outcome = loadgen(loadgen_binary, floor.port, "--method", "get_ids", "--count", "16")
    finally:
        floor.stop()
    assert outcome.code == 1
    assert any("id 1234567890123456789 after 1234567890123456804" in e for e in outcome.errors)


def test_a_declared_exception_is_an_error_with_its_message(
    loadgen_binary: Path, server: InProcessServer
) -> None:
    outcome = loadgen(loadgen_binary, server.port, "--agent", "not an agent")
    assert outcome.code == 1 and outcome.report is not None
    assert outcome.report["calls"] == 0
    assert outcome.errors[0].startswith("connection 0, call 1: InvalidUserAgentError: ")
    assert "'not an agent'" in outcome.errors[0]
    # The connection stays usable after a declared exception: the calls go on.
    assert outcome.report["errors"] > 1


def test_a_bad_count_is_an_error(loadgen_binary: Path, server: InProcessServer) -> None:
    outcome = loadgen(loadgen_binary, server.port, "--method", "get_ids", "--count", "5000")
    assert outcome.code == 1
    assert outcome.errors[0].startswith("connection 0, call 1: InvalidCountError: ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--port is required"),
        (["--port", "0"], "--port 0: expected a whole number in 1..65535"),
        (["--port", "1", "--host", "10.0.0.1"], "only loopback addresses (127.0.0.0/8)"),
        (["--port", "1", "--host", "example.com"], "expected an IPv4 address in 127.0.0.0/8"),
        (["--port", "1", "--connections", "4", "--spread", "3"], "must be a multiple of it"),
        (["--port", "1", "--method", "get_worker_id"], "expected get_id or get_ids"),
        (["--port", "1", "--duration", "1e9"], "--duration 1e9: expected seconds"),
        (["--port", "1", "--idle", "-1"], "--idle -1: expected a whole number"),
        (["--port", "1", "--bogus"], "unknown flag --bogus"),
        (["--port", "1", "extra"], "unexpected argument extra"),
        (["--port"], "--port needs a value"),
    ],
)
def test_bad_flags_are_usage_errors(loadgen_binary: Path, args: list[str], message: str) -> None:
    done = subprocess.run(
        [str(loadgen_binary), *args], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 2 and done.stdout == ""
    assert message in done.stderr and "(loadgen --help for usage)" in done.stderr, done.stderr


def test_help(loadgen_binary: Path) -> None:
    done = subprocess.run(
        [str(loadgen_binary), "--help"], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: loadgen --port PORT")


def test_no_server(loadgen_binary: Path) -> None:
    outcome = loadgen(loadgen_binary, free_port())
    assert outcome.code == 1
    assert "connect to 127.0.0.1:" in outcome.errors[0] and "refused" in outcome.errors[0]


def test_idle_connections_stay_open(loadgen_binary: Path, server: InProcessServer) -> None:
    outcome = loadgen(loadgen_binary, server.port, "--idle", "200", "--connections", "2")
    report = assert_clean(outcome, connections=2)
    assert report["idle"] == report["idle_kept"] == 200


@pytest.fixture
def closing_listener() -> Iterator[int]:
    """A port whose listener accepts each connection and closes it at once."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listener.settimeout(0.05)
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        yield listener.getsockname()[1]
        stop.set()
        thread.join(5)


def test_idle_connections_the_server_closed_are_an_error(
    loadgen_binary: Path, closing_listener: int
) -> None:
    outcome = loadgen(loadgen_binary, closing_listener, "--idle", "10")
    assert outcome.code == 1
    assert "10 of the 10 idle connections were closed by the server" in outcome.errors
    # The active connection fails too: the server closed it (or reset it, unread).
    assert any(e.startswith("connection 0, call 1: ") for e in outcome.errors), outcome.errors


def test_reports_the_datacenter_and_worker_of_the_ids(loadgen_binary: Path) -> None:
    server = start_server("--worker-id", "9", "--datacenter-id", "2")
    try:
        outcome = loadgen(loadgen_binary, server.port, "--duration", "0.1")
    finally:
        server.stop()
    assert assert_clean(outcome, connections=1)["connections_by_worker"] == {"2/9": 1}
