"""The Python clients against one server: AsyncSnowflakePool vs SnowflakePool.

One ``snowflake-server`` (``--processes 1``) on 127.0.0.1; in rounds, each client calls
it for a fixed time, from 1, 4 and 16 callers at once: threads sharing one
``SnowflakePool``, or tasks sharing one ``AsyncSnowflakePool`` on one asyncio event
loop (the default loop, not uvloop). Two calls: ``next_id()`` (one ``get_id`` per id)
and ``next_ids(100)`` (one ``get_ids`` per 100 ids). The two clients run back to back
for each configuration, in an order swapped from round to round.

Reported per configuration: ids/s (the median of the rounds), calls/s, the latency of a
call (p50 and p99 over every call of every round), and the CPU time per call of the
client process (all its threads) and of the server. Both share the machine's cores, so
a client that spends less CPU leaves more to the server. Every reply is checked (the
ids of each caller increase; a batch has 100); any error makes the run exit with 1.

Bounded: each measurement has a deadline, every call a 10 s timeout, and a watchdog
stops the server (so that the calls fail at once) should the whole run overstay. About
50 s; ``--quick`` about 15 s. Writes ``bench/results/<time>-clients/results.{md,json}``.

    .venv/bin/python bench/clients.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from snowflake_thrift_client import AsyncSnowflakePool, SnowflakePool

from bench.run_bench import AGENT, RESULTS
from bench.servers import Server, start_ours

Client = Literal["sync", "async"]
CLIENTS: tuple[Client, Client] = ("sync", "async")
CALLERS = (1, 4, 16)
BATCH = 100
CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Plan:
    rounds: int
    warmup_s: float
    seconds: float

    def budget_s(self) -> float:
        """How long the measurements take, all told."""
        runs = self.rounds * len(CLIENTS) * len(CALLERS) * 2
        return runs * (self.warmup_s + self.seconds)


FULL = Plan(rounds=3, warmup_s=0.25, seconds=1.0)
QUICK = Plan(rounds=1, warmup_s=0.15, seconds=0.8)


@dataclass(frozen=True)
class Config:
    batch: int  # 0: next_id()
    callers: int

    @property
    def call(self) -> str:
        return f"next_ids({self.batch})" if self.batch else "next_id()"


@dataclass
class Sample:
    """One client's measured period in one configuration."""

    calls: int = 0
    ids: int = 0
    seconds: float = 0.0
    client_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Caller:
    """One thread's or task's calls: timed in the measured period, checked always."""

    def __init__(self, config: Config, measure_from: float, deadline: float) -> None:
        self.batch = config.batch
        self.measure_from = measure_from
        self.deadline = deadline
        self.last = 0
        self.calls = 0
        self.ids = 0
        self.latencies: list[float] = []

    def record(self, started: float, got: int | list[int]) -> bool:
        """Count one call that began at ``started``; whether to go on calling."""
        ended = time.perf_counter()
        ids = got if isinstance(got, list) else [got]
        if len(ids) != (self.batch or 1) or ids[0] <= self.last or ids != sorted(set(ids)):
            raise AssertionError(f"bad reply after id {self.last}: {ids[:3]}... ({len(ids)})")
        self.last = ids[-1]
        if started >= self.measure_from:
            self.calls += 1
            self.ids += len(ids)
            self.latencies.append(ended - started)
        return ended < self.deadline


def _collect(sample: Sample, callers: Sequence[Caller]) -> None:
    for caller in callers:
        sample.calls += caller.calls
        sample.ids += caller.ids
        sample.latencies_s.extend(caller.latencies)


def _callers(config: Config, plan: Plan) -> list[Caller]:
    """The callers of one measurement, counting from the warm-up's end for ``plan.seconds``."""
    start = time.perf_counter()
    measured = start + plan.warmup_s
    return [Caller(config, measured, measured + plan.seconds) for _ in range(config.callers)]


def measure_sync(address: str, config: Config, plan: Plan) -> Sample:
    """Threads sharing one SnowflakePool."""
    sample = Sample()
    with SnowflakePool(
        address, agent=AGENT, pool_size=config.callers, timeout=CALL_TIMEOUT_S
    ) as pool:
        callers = _callers(config, plan)

        def work(caller: Caller) -> None:
            call: Callable[[], int | list[int]] = (
                (lambda: pool.next_ids(config.batch)) if config.batch else pool.next_id
            )
            try:
                while caller.record(time.perf_counter(), call()):
                    pass
            except Exception as e:  # noqa: BLE001 - reported, and the run fails
                sample.errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=(c,)) for c in callers]
        cpu = time.process_time()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    sample.client_cpu_s = time.process_time() - cpu
    sample.seconds = plan.seconds
    _collect(sample, callers)
    return sample


def measure_async(address: str, config: Config, plan: Plan) -> Sample:
    """Tasks sharing one AsyncSnowflakePool, on one event loop."""
    sample = Sample()

    async def run() -> list[Caller]:
        async with AsyncSnowflakePool(
            address, agent=AGENT, pool_size=config.callers, timeout=CALL_TIMEOUT_S
        ) as pool:
            callers = _callers(config, plan)

            async def work(caller: Caller) -> None:
                try:
                    while True:
                        started = time.perf_counter()
                        got: int | list[int] = await (
                            pool.next_ids(config.batch) if config.batch else pool.next_id()
                        )
                        if not caller.record(started, got):
                            return
                except Exception as e:  # noqa: BLE001 - reported, and the run fails
                    sample.errors.append(f"{type(e).__name__}: {e}")

            await asyncio.gather(*(work(c) for c in callers))
            return callers

    cpu = time.process_time()
    callers = asyncio.run(run())
    sample.client_cpu_s = time.process_time() - cpu
    sample.seconds = plan.seconds
    _collect(sample, callers)
    return sample


