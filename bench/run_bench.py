"""The benchmark harness: ``make bench`` (or ``.venv/bin/python bench/run_bench.py``).

    make bench                                   # full run, about 3-4 minutes
    .venv/bin/python bench/run_bench.py --quick  # smoke test, well under a minute

Measures in one run, on 127.0.0.1 only, each part bounded in time:

(a) in-process ids/s on one thread: ``IdGenerator.next_id`` next to the ``snowflake-id``
    package's ``SnowflakeGenerator`` (the most used Python peer; no lock) and a bare
    ``threading.Lock`` + counter, alternately, best of several rounds;
(b) ``get_id`` calls/s and p50/p99/p999 latency with 1, 4 and 16 connections (one client
    process each) on ``snowflake-server`` next to the floor: a bare thriftpy2 server over
    the same transport and protocol that returns a constant (``bench/floor_server.py``);
(c) ``get_ids`` ids/s at batch sizes up to 4,096 on one connection (and 4,096 on two)
    next to one worker id's limit, 4,096,000 ids/s, and next to the floor;
(d) ``--processes 1`` against ``--processes 2``, when the server has that flag; the
    connections are spread evenly over the two processes (reopened until they are).

Servers are measured interleaved (ours, floor, floor, ours, ...) so that drift of the
shared machine hits both alike; throughput is the best round, latency percentiles are
over every call of every round. The results go to ``bench/results/<time>/``
(``results.md``, ``results.json``, ``chart.png``, server logs); a full run also copies
them to ``bench/results/latest.md`` and ``latest.png``. The Markdown and the target
ratios are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import (
    DEFAULT_WORKER_LIMIT,
    BenchError,
    Histogram,
    LoadGenerator,
    LoadResult,
    Method,
    Target,
)
from bench.servers import Server, ServerFailed, start_floor, start_ours
from snowflake_server import TWITTER_EPOCH_MS, GeneratorSettings, IdGenerator

RESULTS = Path(__file__).resolve().parent / "results"
OURS, FLOOR = "ours", "floor"
LIMIT = DEFAULT_WORKER_LIMIT

# The targets.
TARGET_NEXT_ID = 1.0  # x snowflake-id
TARGET_GET_ID = 0.9  # x floor, at 4 connections
TARGET_P99_MS = 1.0
TARGET_P999_MS = 2.0
TARGET_GET_IDS = 0.85  # of one worker's 4,096,000 ids/s, at 4,096 per call


@dataclass(frozen=True)
class Plan:
    seconds: float  # per get_id measurement
    batch_seconds: float  # per get_ids measurement
    rounds: int  # interleaved rounds per server and configuration
    inproc_seconds: float
    inproc_rounds: int
    connections: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    scaling_connections: tuple[int, ...]


FULL = Plan(3.0, 1.5, 3, 0.5, 5, (1, 4, 16), (1, 16, 256, 1024, 4096), (4, 16))
QUICK = Plan(1.0, 0.5, 1, 0.2, 2, (1, 4, 16), (1, 16, 256, 1024, 4096), (4, 16))


# -- (a) in process ------------------------------------------------------------------


class LockedCounter:
    """The bare baseline: a lock and a counter, nothing else."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0

    def next_id(self) -> int:
        with self._lock:
            self._n += 1
            return self._n


def _ours() -> Callable[[], object]:
    return IdGenerator(GeneratorSettings()).next_id


def _snowflake_id() -> Callable[[], object]:
    from snowflake import SnowflakeGenerator

    generator = SnowflakeGenerator(0, epoch=TWITTER_EPOCH_MS)
    return generator.__next__  # type: ignore[no-any-return]


def _locked() -> Callable[[], object]:
    return LockedCounter().next_id


@dataclass
class InProcess:
    name: str
    label: str
    rounds: list[float] = field(default_factory=list)
    missed: int = 0  # calls that gave no id (snowflake-id returns None when a ms is full)

    @property
    def best(self) -> float:
        return max(self.rounds, default=0.0)


