"""The load generator: load a running server with ``get_id`` and ``get_ids``.

    python -m bench.loadgen --host 127.0.0.1 --port 7609 \\
        --connections 1,4,16 --batch-sizes 1,64,1024,4096 --seconds 5 [--json]

Reports calls/s, ids/s and latency percentiles (p50, p99, p999) of each measurement.

How it measures:

- Every connection is its own client process (``multiprocessing``, spawn), so the
  clients are not held back by one GIL. The processes are started once and reused;
  each opens a fresh connection per measurement, outside the timed window, and makes
  a few warm-up calls.
- All connections of a measurement start together and run for ``--seconds``.
  Throughput is all calls completed divided by the span from the first start to the
  last end.
- Each call is timed with ``time.perf_counter``. After its window a process folds its
  samples into a log-linear histogram (8 significant bits: under 0.4 % error) and sends
  that back; the parent merges them, so the percentiles cover every call of every
  connection.
- ``get_ids`` rows also give the share of the per-worker limit: 2^sequence_bits ids per
  ms (4,096,000 ids/s with Twitter's layout), read with ``get_layout`` when the server
  has it.

For any server (it speaks the buffered transport too, and reads the layout). ``make
bench`` uses the C load generator instead (``bench/native/loadgen.c``): at tens of
thousands of calls per second this one spends more CPU per call than the server it
measures. Its :class:`Histogram` is the format both report latencies in.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from snowflake_thrift_client._transports import Transport, open_client

__all__ = [
    "DEFAULT_WORKER_LIMIT",
    "BenchError",
    "Histogram",
    "LoadGenerator",
    "LoadResult",
    "Method",
    "Target",
    "main",
    "markdown_table",
    "worker_limit",
]

Method = Literal["get_id", "get_ids"]

DEFAULT_WORKER_LIMIT = 4096 * 1000
"""Ids one worker id can issue per second with Twitter's layout: 4,096 per ms."""

_SIG_BITS = 8  # significant bits kept per latency sample: relative error < 2^-8
_MAX_CALLS = 50_000_000  # per connection and window: a bound besides the time
_WARMUP_CALLS = 20
_READY_TIMEOUT_S = 60.0  # spawning 16 interpreters on a busy 2-core machine takes a while
_DONE_GRACE_S = 30.0  # past --seconds: the last call, the histogram, the reply
_IDLE_EXIT_S = 1800.0  # a worker whose parent went quiet this long exits
_MAX_JOBS = 1_000_000
_MAX_RECONNECTS = 40  # per measurement, to spread connections over server processes


class BenchError(RuntimeError):
    """The load generator itself failed (a client process died or hung)."""


# -- latency histogram ---------------------------------------------------------------


def _bucket(ns: int) -> int:
    """``ns`` with only its top ``_SIG_BITS`` bits kept: the lower bound of its bucket."""
    shift = ns.bit_length() - _SIG_BITS
    return ns if shift <= 0 else (ns >> shift) << shift


def _bucket_mid(key: int) -> float:
    shift = key.bit_length() - _SIG_BITS
    return float(key) if shift <= 0 else key + ((1 << shift) - 1) / 2


@dataclass
class Histogram:
    """Latencies in ns, bucketed log-linearly; mergeable across processes."""

    buckets: Counter[int] = field(default_factory=Counter)
    count: int = 0
    total_ns: int = 0
    max_ns: int = 0

    @classmethod
    def of(cls, seconds: Iterable[float]) -> Histogram:
        samples = [int(s * 1e9) for s in seconds]
        if not samples:
            return cls()
        return cls(Counter(map(_bucket, samples)), len(samples), sum(samples), max(samples))

    def merge(self, other: Histogram) -> None:
        self.buckets.update(other.buckets)
        self.count += other.count
        self.total_ns += other.total_ns
        self.max_ns = max(self.max_ns, other.max_ns)

    def percentile(self, q: float) -> float:
        """The ``q`` quantile (0 < q <= 1) in ns, nearest rank; 0.0 when empty."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            if seen >= rank:
                return min(_bucket_mid(key), float(self.max_ns))
        return float(self.max_ns)

    def to_json(self) -> dict[str, Any]:
        return {
            "buckets": sorted(self.buckets.items()),
            "count": self.count,
            "total_ns": self.total_ns,
            "max_ns": self.max_ns,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Histogram:
        buckets = Counter({int(k): int(v) for k, v in data["buckets"]})
        return cls(buckets, int(data["count"]), int(data["total_ns"]), int(data["max_ns"]))


# -- what is measured ----------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One server, and the call to load it with."""

    host: str
    port: int
    transport: Transport = "framed"
    method: Method = "get_id"
    batch: int = 1
    agent: str = "bench"
    timeout_s: float = 5.0
    spread: int = 0
    """Server processes sharing the port (SO_REUSEPORT), told apart by worker id: the
    connections are reopened (a bounded number of times) until each has its share."""