MEASURE = {"sync": measure_sync, "async": measure_async}


def measure(server: Server, client: Client, config: Config, plan: Plan) -> Sample:
    server_cpu = server.cpu_seconds()
    sample = MEASURE[client](f"{server.host}:{server.port}", config, plan)
    # The warm-up is in the CPU figures too, and in the calls they are divided by not:
    # scaled by the share of the time measured.
    share = plan.seconds / (plan.warmup_s + plan.seconds)
    sample.server_cpu_s = (server.cpu_seconds() - server_cpu) * share
    sample.client_cpu_s *= share
    return sample


@dataclass
class Row:
    config: Config
    client: Client
    samples: list[Sample]

    def ids_per_s(self) -> float:
        return statistics.median(s.ids / s.seconds for s in self.samples)

    def calls_per_s(self) -> float:
        return statistics.median(s.calls / s.seconds for s in self.samples)

    def latency_ms(self, q: float) -> float:
        every = sorted(t for s in self.samples for t in s.latencies_s)
        return every[min(len(every) - 1, int(q * len(every)))] * 1000 if every else float("nan")

    def cpu_us_per_call(self, which: Literal["client", "server"]) -> float:
        calls = sum(s.calls for s in self.samples)
        spent = sum(s.client_cpu_s if which == "client" else s.server_cpu_s for s in self.samples)
        return spent / calls * 1e6 if calls else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "call": self.config.call,
            "callers": self.config.callers,
            "client": self.client,
            "ids_per_s": round(self.ids_per_s()),
            "calls_per_s": round(self.calls_per_s()),
            "rounds_ids_per_s": [round(s.ids / s.seconds) for s in self.samples],
            "p50_ms": round(self.latency_ms(0.5), 3),
            "p99_ms": round(self.latency_ms(0.99), 3),
            "client_cpu_us_per_call": round(self.cpu_us_per_call("client"), 1),
            "server_cpu_us_per_call": round(self.cpu_us_per_call("server"), 1),
        }


def markdown(rows: dict[tuple[Config, Client], Row], configs: Sequence[Config]) -> str:
    lines = [
        "| call | callers | sync ids/s | async ids/s | async / sync | p50 / p99 ms, sync "
        "| p50 / p99 ms, async | client CPU µs/call, sync / async "
        "| server CPU µs/call, sync / async |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for config in configs:
        sync, aio = rows[config, "sync"], rows[config, "async"]
        lines.append(
            f"| `{config.call}` | {config.callers} | {sync.ids_per_s():,.0f} "
            f"| {aio.ids_per_s():,.0f} | {aio.ids_per_s() / sync.ids_per_s():.2f} x "
            f"| {sync.latency_ms(0.5):.2f} / {sync.latency_ms(0.99):.2f} "
            f"| {aio.latency_ms(0.5):.2f} / {aio.latency_ms(0.99):.2f} "
            f"| {sync.cpu_us_per_call('client'):.0f} / {aio.cpu_us_per_call('client'):.0f} "
            f"| {sync.cpu_us_per_call('server'):.0f} / {aio.cpu_us_per_call('server'):.0f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 0.8 s: about 15 s")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    # `make bench` hands every benchmark the same BENCH_ARGS: the others' are not ours.
    args, others = parser.parse_known_args(argv)
    if others:
        print(f"bench/clients.py: ignoring {' '.join(others)}", flush=True)
    plan = QUICK if args.quick else FULL
    configs = [Config(batch, callers) for batch in (0, BATCH) for callers in CALLERS]
    rows = {(c, client): Row(c, client, []) for c in configs for client in CLIENTS}
    errors: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-clients-") as work:
        server = start_ours("ours", Path(work) / "logs", Path(work) / "state", "--processes", "1")
        # Should a call hang past its timeouts, stopping the server ends every call at once.
        watchdog = threading.Timer(plan.budget_s() + 30, server.stop)
        watchdog.daemon = True
        watchdog.start()
        try:
            for round_ in range(plan.rounds):
                order = CLIENTS if round_ % 2 == 0 else CLIENTS[::-1]
                for config in configs:
                    for client in order:
                        sample = measure(server, client, config, plan)
                        errors += [f"{client} {config.call} x{config.callers}: {e}"
                                   for e in sample.errors]  # fmt: skip
                        rows[config, client].samples.append(sample)
                print(f"  round {round_ + 1} of {plan.rounds} done", flush=True)
        finally:
            watchdog.cancel()
            server.stop()
    elapsed = time.monotonic() - started
    table = markdown(rows, configs)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    meta = {
        "time": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "mode": "quick" if args.quick else "full",
        "plan": asdict(plan),
        "seconds": round(elapsed, 1),
        "errors": errors,
    }
    out = args.out / f"{stamp}-clients"
    out.mkdir(parents=True, exist_ok=True)
    title = f"# Python clients: AsyncSnowflakePool vs SnowflakePool ({meta['time']})"
    settings = (
        f"{meta['machine']}; {plan.rounds} round(s) of {plan.warmup_s:g} s warm-up + "
        f"{plan.seconds:g} s measured per client and configuration; one server, "
        f"`--processes 1`, on 127.0.0.1; {elapsed:.0f} s in all."
    )
    (out / "results.md").write_text(f"{title}\n\n{settings}\n\n{table}\n")
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "rows": [row.to_json() for row in rows.values()]}, indent=1)
    )
    print(table)
    print(settings)
    print(f"written: {out / 'results.md'}")
    if errors:
        print("errors:\n  " + "\n  ".join(errors[:20]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