def _ids_per_s(make: Callable[[], Callable[[], object]], seconds: float) -> tuple[float, int]:
    """ids/s of one fresh generator on this thread for ``seconds``; and the Nones."""
    call = make()
    chunk = range(10_000)
    calls = missed = 0
    start = time.perf_counter()
    deadline = start + seconds
    for _ in range(100_000):
        ids = [call() for _ in chunk]
        missed += ids.count(None)
        calls += len(ids)
        if time.perf_counter() >= deadline:
            break
    return (calls - missed) / (time.perf_counter() - start), missed


def in_process(plan: Plan) -> list[InProcess]:
    contenders: list[tuple[InProcess, Callable[[], Callable[[], object]]]] = [
        (InProcess("ours", "IdGenerator.next_id (thread-safe)"), _ours),
        (InProcess("snowflake-id", "snowflake-id SnowflakeGenerator (no lock)"), _snowflake_id),
        (InProcess("lock", "bare threading.Lock + counter"), _locked),
    ]
    try:
        _snowflake_id()
    except ImportError:
        print("(a) snowflake-id is not installed (pip install -e '.[bench]'): skipped")
        contenders = [c for c in contenders if c[0].name != "snowflake-id"]
    for _, make in contenders:  # warm up
        _ids_per_s(make, 0.05)
    for _ in range(plan.inproc_rounds):
        for result, make in contenders:
            rate, missed = _ids_per_s(make, plan.inproc_seconds)
            result.rounds.append(rate)
            result.missed += missed
    return [result for result, _ in contenders]


# -- (b), (c), (d) over Thrift -------------------------------------------------------


@dataclass
class Comparison:
    """One configuration (call, batch, connections) on several servers, over rounds."""

    key: str
    method: Method
    batch: int
    connections: int
    runs: dict[str, list[LoadResult]] = field(default_factory=dict)

    def best(self, name: str) -> LoadResult:
        rate: Callable[[LoadResult], float] = (
            (lambda r: r.calls_per_s) if self.method == "get_id" else (lambda r: r.ids_per_s)
        )
        return max(self.runs[name], key=rate)

    def rate(self, name: str) -> float:
        best = self.best(name)
        return best.calls_per_s if self.method == "get_id" else best.ids_per_s

    def latency_ms(self, name: str, q: float) -> float:
        """The ``q`` quantile over every call of every round."""
        merged = Histogram()
        for r in self.runs[name]:
            merged.merge(r.histogram)
        return merged.percentile(q) / 1e6

    def ratio(self, name: str, base: str) -> float:
        """Best round against best round."""
        return self.rate(name) / self.rate(base) if self.rate(base) else 0.0

    def round_ratios(self, name: str, base: str) -> list[float]:
        """Round i of ``name`` against round i of ``base`` (measured next to each other)."""
        pick: Callable[[LoadResult], float] = (
            (lambda r: r.calls_per_s) if self.method == "get_id" else (lambda r: r.ids_per_s)
        )
        return [
            pick(a) / pick(b) if pick(b) else 0.0
            for a, b in zip(self.runs[name], self.runs[base], strict=True)
        ]

    def ratio_range(self, name: str, base: str) -> str:
        ratios = self.round_ratios(name, base)
        return f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else "-"

    def errors(self) -> list[str]:
        return sorted({f"{n}: {e}" for n, rs in self.runs.items() for r in rs for e in r.errors})

    def to_json(self) -> dict[str, Any]:
        names = list(self.runs)
        return {
            "key": self.key,
            "method": self.method,
            "batch": self.batch,
            "connections": self.connections,
            "round_ratios": {
                f"{name}/{names[0]}": [round(x, 4) for x in self.round_ratios(name, names[0])]
                for name in names[1:]
            },
            "servers": {
                name: {
                    "best_rate": round(self.rate(name), 1),
                    "p50_ms": round(self.latency_ms(name, 0.5), 4),
                    "p99_ms": round(self.latency_ms(name, 0.99), 4),
                    "p999_ms": round(self.latency_ms(name, 0.999), 4),
                    "rounds": [r.to_json() for r in runs],
                }
                for name, runs in self.runs.items()
            },
        }


