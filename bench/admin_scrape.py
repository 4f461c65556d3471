"""What a flood of ``/metrics`` scrapes costs the id path: the admin endpoint's dearest
request per byte, measured.

One ``snowflake-server`` on 127.0.0.1 (free ports, a temporary state directory); a
victim calls ``get_id`` one call at a time for ``--seconds``, first alone, then while
``--scrapers`` threads scrape ``/metrics`` flat out. Prints the victim's p50 / p99 / max
both times, the scrapes made and the server's CPU time per scrape (from /proc).
Bounded: the runs have a duration, the server is stopped at the end.

    .venv/bin/python bench/admin_scrape.py [--scrapers 8] [--seconds 5] [--quick]
"""

from __future__ import annotations

import argparse
import http.client
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from snowflake_thrift_client import SnowflakeClient

from snowflake_server._app.ready import parse_ready_line

REQUEST_BYTES = len(
    b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9990\r\nAccept-Encoding: identity\r\n\r\n"
)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _victim(host: str, port: int, seconds: float) -> list[float]:
    client = SnowflakeClient(host, port)
    latencies = []
    end = time.perf_counter() + seconds
    try:
        while (started := time.perf_counter()) < end:
            client.next_id("victim")
            latencies.append(time.perf_counter() - started)
    finally:
        client.close()
    return sorted(latencies)


def _summary(latencies: list[float]) -> str:
    def ms(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(len(latencies) * q))] * 1e3

    return (f"victim p50 {ms(0.5):.3f} / p99 {ms(0.99):.3f} / max {latencies[-1] * 1e3:.1f} ms, "
            f"{len(latencies):,} calls")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="1 s a run (make bench's smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = min(args.seconds, 1.0)
    with tempfile.TemporaryDirectory(prefix="bench-admin-") as state:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "snowflake-server"), "--port", "0",
             "--metrics-port", "0", "--state-dir", state, "--first-start-wait", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        try:
            assert server.stdout is not None
            ready = None
            while ready is None:
                line = server.stdout.readline()
                if not line:
                    raise RuntimeError("the server exited before its ready line")
                ready = parse_ready_line(line)
            (host, port), (admin_host, admin_port) = ready.thrift, ready.metrics
            print(f"alone: {_summary(_victim(host, port, args.seconds))}")
            stop, scrapes, size = threading.Event(), [0], [0]

            def scrape() -> None:
                while not stop.is_set():
                    conn = http.client.HTTPConnection(admin_host, admin_port, timeout=5)
                    conn.request("GET", "/metrics")
                    size[0] = len(conn.getresponse().read())
                    conn.close()
                    scrapes[0] += 1

            threads = [threading.Thread(target=scrape) for _ in range(args.scrapers)]
            cpu_before = _cpu_s(server.pid)
            for thread in threads:
                thread.start()
            flooded = _victim(host, port, args.seconds)
            stop.set()
            for thread in threads:
                thread.join(10)
            per_scrape_ms = (_cpu_s(server.pid) - cpu_before) * 1e3 / max(1, scrapes[0])
            print(f"{args.scrapers} scrapers: {_summary(flooded)}; {scrapes[0]:,} scrapes of "
                  f"{size[0]:,} bytes, {per_scrape_ms:.2f} ms of server CPU each "
                  f"(~{REQUEST_BYTES} bytes asked)")  # fmt: skip
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
