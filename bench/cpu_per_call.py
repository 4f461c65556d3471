"""Server CPU time per get_id call: ours next to the bare thriftpy2 floor.

    .venv/bin/python bench/cpu_per_call.py [--calls 30000] [--rounds 3]

Throughput on a shared 2-core machine swings by a third from run to run; the
CPU time a server process spends per call (from /proc/<pid>/stat, over many
calls on one connection) is far steadier, and says directly what our layer
costs on top of the framework. On 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from snowflake_thrift_client._transports import open_client

from bench.servers import Server, start_floor, start_ours


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def per_call_us(server: Server, calls: int) -> float:
    client: Any = open_client(server.host, server.port, "framed", 5.0)
    try:
        client.get_id("warm-up")
        before = cpu_seconds(server.process.pid)
        for _ in range(calls):
            client.get_id("cpu-per-call")
        return (cpu_seconds(server.process.pid) - before) / calls * 1e6
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="snowflake-cpu-"))
    ours = start_ours("ours", work / "logs", work / "state")
    floor = start_floor("floor", work / "logs")
    try:
        print("| round | ours µs CPU/call | floor µs CPU/call | ours / floor |")
        print("|--:|--:|--:|--:|")
        for round_ in range(1, args.rounds + 1):
            mine, bare = per_call_us(ours, args.calls), per_call_us(floor, args.calls)
            print(f"| {round_} | {mine:.1f} | {bare:.1f} | {mine / bare:.2f} x |", flush=True)
    finally:
        ours.stop()
        floor.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