@dataclass(frozen=True)
class LoadResult:
    """One measurement: ``connections`` clients calling ``method`` for ``seconds``."""

    method: str
    connections: int
    batch: int
    seconds: float
    calls: int
    ids: int
    histogram: Histogram
    errors: tuple[str, ...] = ()
    by_worker: tuple[tuple[int, int], ...] = ()
    """(worker id, connections) as the server processes answered ``get_worker_id``."""

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds if self.seconds > 0 else 0.0

    @property
    def ids_per_s(self) -> float:
        return self.ids / self.seconds if self.seconds > 0 else 0.0

    def latency_ms(self, q: float) -> float:
        return self.histogram.percentile(q) / 1e6

    @property
    def p50_ms(self) -> float:
        return self.latency_ms(0.5)

    @property
    def p99_ms(self) -> float:
        return self.latency_ms(0.99)

    @property
    def p999_ms(self) -> float:
        return self.latency_ms(0.999)

    @property
    def max_ms(self) -> float:
        return self.histogram.max_ns / 1e6

    @property
    def mean_ms(self) -> float:
        h = self.histogram
        return h.total_ns / h.count / 1e6 if h.count else 0.0

    def to_json(self, *, histogram: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "connections": self.connections,
            "batch": self.batch,
            "seconds": round(self.seconds, 4),
            "calls": self.calls,
            "ids": self.ids,
            "calls_per_s": round(self.calls_per_s, 1),
            "ids_per_s": round(self.ids_per_s, 1),
            "p50_ms": round(self.p50_ms, 4),
            "p99_ms": round(self.p99_ms, 4),
            "p999_ms": round(self.p999_ms, 4),
            "max_ms": round(self.max_ms, 4),
            "mean_ms": round(self.mean_ms, 4),
            "errors": list(self.errors),
            "connections_by_worker_id": {str(w): n for w, n in self.by_worker},
        }
        if histogram:
            out["histogram"] = self.histogram.to_json()
        return out


# -- the client processes ------------------------------------------------------------


def _connect(target: Target) -> Any:
    return open_client(target.host, target.port, target.transport, target.timeout_s)


def _call_once(client: Any, target: Target) -> int:
    if target.method == "get_id":
        client.get_id(target.agent)
        return 1
    ids = client.get_ids(target.agent, target.batch)
    if len(ids) != target.batch:
        raise BenchError(f"get_ids({target.batch}) returned {len(ids)} ids")
    return len(ids)


def _timed_window(client: Any, target: Target, seconds: float) -> dict[str, Any]:
    """Call as fast as one connection can for ``seconds``; the summary to send back."""
    latencies: list[float] = []
    append = latencies.append
    clock = time.perf_counter
    agent = target.agent
    ids = 0
    error: str | None = None
    start = time.monotonic()
    end = clock() + seconds
    try:
        if target.method == "get_id":
            get_id = client.get_id
            for _ in range(_MAX_CALLS):
                if (t0 := clock()) >= end:
                    break
                get_id(agent)
                append(clock() - t0)
            ids = len(latencies)
        else:
            get_ids = client.get_ids
            batch = target.batch
            for _ in range(_MAX_CALLS):
                if (t0 := clock()) >= end:
                    break
                ids += len(get_ids(agent, batch))
                append(clock() - t0)
    except Exception as e:  # noqa: BLE001 - reported with the partial result
        error = f"{type(e).__name__}: {e}"
    stop = time.monotonic()
    return {
        "calls": len(latencies),
        "ids": ids,
        "start": start,
        "end": stop,
        "error": error,
        "histogram": Histogram.of(latencies).to_json(),
    }


