"""The HTTP/JSON API against the Thrift side, on one server (``make bench``).

One ``snowflake-server`` with ``--http-port``; in interleaved rounds, the compiled
load generator calls Thrift ``get_id`` and Debian's ``wrk`` calls ``GET /v1/id``
(keep-alive), on 127.0.0.1, at 4 and 16 connections; the target is HTTP at >= 50 %
of the Thrift rate. With ``--baseline-rev REV`` the server of that revision is
measured too, in the same rounds (before and after a change). Bounded: every run has
a duration and a timeout.

    .venv/bin/python bench/http_api.py --build bench/build [--quick] [--baseline-rev REV]
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
from bench.servers import BUILD, Server, extract_baseline, start_baseline, start_ours

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
    parser.add_argument("--baseline-rev", help="also measure the server of this git revision")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; quick 1)")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench/http_api.py needs wrk (make bench-deps installs it)", file=sys.stderr)
        return 2
    rounds, seconds = (1, 3.0) if args.quick else (3, 5.0)
    rounds = args.rounds or rounds
    plan = Plan(warmup_s=1.0, seconds=seconds, rounds=rounds, idle_rounds=0, server_warmup_s=0)
    rates: dict[tuple[str, str, int], list[float]] = {}
    names = ["ours"] + ([f"old ({args.baseline_rev})"] if args.baseline_rev else [])
    with tempfile.TemporaryDirectory(prefix="bench-http-") as work:
        servers: dict[str, tuple[Server, int]] = {}
        try:
            for name in names:
                http_port = free_port()
                logs, state = Path(work) / "logs", Path(work) / f"state-{len(servers)}"
                flags = ("--http-port", str(http_port), "--worker-id", str(len(servers)))
                if name == "ours":
                    server = start_ours("ours", logs, state, *flags)
                else:
                    source = extract_baseline(args.baseline_rev, Path(work) / "old")
                    server = start_baseline("old", logs, state, source.resolve(), *flags)
                servers[name] = (server, http_port)
            for _ in range(rounds):
                for connections in CONNECTIONS:
                    for name, (server, http_port) in servers.items():
                        config = Config("get_id", connections)
                        run = run_loadgen(args.build / "loadgen", server,
                                          loadgen_args(config, plan, 1), seconds + 60)  # fmt: skip
                        if run.errors:
                            raise RuntimeError(f"thrift errors: {run.errors}")
                        rates.setdefault((name, "thrift", connections), []).append(run.calls_per_s)
                        rate = run_wrk(http_port, connections, seconds)
                        rates.setdefault((name, "http", connections), []).append(rate)
        finally:
            for server, _ in servers.values():
                server.stop()
    lines = ["| server | connections | Thrift get_id calls/s | HTTP GET /v1/id calls/s "
             "| HTTP / Thrift |", "|---|--:|--:|--:|--:|"]  # fmt: skip
    verdicts = []
    for connections in CONNECTIONS:
        for name in names:
            thrift = statistics.median(rates[(name, "thrift", connections)])
            http = statistics.median(rates[(name, "http", connections)])
            ratio = http / thrift
            lines.append(
                f"| {name} | {connections} | {thrift:,.0f} | {http:,.0f} | {ratio:.2f} x |"
            )
            if name != "ours":
                continue
            verdict = "PASS" if ratio >= TARGET_HTTP_VS_THRIFT else "FAIL"
            verdicts.append(f"  {verdict} HTTP vs Thrift get_id, {connections} connections: "
                            f"{ratio:.2f} x, goal >= {TARGET_HTTP_VS_THRIFT:.2f} x")  # fmt: skip
    table = "\n".join(lines)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"{stamp}-http"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(
        f"# HTTP/JSON API vs Thrift ({stamp}, medians of {rounds} rounds of {seconds:g} s)"
        f"\n\n{table}\n"
    )
    (out / "results.json").write_text(json.dumps(
        {f"{name}-{kind}-{c}": v for (name, kind, c), v in rates.items()}, indent=1))  # fmt: skip
    print(table)
    print("targets:\n" + "\n".join(verdicts))
    print(f"written: {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
