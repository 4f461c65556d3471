"""Metrics: exact counts, bounded labels, valid exposition format."""

from __future__ import annotations

import shutil
import subprocess
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from snowflake_server import ClockMovedBackwardsError, GeneratorSettings, IdGenerator
from snowflake_server._native import native_core
from snowflake_server._observability.clock import (
    STA_UNSYNC,
    TIME_ERROR,
    read_kernel_clock,
    synchronized,
)
from snowflake_server._observability.metrics import (
    LATENCY_BUCKETS_S,
    NATIVE_HANDOFF_REASONS,
    OVERFLOW_AGENT,
    ServiceMetrics,
)
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


# -- the native listener's counters, summed at scrape -----------------------------------

core: Any = native_core()
needs_core = pytest.mark.skipif(core is None, reason="the native core is not built")


def exposed(metrics: ServiceMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``metrics``' exposition as prometheus_client's parser reads it: (sample, labels) ->
    value."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    text = generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


def registered(metrics: ServiceMetrics, agents: list[str]) -> Any:
    """A native registry holding ``agents`` as Python registers them: each under the
    index of the label it counts under."""
    registry = core.AgentRegistry()
    for agent in agents:
        registry.add(agent.encode(), metrics.agent_index(metrics.agent_label(agent)))
    return registry


def test_agent_label_indices_are_dense_stable_and_name_their_labels() -> None:
    _, metrics = make_metrics(max_agents=2)
    labels = [metrics.agent_label(a) for a in ["a", "b", "c", "d"]]
    indices = [metrics.agent_index(label) for label in [*labels, "b", OVERFLOW_AGENT, "a"]]
    assert indices == [0, 1, 2, 2, 1, 2, 0]
    assert [metrics.agent_label_of(i) for i in range(3)] == ["a", "b", OVERFLOW_AGENT]
    with pytest.raises(ValueError, match="not an agent label"):
        metrics.agent_index("c")  # an agent past the bound, not a label
    with pytest.raises(IndexError):
        metrics.agent_label_of(3)
    with pytest.raises(IndexError):
        metrics.agent_label_of(-1)


def test_the_native_series_are_there_from_the_start_at_zero() -> None:
    counts = exposed(make_metrics()[1])
    assert counts[sample("snowflake_native_threads")] == 0
    assert counts[sample("snowflake_native_calls_total")] == 0
    assert {
        dict(labels)["reason"]: value
        for (name, labels), value in counts.items()
        if name == "snowflake_native_handoffs_total"
    } == dict.fromkeys(NATIVE_HANDOFF_REASONS, 0)


@needs_core
def test_the_native_counters_mean_what_the_python_ones_mean() -> None:
    assert tuple(round(s * 1e9) for s in LATENCY_BUCKETS_S) == core.LATENCY_BUCKETS_NS
    assert core.HANDOFF_REASONS == NATIVE_HANDOFF_REASONS


@needs_core
def test_native_calls_are_summed_into_every_thrift_series_at_scrape() -> None:
    _, metrics = make_metrics(max_agents=2)
    # Python serves alpha and beta first: they get labels of their own, and gamma and delta
    # count as OVERFLOW_AGENT. Registered in another order, so that registry and label
    # indices differ (0, 1, 2, 3 -> 0, 0, 1, 2).
    python = metrics.open_connection()
    for _ in range(5):
        python.count_ids(metrics.agent_label("alpha"), 1)
        python.observe("get_id", 0.00003)
    metrics.agent_label("beta")
    gamma, delta, alpha, beta = range(4)
    registry = registered(metrics, ["gamma", "delta", "alpha", "beta"])
    stats = core.NativeStats(2)
    metrics.add_native(stats, registry)
    calls = [  # (thread, registry index, latency ns)
        *[(0, alpha, 30_000)] * 3,
        *[(0, gamma, 2_000_000)] * 2,
        (1, beta, 20_000),
        *[(1, delta, 2_000_000_000)] * 4,
    ]
    for thread, agent, ns in calls:
        stats.record_call(thread, agent, ns)
    stats.record_handoff(0, "agent")
    stats.record_handoff(1, "agent")
    stats.record_handoff(1, "slow")
    stats.record_internal_error(1)
    counts = exposed(metrics)
    by_agent = {
        dict(labels)["agent"]: value
        for (name, labels), value in counts.items()
        if name == "snowflake_ids_by_agent_total"
    }
    assert by_agent == {"alpha": 3 + 5, "beta": 1, OVERFLOW_AGENT: 2 + 4}
    assert (
        counts[sample("snowflake_requests_total", method="get_id", outcome="ok", protocol="thrift")]
        == 15
    )
    histogram = {
        dict(labels)["le"]: value
        for (name, labels), value in counts.items()
        if name == "snowflake_request_duration_seconds_bucket"
        and dict(labels)["protocol"] == "thrift"
        and dict(labels)["method"] == "get_id"
    }
    assert [histogram[le] for le in ["2.5e-05", "5e-05", "0.0025", "1.0", "+Inf"]] == [
        1,
        9,
        11,
        11,
        15,
    ]
    duration_sum = counts[
        sample("snowflake_request_duration_seconds_sum", method="get_id", protocol="thrift")
    ]
    assert duration_sum == pytest.approx(5 * 30e-6 + 3 * 30e-6 + 2 * 0.002 + 20e-6 + 4 * 2.0)
    exception = sample(
        "snowflake_exceptions_total", kind="internal_error", method="none", protocol="thrift"
    )
    assert counts[exception] == 1
    assert counts[sample("snowflake_native_calls_total")] == len(calls)
    assert counts[sample("snowflake_native_threads")] == 2
    handoffs = {
        dict(labels)["reason"]: value
        for (name, labels), value in counts.items()
        if name == "snowflake_native_handoffs_total"
    }
    assert handoffs == {**dict.fromkeys(NATIVE_HANDOFF_REASONS, 0), "agent": 2, "slow": 1}
    assert metrics.totals().agent_ids == {"alpha": 8, "beta": 1, OVERFLOW_AGENT: 6}


# Every bucket bound, a nanosecond either side, and anything up to past the last bound.
_bounds_ns = [round(s * 1e9) + d for s in LATENCY_BUCKETS_S for d in (-1, 0, 1)]
latencies = st.one_of(st.sampled_from(_bounds_ns), st.integers(0, 3_000_000_000))


@needs_core
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), latencies), max_size=40))
@settings(max_examples=60, deadline=None)
def test_native_calls_export_as_the_same_calls_served_by_python(
    calls: list[tuple[str, int]],
) -> None:
    _, native = make_metrics(max_agents=2)
    _, python = make_metrics(max_agents=2)
    stats = core.NativeStats(1)
    native.add_native(stats, registered(native, ["a", "b", "c"]))
    for agent in "abc":  # labels given in the same order
        python.agent_label(agent)
    connection = python.open_connection()
    for agent, ns in calls:
        stats.record_call(0, "abc".index(agent), ns)
        connection.count_ids(python.agent_label(agent), 1)
        connection.observe("get_id", ns / 1e9)
    native_counts, python_counts = exposed(native), exposed(python)
    differing = {
        key
        for key in native_counts.keys() | python_counts.keys()
        # Not in both: the native series, and the connection Python served on
        # (native connections are Python's too: counted by the serving core).
        if not key[0].startswith(("snowflake_native_", "snowflake_connections_"))
        and native_counts.get(key) != pytest.approx(python_counts.get(key))
    }
    assert differing == set()
    assert native_counts[sample("snowflake_native_calls_total")] == len(calls)


@needs_core
def test_no_native_call_is_lost_under_concurrent_scrapes() -> None:
    _, metrics = make_metrics()
    stats = core.NativeStats(2)
    metrics.add_native(stats, registered(metrics, ["a"]))
    done = threading.Event()

    def scraper() -> None:
        while not done.is_set():
            exposed(metrics)

    scraping = threading.Thread(target=scraper)
    scraping.start()
    # spin records without the GIL, as native threads do, while scrapes read.
    workers = [threading.Thread(target=stats.spin, args=(t, 200_000, 0, 40_000)) for t in (0, 1)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    done.set()
    scraping.join()
    counts = exposed(metrics)
    assert counts[sample("snowflake_ids_by_agent_total", agent="a")] == 400_000
    assert counts[sample("snowflake_native_calls_total")] == 400_000