def interleaved(
    load: LoadGenerator,
    servers: dict[str, Server],
    key: str,
    method: Method,
    batch: int,
    connections: int,
    seconds: float,
    rounds: int,
    spread: dict[str, int] | None = None,
) -> Comparison:
    """Measure each server ``rounds`` times, alternating the order (ABBA).

    ``spread``: server name -> its number of processes, to spread the connections over.
    """
    comparison = Comparison(key, method, batch, connections, {name: [] for name in servers})
    names = list(servers)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            server = servers[name]
            processes = (spread or {}).get(name, 0)
            target = Target(server.host, server.port, "framed", method, batch, spread=processes)
            result = load.measure(target, connections, seconds)
            comparison.runs[name].append(result)
            rate = result.calls_per_s if method == "get_id" else result.ids_per_s
            print(
                f"  {key:<16} {name:<8} round {i + 1}: {rate:>12,.0f} "
                f"{'calls' if method == 'get_id' else 'ids'}/s  p99 {result.p99_ms:.3f} ms"
                + (f"  per process: {_split(result)}" if processes else "")
                + (f"  ERRORS: {'; '.join(result.errors)}" if result.errors else ""),
                flush=True,
            )
    return comparison


def _split(result: LoadResult) -> str:
    """How the connections fell on the server processes: "2+2"."""
    return "+".join(str(n) for _, n in result.by_worker) or "?"


def over_thrift(load: LoadGenerator, servers: dict[str, Server], plan: Plan) -> list[Comparison]:
    comparisons = []
    for n in plan.connections:
        comparisons.append(
            interleaved(load, servers, f"get_id x{n}", "get_id", 1, n, plan.seconds, plan.rounds)
        )
    for batch in plan.batch_sizes:
        comparisons.append(
            interleaved(
                load,
                servers,
                f"get_ids({batch})",
                "get_ids",
                batch,
                1,
                plan.batch_seconds,
                plan.rounds,
            )
        )
    if 4096 in plan.batch_sizes:  # one client waits out each ms between its calls; two overlap
        comparisons.append(full_batches_x2(load, servers, plan))
    return comparisons


def full_batches_x2(
    load: LoadGenerator,
    servers: dict[str, Server],
    plan: Plan,
    spread: dict[str, int] | None = None,
) -> Comparison:
    """``get_ids(4096)`` on two connections: the per-worker limit with calls overlapping."""
    return interleaved(
        load, servers, "get_ids(4096) x2", "get_ids", 4096, 2, plan.batch_seconds, plan.rounds,
        spread,
    )  # fmt: skip


def scaling(load: LoadGenerator, plan: Plan, work: Path) -> tuple[str, list[Comparison]]:
    """``--processes 1`` against ``--processes 2``; (note, comparisons)."""
    servers: dict[str, Server] = {}
    try:
        for n in (1, 2):
            name = f"{n}p"
            servers[name] = start_ours(
                f"ours-{name}", work / "logs", work / f"state-{name}", "--processes", str(n)
            )
        spread = {"1p": 0, "2p": 2}  # each process has its own worker id: told apart
        comparisons = [
            interleaved(
                load, servers, f"get_id x{c}", "get_id", 1, c, plan.seconds, plan.rounds, spread
            )
            for c in plan.scaling_connections
        ]
        comparisons.append(full_batches_x2(load, servers, plan, spread))
    except ServerFailed as e:
        return f"scaling: a server with --processes failed to start: {e}", []
    finally:
        for server in servers.values():
            server.stop()
    return "", comparisons


# -- targets and report --------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    target: str
    goal: str
    measured: str
    ratio: float | None
    passed: bool | None  # None: not measured

    @property
    def verdict(self) -> str:
        return "n/a" if self.passed is None else "PASS" if self.passed else "MISS"


def _find(comparisons: Sequence[Comparison], key: str) -> Comparison | None:
    return next((c for c in comparisons if c.key == key), None)


