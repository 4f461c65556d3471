"""Soak: a bounded minute of mixed load with faults, then a minute of fuzzed
requests, on 127.0.0.1 only.

    make soak        # or: .venv/bin/python bench/soak.py --seconds 60 --fuzz-seconds 60

Server A runs the whole time under steady load while the faults land on it:
garbage bytes, absurd frame lengths, connection floods past --max-connections,
idle connections. Server B is restarted (SIGTERM, same state dir) every few
seconds under load. The report gives A's threads, file descriptors and memory
at the start and the end, B's duplicate count across its restarts, and an
active client's p99 with 500 idle connections open. Then the request decoder's
fuzz target (tests/support/fuzzing.py, a few hundred inputs in the suite) runs
against a framed and a buffered server until --fuzz-seconds have passed. Exit
status 1 if anything grew without bound, any id repeated, the p99 bound was
missed, or a fuzzed request was neither answered nor closed in time (or held up
a well-behaved client).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.fuzzing import RequestFuzz
from tests.support.processes import Load, ServerProcess, start_server

MAX_CONNECTIONS = 600


def resources(server: ServerProcess) -> dict[str, int]:
    pid = server.process.pid
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    field = {key: value.split()[0] for key, _, value in (line.partition(":") for line in status)
             if value.split()}  # fmt: skip
    return {
        "threads": int(field["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "rss_kib": int(field["VmRSS"]),
    }


def send(server: ServerProcess, payload: bytes) -> None:
    try:
        with socket.create_connection((server.host, server.port), timeout=2) as raw:
            raw.sendall(payload)
            raw.shutdown(socket.SHUT_WR)
            while raw.recv(65536):
                pass
    except OSError:
        pass  # refused or reset under the flood: that is the point


def faults(server: ServerProcess, rng: random.Random) -> None:
    """One round of hostile traffic."""
    for _ in range(20):
        send(server, rng.randbytes(rng.randint(1, 300)))
    for length in (2**31 - 1, 2**30, -1, 70_000):
        send(server, struct.pack("!i", length) + b"\x80\x01\x00\x01")
    send(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    flood: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS + 50):  # past the limit: the rest are refused
            try:
                flood.append(socket.create_connection((server.host, server.port), timeout=2))
            except OSError:
                break
    finally:
        for conn in flood:
            conn.close()


def idle_p99(server: ServerProcess, idle: int = 500, calls: int = 5000) -> float:
    """An active client's p99 in ms while ``idle`` connections sit open."""
    sockets = [socket.create_connection((server.host, server.port)) for _ in range(idle)]
    try:
        client = server.raw_client()
        latencies = []
        for _ in range(calls):
            started = time.perf_counter()
            client.get_id("soak-active")
            latencies.append(time.perf_counter() - started)
        client.close()
    finally:
        for conn in sockets:
            conn.close()
    return statistics.quantiles(latencies, n=100)[98] * 1000


def fuzz(seconds: float) -> bool:
    """Fuzzed requests on a server of each transport, in rounds, until ``seconds``
    have passed; prints a table; whether every input was answered or closed in time
    and memory stayed bounded."""
    servers = [start_server(transport="framed"), start_server(transport="buffered")]
    failure = ""
    try:
        fuzzers = [RequestFuzz(server) for server in servers]
        for fuzzer in fuzzers:
            fuzzer.run(30)  # warm up before the first reading
        start = [resources(server) for server in servers]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not failure:
            for server, fuzzer in zip(servers, fuzzers, strict=True):
                try:
                    fuzzer.run(200)
                except Exception as e:  # noqa: BLE001 - reported; hypothesis printed the input
                    failure = f"{server.transport}: {e}"
                    break
        end = [resources(server) for server in servers]
    finally:
        for server in servers:
            server.stop()
    print(f"fuzzed requests for {seconds:.0f} s:")
    print("| transport | inputs | replies | closed unanswered | slowest | RSS KiB start | end |")
    print("|---|---|---|---|---|---|---|")
    bounded = True
    for server, fuzzer, before, after in zip(servers, fuzzers, start, end, strict=True):
        bounded = bounded and after["rss_kib"] <= before["rss_kib"] + 30_000
        print(f"| {server.transport} | {fuzzer.sent:,} | {fuzzer.replies:,} | "
              f"{fuzzer.silent_closes:,} | {fuzzer.slowest_s * 1000:.0f} ms | "
              f"{before['rss_kib']:,} | {after['rss_kib']:,} |")  # fmt: skip
    if failure:
        print(f"FAILED: {failure}")
    return bounded and not failure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--restart-every", type=float, default=8.0)
    parser.add_argument("--fuzz-seconds", type=float, default=60.0)
    args = parser.parse_args()
    rng = random.Random(1)
    state = Path(tempfile.mkdtemp(prefix="snowflake-soak-"))
    limits = ("--max-connections", str(MAX_CONNECTIONS))
    a = start_server(*limits, "--audit-log", str(state / "audit.jsonl"), state_dir=state / "a")
    b = start_server(*limits, "--worker-id", "1", state_dir=state / "b")
    try:
        p99 = idle_p99(a)
        with Load([a], per_server=2) as load_a:
            time.sleep(1.0)  # steady state before the first reading
            start = resources(a)
            b_ids: list[int] = []
            deadline = time.monotonic() + args.seconds
            next_restart = time.monotonic() + args.restart_every
            restarts = rounds = 0
            load_b = Load([b], per_server=2).__enter__()
            while time.monotonic() < deadline:
                faults(a, rng)
                rounds += 1
                if time.monotonic() > next_restart:
                    load_b.stop()
                    b_ids += load_b.ids
                    b.stop()
                    b = start_server(*limits, "--worker-id", "1", state_dir=state / "b")
                    load_b = Load([b], per_server=2).__enter__()
                    restarts += 1
                    next_restart = time.monotonic() + args.restart_every
            load_b.stop()
            b_ids += load_b.ids
            time.sleep(1.0)  # let the last flood's threads end
            end = resources(a)
        a_ids = load_a.ids
    finally:
        a.stop()
        b.stop()
    duplicates = len(b_ids) - len(set(b_ids)) + len(a_ids) - len(set(a_ids))
    checks = {
        "threads": end["threads"] <= start["threads"] + 5,
        "fds": end["fds"] <= start["fds"] + 10,
        "rss_kib": end["rss_kib"] <= start["rss_kib"] + 30_000,
    }
    print(f"soak: {args.seconds:.0f} s, {rounds} fault rounds on A, {restarts} restarts of B")
    print("| server A | start | end | bounded |")
    print("|---|---|---|---|")
    for key, ok in checks.items():
        print(f"| {key} | {start[key]:,} | {end[key]:,} | {'yes' if ok else 'NO'} |")
    print(f"ids: A {len(a_ids):,}, B {len(b_ids):,} across restarts; duplicates {duplicates}")
    print(f"active client p99 with 500 idle connections: {p99:.3f} ms "
          f"({'PASS' if p99 < 5 else 'MISS'}: < 5 ms)")  # fmt: skip
    ok = all(checks.values()) and duplicates == 0 and p99 < 5 and rounds > 0
    fuzzed = fuzz(args.fuzz_seconds)
    return 0 if ok and fuzzed else 1


if __name__ == "__main__":
    sys.exit(main())
