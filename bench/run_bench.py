"""Benchmark: in-process ids/s, and get_id calls/s over Thrift on 127.0.0.1.

    make bench                      # or: .venv/bin/python bench/run_bench.py --seconds 5

Bounded in time (about 4 x --seconds plus start-up); traffic stays on loopback.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from snowflake_server.generator import GeneratorSettings, IdGenerator
from tests.support import start_server


def in_process(seconds: float) -> float:
    """ids/s of ``IdGenerator.next_id`` on one thread."""
    gen = IdGenerator(GeneratorSettings())
    next_id = gen.next_id
    n = 0
    deadline = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        for _ in range(10_000):
            next_id()
        n += 10_000
    return n / (time.perf_counter() - start)


def _client(port: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    from thriftpy2.thrift import TClient

    from snowflake_server.idl_loader import snowflake_thrift
    from snowflake_server.transports import binary_protocol, client_socket

    protocol = binary_protocol(client_socket("127.0.0.1", port, 5.0), "framed")
    protocol.trans.open()
    client = TClient(snowflake_thrift().Snowflake, protocol)
    latencies: list[float] = []
    clock = time.perf_counter
    deadline = clock() + seconds
    while (t0 := clock()) < deadline:
        client.get_id("bench")
        latencies.append(clock() - t0)
    client.close()
    out.put(latencies)


def over_thrift(connections: int, seconds: float) -> tuple[float, float, float, float]:
    """(calls/s, p50, p99, p999 in ms) of get_id with one client process per connection."""
    server = start_server()
    try:
        queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        procs = [
            mp.Process(target=_client, args=(server.port, seconds, queue))
            for _ in range(connections)
        ]
        for p in procs:
            p.start()
        latencies = [x for _ in procs for x in queue.get(timeout=seconds + 30)]
        for p in procs:
            p.join()
    finally:
        server.stop()
    latencies.sort()
    q = statistics.quantiles(latencies, n=1000)
    return len(latencies) / seconds, q[499] * 1e3, q[989] * 1e3, q[998] * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--connections", type=int, default=4)
    args = parser.parse_args()
    ids = in_process(args.seconds)
    calls, p50, p99, p999 = over_thrift(args.connections, args.seconds)
    print("| measurement | result |")
    print("|---|---|")
    print(f"| in-process next_id, 1 thread | {ids:,.0f} ids/s |")
    print(f"| get_id, {args.connections} client processes | {calls:,.0f} calls/s |")
    print(f"| get_id latency p50 / p99 / p999 | {p50:.3f} / {p99:.3f} / {p999:.3f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