def _open(target: Target) -> tuple[Any, int | None]:
    """A connection, warmed up; and the worker id of the server process it reached
    (None if the server does not say). Raises ``BenchError``."""
    try:
        client = _connect(target)
    except Exception as e:  # noqa: BLE001 - the parent reports it
        raise BenchError(f"cannot connect to {target.host}:{target.port}: {e}") from None
    try:
        for _ in range(_WARMUP_CALLS):
            _call_once(client, target)
    except Exception as e:  # noqa: BLE001 - the parent reports it
        client.close()
        raise BenchError(f"warm-up {target.method} failed: {type(e).__name__}: {e}") from None
    try:
        worker_id: int | None = int(client.get_worker_id())
    except Exception:  # noqa: BLE001 - the connection may be unusable now: open another
        client.close()
        return _open_plain(target), None
    return client, worker_id


def _open_plain(target: Target) -> Any:
    client = _connect(target)
    _call_once(client, target)
    return client


def _run_job(conn: Connection, target: Target) -> None:
    client: Any = None
    try:
        for _ in range(_MAX_RECONNECTS + 1):
            if client is not None:
                client.close()
            try:
                client, worker_id = _open(target)
            except Exception as e:  # noqa: BLE001 - the parent reports it
                client = None
                conn.send(("failed", str(e)))
                return
            conn.send(("ready", worker_id))
            if not conn.poll(_READY_TIMEOUT_S + _DONE_GRACE_S):
                return
            message = conn.recv()
            if message[0] != "reconnect":
                break
        if message[0] != "go":
            return
        _, start_at, seconds = message
        delay = start_at - time.monotonic()
        if delay > 0:
            time.sleep(min(delay, 5.0))
        conn.send(("done", _timed_window(client, target, seconds)))
    finally:
        if client is not None:
            client.close()


def _worker(conn: Connection) -> None:
    """A client process: runs jobs from the parent until told to stop (or orphaned)."""
    with conn:
        for _ in range(_MAX_JOBS):
            try:
                if not conn.poll(_IDLE_EXIT_S):
                    return
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            _run_job(conn, message)


