"""The HTTP/JSON API against the Thrift side, on one server (``make bench``).

One ``snowflake-server`` with ``--http-port``; in interleaved rounds, the compiled
load generator calls Thrift ``get_id`` and Debian's ``wrk`` calls ``GET /v1/id``
(keep-alive), on 127.0.0.1, at 4 and 16 connections; the issue's target is HTTP
at >= 50 % of the Thrift rate. Bounded: every run has a duration and a timeout.

    .venv/bin/python bench/http_api.py --build bench/build [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run_bench import AGENT, RESULTS, Config, Plan, loadgen_args, run_loadgen
from bench.servers import BUILD, start_ours

TARGET_HTTP_VS_THRIFT = 0.5
CONNECTIONS = (4, 16)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_wrk(port: int, connections: int, seconds: float) -> float:
    """``GET /v1/id`` calls/s by wrk (2 threads, keep-alive); errors fail the run."""
    url = f"http://127.0.0.1:{port}/v1/id?agent={AGENT}"
    command = ["wrk", "-t2", f"-c{connections}", f"-d{seconds:g}s", url]
    out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 30, check=True)
    if "Non-2xx" in out.stdout or "Socket errors" in out.stdout:
        raise RuntimeError(f"wrk saw errors:\n{out.stdout}")
    found = re.search(r"Requests/sec:\s+([0-9.]+)", out.stdout)
    if found is None:
        raise RuntimeError(f"no rate in wrk's output:\n{out.stdout}")
    return float(found.group(1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=BUILD)
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s (default 3 of 5 s)")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench/http_api.py needs wrk (make bench-deps installs it)", file=sys.stderr)
        return 2
    rounds, seconds = (1, 3.0) if args.quick else (3, 5.0)
    plan = Plan(warmup_s=1.0, seconds=seconds, rounds=rounds, idle_rounds=0, server_warmup_s=0)
    http_port = free_port()
    rates: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-http-") as work:
        server = start_ours("ours", Path(work) / "logs", Path(work) / "state",
                            "--http-port", str(http_port))  # fmt: skip
        try:
            for _ in range(rounds):
                for connections in CONNECTIONS:
                    config = Config("get_id", connections)
                    run = run_loadgen(args.build / "loadgen", server,
                                      loadgen_args(config, plan, 1), seconds + 60)  # fmt: skip
                    if run.errors:
                        raise RuntimeError(f"thrift errors: {run.errors}")
                    rates.setdefault(("thrift", connections), []).append(run.calls_per_s)
                    rate = run_wrk(http_port, connections, seconds)
                    rates.setdefault(("http", connections), []).append(rate)
        finally:
            server.stop()
    lines = ["| connections | Thrift get_id calls/s | HTTP GET /v1/id calls/s | HTTP / Thrift |",
             "|--:|--:|--:|--:|"]  # fmt: skip
    verdicts = []
    for connections in CONNECTIONS:
        thrift = statistics.median(rates[("thrift", connections)])
        http = statistics.median(rates[("http", connections)])
        ratio = http / thrift
        lines.append(f"| {connections} | {thrift:,.0f} | {http:,.0f} | {ratio:.2f} x |")
        verdict = "PASS" if ratio >= TARGET_HTTP_VS_THRIFT else "FAIL"
        verdicts.append(f"  {verdict} HTTP vs Thrift get_id, {connections} connections: "
                        f"{ratio:.2f} x, goal >= {TARGET_HTTP_VS_THRIFT:.2f} x")  # fmt: skip
    table = "\n".join(lines)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"{stamp}-http"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(f"# HTTP/JSON API vs Thrift ({stamp})\n\n{table}\n")
    (out / "results.json").write_text(json.dumps(
        {f"{kind}-{c}": v for (kind, c), v in rates.items()}, indent=1))  # fmt: skip
    print(table)
    print("targets:\n" + "\n".join(verdicts))
    print(f"written: {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
