"""Metrics: exact counts, bounded labels, valid exposition format."""

from __future__ import annotations

import shutil
import subprocess
import threading

import pytest
from prometheus_client.exposition import generate_latest

from snowflake_server import ClockMovedBackwardsError, GeneratorSettings, IdGenerator
from snowflake_server._observability.clock import (
    STA_UNSYNC,
    TIME_ERROR,
    read_kernel_clock,
    synchronized,
)
from snowflake_server._observability.metrics import OVERFLOW_AGENT, ServiceMetrics
from snowflake_server._thrift.processor import service_methods
from tests.support.fakes import FakeClock
from tests.support.inprocess import InProcessServer
from tests.support.processes import failures, parse_metrics


def make_metrics(max_agents: int = 100) -> tuple[IdGenerator, ServiceMetrics]:
    generator = IdGenerator(GeneratorSettings(datacenter_id=2, worker_id=5))
    return generator, ServiceMetrics(generator, service_methods(), max_agents=max_agents)


def scrape(metrics: ServiceMetrics) -> dict[str, float]:
    # A fresh registry per test: nothing leaks between tests or into the global one.
    return parse_metrics(generate_latest(metrics.registry()).decode())


def test_agent_labels_are_bounded() -> None:
    _, metrics = make_metrics(max_agents=2)
    assert [metrics.agent_label(a) for a in ["a", "b", "c", "a", "d"]] == [
        "a",
        "b",
        OVERFLOW_AGENT,
        "a",
        OVERFLOW_AGENT,
    ]


def test_the_info_metric_says_where_the_worker_id_came_from() -> None:
    generator = IdGenerator(GeneratorSettings(datacenter_id=2, worker_id=22))
    metrics = ServiceMetrics(generator, service_methods(), worker_id_source="mac")
    assert (
        scrape(metrics)['snowflake_info{datacenter_id="2",worker_id="22",worker_id_source="mac"}']
        == 1
    )
    assert (
        scrape(make_metrics()[1])[
            'snowflake_info{datacenter_id="2",worker_id="5",worker_id_source="number"}'
        ]
        == 1
    )


def test_counts_from_open_and_closed_connections_add_up() -> None:
    _, metrics = make_metrics()
    first, second = metrics.open_connection(), metrics.open_connection()
    first.count_ids("a", 3)
    second.count_ids("a", 4)
    second.count_exception("invalid_count")
    first.observe("get_id", 0.00003)
    second.observe("get_id", 2.0)
    metrics.close_connection(first)
    counts = scrape(metrics)
    assert counts['snowflake_ids_by_agent_total{agent="a"}'] == 7
    assert failures(counts, "invalid_count") == 1
    assert (
        counts[
            'snowflake_request_duration_seconds_bucket{le="2.5e-05",method="get_id",protocol="thrift"}'
        ]
        == 0
    )
    assert (
        counts[
            'snowflake_request_duration_seconds_bucket{le="5e-05",method="get_id",protocol="thrift"}'
        ]
        == 1
    )
    assert (
        counts[
            'snowflake_request_duration_seconds_bucket{le="1.0",method="get_id",protocol="thrift"}'
        ]
        == 1
    )
    assert (
        counts[
            'snowflake_request_duration_seconds_bucket{le="+Inf",method="get_id",protocol="thrift"}'
        ]
        == 2
    )
    assert (
        counts['snowflake_request_duration_seconds_count{method="get_id",protocol="thrift"}'] == 2
    )
    assert counts['snowflake_connections_open{protocol="thrift"}'] == 1
    assert counts["snowflake_connections_accepted_total"] == 2
    assert (counts["snowflake_worker_id"], counts["snowflake_datacenter_id"]) == (5, 2)


def test_no_increment_is_lost_under_concurrent_scrapes() -> None:
    generator, metrics = make_metrics()
    done = threading.Event()

    def work() -> None:
        stats = metrics.open_connection()
        for _ in range(20_000):
            generator.next_id()
            stats.count_ids("a", 1)
            stats.observe("get_id", 0.0001)
        metrics.close_connection(stats)

    def scraper() -> None:
        while not done.is_set():
            scrape(metrics)

    scraping = threading.Thread(target=scraper)
    scraping.start()
    workers = [threading.Thread(target=work) for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    done.set()
    scraping.join()
    counts = scrape(metrics)
    assert counts["snowflake_ids_generated_total"] == 80_000
    assert counts['snowflake_ids_by_agent_total{agent="a"}'] == 80_000
    assert (
        counts['snowflake_request_duration_seconds_count{method="get_id",protocol="thrift"}']
        == 80_000
    )


def test_promtool_accepts_the_exposition(server: InProcessServer) -> None:
    server.raw_client().get_id("lint")
    promtool = shutil.which("promtool")
    assert promtool, "promtool (from Debian's prometheus package) is unpacked by `make test`"
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=server.metrics(), capture_output=True, text=True
    )
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr


def test_health_and_unknown_paths(server: InProcessServer) -> None:
    status, body = server.http_get("/health")
    assert status == 200 and '"status": "ok"' in body and '"worker_id": 0' in body
    assert server.http_get("/nope")[0] == 404


@pytest.mark.parametrize(
    ("reading", "gauge"),
    [
        ((0, 0x2001), 1.0),  # TIME_OK, STA_PLL | STA_NANO: an NTP daemon keeps it in sync
        ((1, 0x0011), 1.0),  # TIME_INS: a leap second announced, still in sync
        ((TIME_ERROR, STA_UNSYNC), 0.0),  # no daemon has ever synchronised it
        ((TIME_ERROR, 0), 0.0),  # the state alone says so
        ((0, STA_UNSYNC), 0.0),  # the status alone says so
        (None, None),  # adjtimex unavailable: absent, not guessed
    ],
)
def test_the_clock_synchronized_gauge_follows_the_kernel(
    reading: tuple[int, int] | None, gauge: float | None
) -> None:
    generator = IdGenerator(GeneratorSettings())
    reads: list[None] = []

    def kernel() -> tuple[int, int] | None:
        reads.append(None)
        return reading

    metrics = ServiceMetrics(generator, service_methods(), kernel_clock=kernel)
    assert reads == []  # read at scrape time only
    assert scrape(metrics).get("snowflake_clock_synchronized") == gauge
    assert len(reads) == 1


def test_the_kernel_clock_is_read_for_real() -> None:
    # One real adjtimex: the ctypes binding (struct timex's layout) works on this host.
    reading = read_kernel_clock()
    assert reading is not None, "adjtimex(2) is available on Linux"
    state, status = reading
    assert 0 <= state <= TIME_ERROR and status >= 0
    assert synchronized(reading) is (state != TIME_ERROR and not status & STA_UNSYNC)
    generator = IdGenerator(GeneratorSettings())
    synced = scrape(ServiceMetrics(generator, service_methods()))["snowflake_clock_synchronized"]
    assert synced == float(bool(synchronized(read_kernel_clock())))


def test_the_largest_backward_step_is_exported_in_seconds() -> None:
    clock = FakeClock(1_700_000_000_000)
    generator = IdGenerator(GeneratorSettings(), clock=clock, sleep=clock.sleep)
    metrics = ServiceMetrics(generator, service_methods(), kernel_clock=lambda: None)
    generator.next_id()
    assert scrape(metrics)["snowflake_clock_max_backward_step_seconds"] == 0
    clock.now -= 1500
    with pytest.raises(ClockMovedBackwardsError):
        generator.next_id()
    assert scrape(metrics)["snowflake_clock_max_backward_step_seconds"] == 1.5