def checks(inproc: Sequence[InProcess], comparisons: Sequence[Comparison]) -> list[Check]:
    out = []
    by_name = {r.name: r for r in inproc}
    ours, peer = by_name.get("ours"), by_name.get("snowflake-id")
    if ours and peer and peer.best:
        ratio = ours.best / peer.best
        out.append(
            Check(
                "(a) next_id vs snowflake-id, 1 thread",
                f">= {TARGET_NEXT_ID:.2f} x",
                f"{ratio:.2f} x",
                ratio,
                ratio >= TARGET_NEXT_ID,
            )
        )
    else:
        out.append(Check("(a) next_id vs snowflake-id, 1 thread", ">= 1.00 x", "-", None, None))
    four = _find(comparisons, "get_id x4")
    if four:
        ratio = four.ratio(OURS, FLOOR)
        p99, p999 = four.latency_ms(OURS, 0.99), four.latency_ms(OURS, 0.999)
        out += [
            Check(
                "(b) get_id, 4 connections, vs floor",
                f">= {TARGET_GET_ID:.2f} x",
                f"{ratio:.2f} x",
                ratio,
                ratio >= TARGET_GET_ID,
            ),
            Check(
                "(b) get_id p99, 4 connections",
                f"<= {TARGET_P99_MS:g} ms",
                f"{p99:.3f} ms",
                p99 / TARGET_P99_MS,
                p99 <= TARGET_P99_MS,
            ),
            Check(
                "(b) get_id p999, 4 connections",
                f"<= {TARGET_P999_MS:g} ms",
                f"{p999:.3f} ms",
                p999 / TARGET_P999_MS,
                p999 <= TARGET_P999_MS,
            ),
        ]
    batch = _find(comparisons, "get_ids(4096)")
    if batch:
        share = batch.rate(OURS) / LIMIT
        out.append(
            Check(
                "(c) get_ids(4096) vs one worker's 4,096,000 ids/s",
                f">= {TARGET_GET_IDS:.0%}",
                f"{share:.1%}",
                share,
                share >= TARGET_GET_IDS,
            )
        )
    return out


def _ms(c: Comparison, name: str) -> str:
    return " / ".join(f"{c.latency_ms(name, q):.3f}" for q in (0.5, 0.99, 0.999))