class LoadGenerator:
    """A pool of client processes, one connection each, reused across measurements.

    Use as a context manager. ``measure`` opens ``connections`` connections, lets
    them all call for ``seconds`` at once, and merges what they saw.
    """

    def __init__(self, processes: int = 0) -> None:
        # spawn: a fresh interpreter, safe whatever threads the caller runs
        self._context = mp.get_context("spawn")
        self._workers: list[tuple[BaseProcess, Connection]] = []
        if processes:
            self._grow(processes)

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _grow(self, count: int) -> None:
        while len(self._workers) < count:
            parent, child = self._context.Pipe()
            process = self._context.Process(
                target=_worker, args=(child,), name=f"bench-client-{len(self._workers)}"
            )
            process.daemon = True
            process.start()
            child.close()
            self._workers.append((process, parent))

    def close(self) -> None:
        """Stop every client process (politely first, then for good)."""
        workers, self._workers = self._workers, []
        for _, conn in workers:
            with contextlib.suppress(OSError):  # already gone
                conn.send(None)
        deadline = time.monotonic() + 5.0
        for process, conn in workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(5.0)
            conn.close()

    def _receive(self, conn: Connection, deadline: float, what: str) -> tuple[str, Any]:
        try:
            if conn.poll(max(0.0, deadline - time.monotonic())):
                message: tuple[str, Any] = conn.recv()
                return message
        except (EOFError, OSError) as e:
            self.close()
            raise BenchError(f"a client process died while {what}: {e}") from None
        self.close()
        raise BenchError(f"a client process did not answer in time while {what}")

    def measure(self, target: Target, connections: int, seconds: float) -> LoadResult:
        """Load ``target`` from ``connections`` client processes for ``seconds``."""
        if connections < 1 or seconds <= 0:
            raise ValueError("connections must be >= 1 and seconds > 0")
        self._grow(connections)
        conns = [conn for _, conn in self._workers[:connections]]
        for conn in conns:
            conn.send(target)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        replies = [self._receive(conn, deadline, "connecting") for conn in conns]
        if target.spread > 1 and all(kind == "ready" for kind, _ in replies):
            self._spread(conns, replies, target.spread, deadline)
        errors = tuple(sorted({str(detail) for kind, detail in replies if kind != "ready"}))
        ready = [conn for conn, (kind, _) in zip(conns, replies, strict=True) if kind == "ready"]
        by_worker = Counter(w for kind, w in replies if kind == "ready" and w is not None)
        if errors:
            for conn in ready:
                conn.send(("skip",))
            return LoadResult(
                target.method, connections, target.batch, 0.0, 0, 0, Histogram(), errors
            )
        start_at = time.monotonic() + 0.05
        for conn in ready:
            conn.send(("go", start_at, seconds))
        deadline = start_at + seconds + _DONE_GRACE_S
        reports = [self._receive(conn, deadline, "measuring")[1] for conn in ready]
        histogram = Histogram()
        for report in reports:
            histogram.merge(Histogram.from_json(report["histogram"]))
        span = max(r["end"] for r in reports) - min(r["start"] for r in reports)
        return LoadResult(
            method=target.method,
            connections=connections,
            batch=target.batch,
            seconds=span,
            calls=sum(r["calls"] for r in reports),
            ids=sum(r["ids"] for r in reports),
            histogram=histogram,
            errors=tuple(sorted({r["error"] for r in reports if r["error"]})),
            by_worker=tuple(sorted(by_worker.items())),
        )

    def _spread(
        self,
        conns: list[Connection],
        replies: list[tuple[str, Any]],
        processes: int,
        deadline: float,
    ) -> None:
        """Reopen connections until ``processes`` server processes have their share each.

        The kernel picks the process of each new connection (SO_REUSEPORT hashes the
        addresses), so 2 connections land on one of 2 processes half of the time.
        ``replies`` is updated in place; gives up after ``_MAX_RECONNECTS`` tries.
        """
        share = -(-len(conns) // processes)  # at most this many per process
        wanted = min(processes, len(conns))
        for _ in range(_MAX_RECONNECTS):
            holders: dict[Any, list[int]] = {}
            for i, (_, worker_id) in enumerate(replies):
                holders.setdefault(worker_id, []).append(i)
            if None in holders:
                return  # the server does not tell its processes apart
            if len(holders) >= wanted and max(map(len, holders.values())) <= share:
                return
            crowded = max(holders.values(), key=len)
            i = crowded[-1]
            conns[i].send(("reconnect",))
            replies[i] = self._receive(conns[i], deadline, "reconnecting")
            if replies[i][0] != "ready":
                return


def worker_limit(host: str, port: int, transport: Transport = "framed") -> tuple[int, bool]:
    """(ids/s one worker id can issue, whether the server told its layout).

    Raises ``OSError``-like Thrift errors when the server cannot be reached.
    """
    client = _connect(Target(host, port, transport, timeout_s=5.0))
    try:
        try:
            layout = client.get_layout()
        except Exception:  # noqa: BLE001 - an older or foreign server: assume Twitter's layout
            return DEFAULT_WORKER_LIMIT, False
        return (1 << int(layout.sequence_bits)) * 1000, True
    finally:
        client.close()


# -- the command ---------------------------------------------------------------------


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16: {text!r}")
    return values


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"not a number of seconds in (0, 3600]: {text!r}")
    return value


