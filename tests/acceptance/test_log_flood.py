"""Logs and file descriptors as a weapon: a flood of garbage connections writes a
bounded log; an open-file limit too low for --max-connections is refused at start;
a server out of file descriptors pauses accepting instead of logging tracebacks."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time

from tests.support.processes import parse_metrics, spawn_server, start_server
from tests.support.waiting import wait_until

FLOOD = 3000


def garbage_connections(port: int, count: int) -> None:
    """``count`` connections that each send a bad frame and go."""
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"\xff\xff\xff\xffGARBAGE")
            with contextlib.suppress(OSError):
                sock.recv(64)


def suppressed(metrics: str) -> float:
    return sum(
        v for k, v in parse_metrics(metrics).items()
        if k.startswith("snowflake_log_lines_suppressed_total")
    )  # fmt: skip


def test_a_flood_of_garbage_connections_writes_a_bounded_log() -> None:
    server = start_server()
    try:
        before = len(server.log().splitlines())
        started = time.monotonic()
        garbage_connections(server.port, FLOOD)
        took = time.monotonic() - started
        wait_until(lambda: suppressed(server.metrics()) > 0, "lines counted as suppressed")
        lines = server.log().splitlines()[before:]
        closing = [line for line in lines if "closing connection from" in line]
        # 10 at once, then 1 a second per cause: a bound that does not grow with the flood.
        assert len(closing) <= 10 + took + 2, f"{len(closing)} lines in {took:.1f} s"
        counted = suppressed(server.metrics())
        assert counted + len(closing) >= FLOOD, "every line is either written or counted"
        assert server.raw_client().get_id("after") > 0
    finally:
        assert server.stop() == 0
    print(f"flood: {FLOOD} connections in {took:.1f} s → {len(lines)} log lines, "
          f"{sum(map(len, lines))} bytes; {counted:.0f} suppressed")  # fmt: skip


def test_an_open_file_limit_below_max_connections_is_refused_at_start() -> None:
    # Native threads' files are counted too (tests/serving/test_listeners.py): none here.
    process, stderr, _ = spawn_server(
        "--max-connections", "1000", "--native-threads", "0",
        wrapper=["prlimit", "--nofile=512:512", "--"],
    )  # fmt: skip
    try:
        assert process.wait(30) == 2
    finally:
        assert process.stdout is not None
        process.stdout.close()
        stderr.seek(0)
        log = stderr.read()
        stderr.close()
    assert "serving 1008 connections (--max-connections, 8 kept for peer checks" in log, log
    assert "needs 1136 open files" in log
    assert "512 (soft) / 512 (hard)" in log and "LimitNOFILE=1136" in log
    assert "lower those limits by 624 or more" in log


def test_out_of_file_descriptors_the_admin_endpoint_pauses_instead_of_logging_tracebacks() -> None:
    server = start_server("--max-connections", "64")
    pid = server.process.pid
    socks: list[socket.socket] = []
    try:
        # What a host out of files looks like from inside: the limit cut to what is open now
        # plus a few (prlimit on the running process), once the serving loop runs (a call
        # answered: the loop's own files are open).
        assert server.raw_client().get_id("before") > 0
        in_use = len(os.listdir(f"/proc/{pid}/fd"))
        limit = in_use + 4
        subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={limit}:"], check=True)
        for _ in range(40):  # the admin endpoint's and the Thrift port's, all held
            for port in (server.metrics_port, server.port):
                with contextlib.suppress(OSError):
                    socks.append(socket.create_connection(("127.0.0.1", port), 5))
        wait_until(lambda: "cannot accept connections" in server.log(), "the admin pausing")
        for sock in socks:
            sock.close()
        socks.clear()
        subprocess.run(["prlimit", f"--pid={pid}", "--nofile=1024:"], check=True)
        wait_until(lambda: server.http_get("/livez")[0] == 200, "the admin endpoint recovers")
        counts = parse_metrics(server.metrics())
        assert counts['snowflake_accept_pauses_total{listener="admin"}'] >= 1
        assert server.raw_client().get_id("after") > 0
    finally:
        for sock in socks:
            sock.close()
        assert server.stop() == 0
    log = server.log()
    print(f"out of fds: {len(log.splitlines())} log lines, {log.count('Traceback')} tracebacks")
    assert log.count("Traceback") == 0, log[-3000:]
    assert len(log.splitlines()) < 100, f"{len(log.splitlines())} lines"