def markdown(
    meta: dict[str, Any],
    inproc: Sequence[InProcess],
    comparisons: Sequence[Comparison],
    scaled: Sequence[Comparison],
    scaling_note: str,
    results: Sequence[Check],
) -> str:
    lines = [
        f"# snowflake benchmark, {meta['time']}",
        "",
        f"{meta['machine']}. {meta['mode']} run: {meta['settings']}. Load average "
        f"{meta['load_before']} before, {meta['load_after']} after: a shared machine, so "
        "compare the ratios, measured side by side, more than the absolute figures.",
        "",
        "## Targets",
        "",
        "| target | goal | measured | result |",
        "|---|---|--:|---|",
        *(f"| {c.target} | {c.goal} | {c.measured} | **{c.verdict}** |" for c in results),
    ]
    if inproc:
        by_name = {r.name: r.best for r in inproc}
        peer, lock = by_name.get("snowflake-id"), by_name.get("lock")
        lines += [
            "",
            "## (a) In-process ids/s, one thread",
            "",
            "| generator | ids/s (best round) | vs snowflake-id | vs bare lock |",
            "|---|--:|--:|--:|",
        ]
        for r in inproc:
            vs_peer = f"{r.best / peer:.2f} x" if peer else "-"
            vs_lock = f"{r.best / lock:.2f} x" if lock else "-"
            lines.append(f"| {r.label} | {r.best:,.0f} | {vs_peer} | {vs_lock} |")
    ids = [c for c in comparisons if c.method == "get_id"]
    if ids:
        lines += [
            "",
            "## (b) get_id over Thrift (framed, binary), one client process per connection",
            "",
            "| connections | ours calls/s | floor calls/s | ours / floor | per round "
            "| ours p50 / p99 / p999 ms | floor p50 / p99 / p999 ms |",
            "|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for c in ids:
            lines.append(
                f"| {c.connections} | {c.rate(OURS):,.0f} | {c.rate(FLOOR):,.0f} "
                f"| {c.ratio(OURS, FLOOR):.2f} x | {c.ratio_range(OURS, FLOOR)} "
                f"| {_ms(c, OURS)} | {_ms(c, FLOOR)} |"
            )
    batches = [c for c in comparisons if c.method == "get_ids"]
    if batches:
        lines += [
            "",
            f"## (c) get_ids ids/s next to one worker's limit ({LIMIT:,} ids/s)",
            "",
            "| ids per call | connections | ours ids/s | of the limit | ours calls/s "
            "| ours p50 / p99 ms | floor ids/s | ours / floor |",
            "|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for c in batches:
            best = c.best(OURS)
            lines.append(
                f"| {c.batch:,} | {c.connections} | {c.rate(OURS):,.0f} "
                f"| {c.rate(OURS) / LIMIT:.1%} "
                f"| {best.calls_per_s:,.0f} | {c.latency_ms(OURS, 0.5):.3f} / "
                f"{c.latency_ms(OURS, 0.99):.3f} | {c.rate(FLOOR):,.0f} "
                f"| {c.ratio(OURS, FLOOR):.2f} x |"
            )
    lines += ["", "## (d) Scaling: --processes 1 and 2 (SO_REUSEPORT)", ""]
    if scaled:
        lines += [
            "| measurement | 1 process | 2 processes | 2 / 1 | per round "
            "| connections per process | p99 ms, 1 / 2 |",
            "|---|--:|--:|--:|--:|--:|--:|",
        ]
        for c in scaled:
            unit = "calls/s" if c.method == "get_id" else "ids/s"
            lines.append(
                f"| {c.key.replace(' x', ', connections: ')} | {c.rate('1p'):,.0f} {unit} "
                f"| {c.rate('2p'):,.0f} {unit} | {c.ratio('2p', '1p'):.2f} x "
                f"| {c.ratio_range('2p', '1p')} "
                f"| {', '.join(sorted({_split(r) for r in c.runs['2p']}))} "
                f"| {c.latency_ms('1p', 0.99):.3f} / {c.latency_ms('2p', 0.99):.3f} |"
            )
    else:
        lines.append(scaling_note)
    lines += [
        "",
        "Throughput: the best of the interleaved rounds. Latency: percentiles over every "
        "call of every round, timed by the client (round trip on 127.0.0.1). The floor is "
        "thriftpy2's TThreadedServer with a handler that returns a constant.",
    ]
    errors = sorted({e for c in [*comparisons, *scaled] for e in c.errors()})
    if errors:
        lines += ["", "**Errors during the run:**", "", *(f"- {e}" for e in errors)]
    return "\n".join(lines) + "\n"


def chart(
    path: Path,
    inproc: Sequence[InProcess],
    comparisons: Sequence[Comparison],
    scaled: Sequence[Comparison],
    results: Sequence[Check],
    title: str,
) -> bool:
    """Draw the PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = {OURS: "#1f77b4", FLOOR: "#999999", "1p": "#1f77b4", "2p": "#2ca02c"}
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    fig.suptitle(title)

    ax = axes[0][0]
    ax.barh(
        [r.name for r in inproc],
        [r.best / 1e6 for r in inproc],
        color=["#1f77b4", "#ff7f0e", "#999999"][: len(inproc)],
    )
    for i, r in enumerate(inproc):
        ax.text(r.best / 1e6, i, f" {r.best / 1e6:.2f} M", va="center")
    ax.set_title("(a) in-process next_id, 1 thread")
    ax.set_xlabel("million ids/s")
    ax.invert_yaxis()
    ax.margins(x=0.25)

    ids = [c for c in comparisons if c.method == "get_id"]
    ax = axes[0][1]
    width = 0.38
    for j, name in enumerate((OURS, FLOOR)):
        xs = [i + (j - 0.5) * width for i in range(len(ids))]
        ax.bar(xs, [c.rate(name) / 1e3 for c in ids], width, label=name, color=colors[name])
    for i, c in enumerate(ids):
        ax.text(
            i,
            max(c.rate(OURS), c.rate(FLOOR)) / 1e3,
            f"{c.ratio(OURS, FLOOR):.2f} x",
            ha="center",
            va="bottom",
        )
    ax.set_xticks(range(len(ids)), [str(c.connections) for c in ids])
    ax.set_title("(b) get_id calls/s (ours / floor)")
    ax.set_xlabel("client connections (processes)")
    ax.set_ylabel("thousand calls/s")
    ax.margins(y=0.15)
    ax.legend()

    ax = axes[0][2]
    for name, style in ((OURS, "-"), (FLOOR, "--")):
        for q, marker in ((0.5, "o"), (0.99, "s"), (0.999, "^")):
            ax.plot(
                [c.connections for c in ids],
                [c.latency_ms(name, q) for c in ids],
                style,
                marker=marker,
                color=colors[name],
                label=f"{name} p{str(q * 100).rstrip('0').rstrip('.')}",
            )
    ax.axhline(TARGET_P99_MS, color="red", lw=0.8, ls=":")
    ax.axhline(TARGET_P999_MS, color="red", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks([c.connections for c in ids], [str(c.connections) for c in ids])
    ax.set_yscale("log")
    ax.set_title("(b) get_id latency (targets at 4 connections: dotted)")
    ax.set_xlabel("client connections")
    ax.set_ylabel("ms")
    ax.legend(fontsize="small", ncol=2)

    batches = [c for c in comparisons if c.method == "get_ids" and c.connections == 1]
    ax = axes[1][0]
    for name in (OURS, FLOOR):
        ax.plot(
            [c.batch for c in batches],
            [c.rate(name) / 1e6 for c in batches],
            "-o",
            color=colors[name],
            label=name,
        )
    two = _find(comparisons, "get_ids(4096) x2")
    if two:
        ax.plot([4096], [two.rate(OURS) / 1e6], "D", color=colors[OURS], label="ours, 2 conns")
    ax.axhline(LIMIT / 1e6, color="red", ls="--", lw=1, label="one worker's limit")
    ax.axhline(TARGET_GET_IDS * LIMIT / 1e6, color="red", ls=":", lw=0.8, label="85 % target")
    ax.set_xscale("log", base=2)
    ax.set_xticks([c.batch for c in batches], [f"{c.batch:,}" for c in batches])
    ax.set_yscale("log")
    ax.set_title("(c) get_ids ids/s, 1 connection")
    ax.set_xlabel("ids per call")
    ax.set_ylabel("million ids/s")
    ax.legend(fontsize="small")

    ax = axes[1][1]
    if scaled:
        for j, name in enumerate(("1p", "2p")):
            xs = [i + (j - 0.5) * width for i in range(len(scaled))]
            ax.bar(
                xs,
                [c.ratio(name, "1p") for c in scaled],
                width,
                label=f"--processes {name[0]}",
                color=colors[name],
            )
        for i, c in enumerate(scaled):
            unit = "calls/s" if c.method == "get_id" else "ids/s"
            ax.text(
                i,
                0.02,
                f"{c.rate('1p'):,.0f}\n{unit}",
                ha="center",
                va="bottom",
                fontsize="small",
                color="white",
            )
        ax.set_xticks(range(len(scaled)), [c.key for c in scaled])
        ax.set_ylabel("throughput / --processes 1")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "--processes not available", ha="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_title("(d) scaling with --processes")

    ax = axes[1][2]
    ax.axis("off")
    ax.set_title("targets")
    for i, check in enumerate(results):
        color = {"PASS": "green", "MISS": "red"}.get(check.verdict, "gray")
        ax.text(
            0.0,
            0.9 - i * 0.16,
            f"{check.verdict}",
            color=color,
            weight="bold",
            transform=ax.transAxes,
        )
        ax.text(
            0.14,
            0.9 - i * 0.16,
            f"{check.target}\n{check.measured} (goal {check.goal})",
            transform=ax.transAxes,
            fontsize="small",
            va="center",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (< 1 minute)")
    parser.add_argument("--seconds", type=float, help="per get_id measurement (full: 4)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per server (full: 2)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--no-scaling", action="store_true", help="skip --processes 1 vs 2")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.seconds:
        plan = replace(plan, seconds=args.seconds, batch_seconds=max(0.5, args.seconds / 2))
    if args.rounds:
        plan = replace(plan, rounds=max(1, args.rounds))
    started = time.monotonic()
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "time": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "mode": "quick" if args.quick else "full",
        "settings": f"{plan.seconds:g} s per get_id and {plan.batch_seconds:g} s per get_ids "
        f"measurement, {plan.rounds} interleaved round(s) per server; in-process best of "
        f"{plan.inproc_rounds} x {plan.inproc_seconds:g} s",
        "load_before": _load_avg(),
    }
    print(f"results: {out_dir}", flush=True)
    print("(a) in-process next_id ...", flush=True)
    inproc = in_process(plan)
    for r in inproc:
        print(f"  {r.label:<44} {r.best:>12,.0f} ids/s", flush=True)

    comparisons: list[Comparison] = []
    scaled: list[Comparison] = []
    scaling_note = "scaling: skipped (--no-scaling)"
    with tempfile.TemporaryDirectory(prefix="snowflake-bench-") as tmp:
        work = Path(tmp)
        servers: dict[str, Server] = {}
        try:
            with LoadGenerator(max(plan.connections)) as load:
                servers[OURS] = start_ours("ours", work / "logs", work / "state")
                servers[FLOOR] = start_floor("floor", work / "logs")
                print("(b, c) over Thrift, ours against the floor ...", flush=True)
                comparisons = over_thrift(load, servers, plan)
                for server in servers.values():
                    server.stop()
                if not args.no_scaling:
                    print("(d) scaling ...", flush=True)
                    scaling_note, scaled = scaling(load, plan, work)
                    if scaling_note:
                        print(scaling_note, flush=True)
        except (ServerFailed, BenchError) as e:
            print(f"benchmark failed: {e}", file=sys.stderr)
            return 1
        finally:
            for server in servers.values():
                server.stop()
            logs = work / "logs"
            if logs.exists():
                shutil.copytree(logs, out_dir / "logs", dirs_exist_ok=True)

    meta["load_after"] = _load_avg()
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    results = checks(inproc, comparisons)
    text = markdown(meta, inproc, comparisons, scaled, scaling_note, results)
    (out_dir / "results.md").write_text(text)
    report = {
        "meta": meta,
        "plan": asdict(plan),
        "targets": [vars(c) | {"verdict": c.verdict} for c in results],
        "in_process": [vars(r) | {"best": r.best} for r in inproc],
        "over_thrift": [c.to_json() for c in comparisons],
        "scaling": [c.to_json() for c in scaled],
        "scaling_note": scaling_note,
    }
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    drawn = chart(
        out_dir / "chart.png",
        inproc,
        comparisons,
        scaled,
        results,
        f"snowflake benchmark, {meta['time']} ({meta['mode']})",
    )
    if not args.quick:  # latest.md and latest.png (shown in the README): full runs only
        shutil.copyfile(out_dir / "results.md", args.out / "latest.md")
        if drawn:
            shutil.copyfile(out_dir / "chart.png", args.out / "latest.png")

    print()
    print(text)
    print("ratios:")
    for check in results:
        ratio = "" if check.ratio is None else f" (ratio {check.ratio:.3f})"
        print(f"  {check.verdict:<4} {check.target}: {check.measured}, goal {check.goal}{ratio}")
    for c in scaled:
        print(f"  scaling {c.key}: --processes 2 / 1 = {c.ratio('2p', '1p'):.2f} x")
    if scaling_note:
        print(f"  {scaling_note}")
    if not drawn:
        print("no chart: matplotlib is not installed (pip install -e '.[bench]')")
    if args.quick:
        print("(a --quick run leaves bench/results/latest.md and latest.png as they were)")
    print(
        f"\nwritten: {out_dir}/results.md, results.json"
        + (", chart.png" if drawn else "")
        + f" in {meta['elapsed_s']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