def build_parser(prog: str = "python -m bench.loadgen") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Measure get_id calls/s and latency, and get_ids ids/s, of a running "
        "snowflake server. Each connection is a separate client process.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="server address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7609, help="server port (default 7609)")
    parser.add_argument(
        "--transport",
        choices=("framed", "buffered"),
        default="framed",
        help="Thrift transport (default framed)",
    )
    parser.add_argument(
        "--connections",
        type=_positive_ints,
        default=[1, 4, 16],
        metavar="N,N",
        help="measure get_id with each of these numbers of connections (default 1,4,16)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=_positive_ints,
        default=[1, 64, 1024, 4096],
        metavar="N,N",
        help="measure get_ids with each of these counts (default 1,64,1024,4096)",
    )
    parser.add_argument(
        "--batch-connections",
        type=int,
        default=1,
        metavar="N",
        help="connections for the get_ids measurements (default 1)",
    )
    parser.add_argument(
        "--seconds", type=_seconds, default=5.0, help="length of each measurement (default 5)"
    )
    parser.add_argument(
        "--spread",
        type=int,
        default=0,
        metavar="N",
        help="the server runs N processes on its port (--processes N): reopen connections "
        "until each process has its share, told apart by worker id (default: no)",
    )
    parser.add_argument("--agent", default="bench", help="user agent sent (default bench)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def markdown_table(results: Sequence[LoadResult], limit: int = DEFAULT_WORKER_LIMIT) -> str:
    """The results as a Markdown table (share of the worker limit for get_ids)."""
    lines = [
        "| call | connections | calls/s | ids/s | of worker limit | p50 ms | p99 ms "
        "| p999 ms | max ms | errors |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in results:
        call = "get_id" if r.method == "get_id" else f"get_ids({r.batch})"
        share = f"{r.ids_per_s / limit:.1%}" if r.method == "get_ids" else ""
        lines.append(
            f"| {call} | {r.connections} | {r.calls_per_s:,.0f} | {r.ids_per_s:,.0f} | {share} "
            f"| {r.p50_ms:.3f} | {r.p99_ms:.3f} | {r.p999_ms:.3f} | {r.max_ms:.3f} "
            f"| {'; '.join(r.errors) or '-'} |"
        )
    return "\n".join(lines)


def _measurements(args: argparse.Namespace) -> Iterator[tuple[int, Target]]:
    server = (args.host, args.port, args.transport)
    for n in args.connections:
        yield n, Target(*server, "get_id", 1, args.agent, spread=args.spread)
    for batch in args.batch_sizes:
        target = Target(*server, "get_ids", batch, args.agent, spread=args.spread)
        yield args.batch_connections, target


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.loadgen`` (run from the repository root)."""
    args = build_parser().parse_args(argv)
    if args.batch_connections < 1:
        print("loadgen: error: --batch-connections must be >= 1", file=sys.stderr)
        return 2
    try:
        limit, layout_known = worker_limit(args.host, args.port, args.transport)
    except Exception as e:  # noqa: BLE001 - any failure to reach the server ends the run
        print(f"loadgen: cannot reach {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    plan = list(_measurements(args))
    if not args.json:
        print(
            f"loadgen: {args.host}:{args.port} ({args.transport}), {len(plan)} "
            f"measurements of {args.seconds:g} s",
            file=sys.stderr,
        )
    results: list[LoadResult] = []
    try:
        with LoadGenerator(max(n for n, _ in plan)) as load:
            for connections, target in plan:
                results.append(load.measure(target, connections, args.seconds))
    except BenchError as e:
        print(f"loadgen: {e}", file=sys.stderr)
        return 1
    if args.json:
        report = {
            "server": {"host": args.host, "port": args.port, "transport": args.transport},
            "seconds": args.seconds,
            "worker_limit_ids_per_s": limit,
            "layout_known": layout_known,
            "get_id": [r.to_json() for r in results if r.method == "get_id"],
            "get_ids": [
                {**r.to_json(), "of_worker_limit": round(r.ids_per_s / limit, 4)}
                for r in results
                if r.method == "get_ids"
            ],
        }
        print(json.dumps(report, indent=2))
    else:
        print(markdown_table(results, limit))
        note = "" if layout_known else " (assumed: the server has no get_layout)"
        print(f"\nworker limit: {limit:,} ids/s{note}")
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
