"""Prometheus metrics of a server, counted cheaply and read at scrape time.

The hot path does not call prometheus-client: each connection thread counts
into its own :class:`ConnectionStats` (plain integers written by that thread
only, so no increment is ever lost and no lock is taken per call), the
generator counts under its own lock, and :class:`ServiceMetrics` adds them all
up when Prometheus scrapes. Every metric is listed in ``docs/metrics.md`` (a test
checks that the two agree).
"""

from __future__ import annotations

import bisect
import platform
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from .._ids.generator import IdSource
from .._version import __version__
from .clock import KernelClockReader, read_kernel_clock, synchronized
from .logs import LOG_LIMIT

if TYPE_CHECKING:
    from .._native._core import AgentRegistry, NativeStats

__all__ = [
    "CALL_FAILURES",
    "EXCEPTION_KINDS",
    "HTTP_METHODS",
    "LATENCY_BUCKETS_S",
    "NATIVE_HANDOFF_REASONS",
    "NO_METHOD",
    "OK",
    "OVERFLOW_AGENT",
    "PROTOCOLS",
    "ConnectionStats",
    "ServiceMetrics",
    "counter_by",
]

# Calls take tens of microseconds: prometheus-client's default buckets start at 5 ms.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0,
)  # fmt: skip

EXCEPTION_KINDS: tuple[str, ...] = (
    "invalid_system_clock",
    "invalid_user_agent",
    "invalid_count",
    "unavailable",
    "unknown_method",
    "protocol_error",
    "frame_too_large",
    "tls_error",
    "request_timeout",
    "internal_error",
)

CALL_FAILURES: tuple[str, ...] = (
    "invalid_system_clock",
    "invalid_user_agent",
    "invalid_count",
    "unavailable",
    "internal_error",
)
"""The kinds a call of a served method can fail with: its ``outcome`` unless ``ok``."""

OK = "ok"
NO_METHOD = "none"
"""The ``method`` label of failures that belong to no served method's call."""

HTTP_METHODS: tuple[str, ...] = ("get_id", "get_ids", "get_layout", "decode")
"""The ``method`` labels of the HTTP API's calls (tests check them against its routes)."""

PROTOCOLS: tuple[str, ...] = ("thrift", "http")

OVERFLOW_AGENT = "__overflow__"
"""The ``agent`` label of ids for agents past the bound; no valid agent starts with '_'."""

NATIVE_HANDOFF_REASONS: tuple[str, ...] = (
    "length", "request", "agent", "slow", "contended", "gate",
)  # fmt: skip
"""Why the native listener hands a frame to Python (``_core.HANDOFF_REASONS``; a test checks
they agree): each gets a ``snowflake_native_handoffs`` series from the start, native core or not."""


class _Latency:
    """A histogram's raw counts: one slot per bucket plus +Inf, and the sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.total = 0.0

    def add(self, other: _Latency) -> None:
        for i, n in enumerate(other.counts):
            self.counts[i] += n
        self.total += other.total


class ConnectionStats:
    """What one connection did. Written by its own thread only; read by scrapes.

    ``protocol`` ("thrift" or "http") is the connection's: the per-call metrics are
    labelled with it at scrape time, so no call pays for the label."""

    __slots__ = ("agent_ids", "exceptions", "latency", "protocol")

    def __init__(self, protocol: str = "thrift") -> None:
        self.protocol = protocol
        self.agent_ids: dict[str, int] = {}
        self.exceptions: dict[tuple[str, str], int] = {}  # (kind, method) -> calls
        self.latency: dict[str, _Latency] = {}

    def count_ids(self, agent_label: str, n: int) -> None:
        ids = self.agent_ids
        ids[agent_label] = ids.get(agent_label, 0) + n

    def count_exception(self, kind: str, method: str = NO_METHOD) -> None:
        """A failure of ``kind``; ``method`` is the call's, or ``NO_METHOD`` for a
        failure of the connection (bad bytes, TLS) or of a method not served."""
        key = (kind, method)
        self.exceptions[key] = self.exceptions.get(key, 0) + 1

    def observe(self, method: str, seconds: float) -> None:
        """A call of ``method`` answered in ``seconds`` (failed or not: its failure, if
        any, is counted by :meth:`count_exception` with the method)."""
        hist = self.latency.get(method)
        if hist is None:
            hist = self.latency[method] = _Latency()
        hist.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        hist.total += seconds

    def add(self, other: ConnectionStats) -> None:
        # dict(...) copies atomically under the GIL while the owner may insert keys.
        for agent, n in dict(other.agent_ids).items():
            self.agent_ids[agent] = self.agent_ids.get(agent, 0) + n
        for key, n in dict(other.exceptions).items():
            self.exceptions[key] = self.exceptions.get(key, 0) + n
        for method, hist in dict(other.latency).items():
            self.latency.setdefault(method, _Latency()).add(hist)


def _summed(parts: Iterable[ConnectionStats]) -> ConnectionStats:
    """The counts of ``parts`` added together."""
    total = ConnectionStats()
    for part in parts:
        total.add(part)
    return total


class ServiceMetrics(Collector):
    """The metrics of one server process, as a prometheus-client collector.

    ``methods`` are the Thrift methods whose latency is reported (each gets a
    histogram from the start, so dashboards see zeros rather than gaps; the HTTP
    API's, ``HTTP_METHODS``, too once an HTTP port is set up with :meth:`set_limit`).
    The per-call metrics carry the ``protocol`` of the connection that served them.
    At most ``max_agents`` distinct user agents get a label of their own; ids
    for any further agent are counted under ``OVERFLOW_AGENT``. ``worker_id_source``
    (number, auto, ordinal, ip, mac) labels ``snowflake_info``. ``kernel_clock``
    reads the kernel's clock state at each scrape (tests inject one).
    """

    def __init__(
        self,
        generator: IdSource,
        methods: Sequence[str],
        *,
        max_agents: int = 100,
        worker_id_source: str = "number",
        kernel_clock: KernelClockReader = read_kernel_clock,
    ) -> None:
        self._kernel_clock = kernel_clock
        self._generator = generator
        self._methods = tuple(methods)
        self._max_agents = max_agents
        self._worker_id_source = worker_id_source
        self._agents: set[str] = set()
        # Label indices for the native agent registry: dense, in order of first use, never
        # forgotten (bounded by max_agents + 1: only labels agent_label gives get one).
        self._labels: list[str] = []
        self._label_index: dict[str, int] = {}
        self._native: list[tuple[NativeStats, AgentRegistry]] = []
        self._lock = threading.Lock()
        self._live: set[ConnectionStats] = set()
        # The counts of closed connections, by protocol.
        self._closed: dict[str, ConnectionStats] = {}
        self.connections_accepted = 0
        # By protocol ("thrift", "http"): written by the serving loop only.
        self._open: dict[str, int] = {}
        self._limits: dict[str, int] = {}
        self._rejected: dict[str, int] = {}
        self.turn_waits: Callable[[], int] = lambda: 0

    def registry(self, *others: Collector) -> CollectorRegistry:
        """A fresh registry holding this collector, ``others``, the log limiter's count
        and prometheus_client's process, platform and GC collectors (never the global
        registry)."""
        registry = CollectorRegistry(auto_describe=False)
        for collector in (self, *others, LOG_LIMIT):
            registry.register(collector)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        return registry

    def agent_label(self, agent: str) -> str:
        """The label value under which ids for ``agent`` are counted."""
        if agent in self._agents:
            return agent
        with self._lock:
            if len(self._agents) < self._max_agents:
                self._agents.add(agent)
                return agent
        return OVERFLOW_AGENT

    def agent_index(self, label: str) -> int:
        """The label index of ``label`` (one :meth:`agent_label` gave, or ``OVERFLOW_AGENT``)
        for the native agent registry: the same index for the same label for the life of
        this object, dense from 0. Raises ValueError for any other string."""
        index = self._label_index.get(label)
        if index is not None:
            return index
        if label != OVERFLOW_AGENT and label not in self._agents:
            raise ValueError(f"{label!r} is not an agent label (agent_label gives them)")
        with self._lock:
            index = self._label_index.get(label)
            if index is None:
                index = len(self._labels)
                # Listed before it is published: whoever sees the index can name it.
                self._labels.append(label)
                self._label_index[label] = index
        return index

    def agent_label_of(self, index: int) -> str:
        """The label :meth:`agent_index` gave ``index``; IndexError if none."""
        if index < 0:
            raise IndexError(f"no agent label has index {index}")
        return self._labels[index]

    def add_native(self, stats: NativeStats, registry: AgentRegistry) -> None:
        """Count a native listener's calls from now on: at each scrape ``stats`` is summed
        into the thrift totals as one more connection's counts (its ids by the label each
        agent was registered under in ``registry``, see :meth:`agent_index`), and it feeds
        the ``snowflake_native_*`` series. Nothing is added to any call's cost."""
        with self._lock:
            self._native.append((stats, registry))

    def set_limit(self, protocol: str, limit: int) -> None:
        """The most connections ``protocol``'s port serves at once (reported beside the
        connections open, so that an alert sees a port filling up)."""
        self._limits[protocol] = limit
        self._open.setdefault(protocol, 0)
        self._rejected.setdefault(protocol, 0)

    def open_connection(self, protocol: str = "thrift") -> ConnectionStats:
        stats = ConnectionStats(protocol)
        with self._lock:
            self._live.add(stats)
            self.connections_accepted += 1
            self._open[protocol] = self._open.get(protocol, 0) + 1
        return stats

    def close_connection(self, stats: ConnectionStats, protocol: str = "thrift") -> None:
        with self._lock:
            self._live.discard(stats)
            self._closed.setdefault(stats.protocol, ConnectionStats(stats.protocol)).add(stats)
            self._open[protocol] -= 1

    def count_rejected(self, protocol: str) -> None:
        """A connection to ``protocol``'s port closed at once: its slots were all in use."""
        self._rejected[protocol] = self._rejected.get(protocol, 0) + 1

    def rejected(self, protocol: str) -> int:
        return self._rejected.get(protocol, 0)

    def totals(self) -> ConnectionStats:
        """Everything counted so far by every connection, open or closed."""
        return _summed(self.totals_by_protocol().values())

    def totals_by_protocol(self) -> dict[str, ConnectionStats]:
        """Everything counted so far by every connection, open or closed, by protocol
        (native calls in thrift's)."""
        return self._totals(self._native_snapshots())

    def _native_snapshots(self) -> list[tuple[dict[str, Any], int]]:
        """Each native listener's counters summed over its threads, and how many threads."""
        with self._lock:
            native = list(self._native)
        return [(stats.snapshot(registry), stats.threads) for stats, registry in native]

    def _totals(self, native: Iterable[tuple[dict[str, Any], int]]) -> dict[str, ConnectionStats]:
        totals: dict[str, ConnectionStats] = {}
        with self._lock:
            for stats in (*self._closed.values(), *self._live):
                totals.setdefault(stats.protocol, ConnectionStats(stats.protocol)).add(stats)
        for snapshot, _ in native:
            totals.setdefault("thrift", ConnectionStats("thrift")).add(self._as_stats(snapshot))
        return totals

    def _as_stats(self, snapshot: dict[str, Any]) -> ConnectionStats:
        """A native snapshot as the counts of a thrift connection that served its calls:
        get_id calls with their latency, ids by agent label, internal errors."""
        stats = ConnectionStats("thrift")
        labels = self._labels
        for label_index, n in snapshot["ids"].items():
            # Keys are label indices; a negative one is an agent the registry does not
            # know, which native never serves: counted rather than lost all the same.
            known = 0 <= label_index < len(labels)
            stats.count_ids(labels[label_index] if known else OVERFLOW_AGENT, n)
        calls = _Latency()
        calls.counts = list(snapshot["latency_counts"])
        calls.total = snapshot["latency_sum_ns"] / 1e9
        if sum(calls.counts):
            stats.latency["get_id"] = calls
        if snapshot["internal_errors"]:
            stats.exceptions[("internal_error", NO_METHOD)] = snapshot["internal_errors"]
        return stats

    def _methods_of(self, protocol: str) -> tuple[str, ...]:
        """The methods ``protocol`` serves, each reported from the start."""
        return self._methods if protocol == "thrift" else HTTP_METHODS

    def collect(self) -> Iterable[Metric]:
        gen = self._generator
        counts = gen.counters()
        native = self._native_snapshots()
        by_protocol = self._totals(native)
        # The ports served get every series from the start: thrift always, http with
        # --http-port (its limit set); a protocol that counted anything is there too.
        for protocol in ("thrift", *self._limits):
            by_protocol.setdefault(protocol, ConnectionStats(protocol))
        total = _summed(by_protocol.values())
        yield _counter("ids_generated", "Ids handed out.", counts.ids_generated)
        yield counter_by(
            "snowflake_ids_by_agent",
            f"Ids handed out, by user agent (the first {self._max_agents} agents seen; "
            f"later ones as {OVERFLOW_AGENT}).",
            "agent",
            dict(sorted(total.agent_ids.items())),
        )
        yield from self._calls(by_protocol)
        yield counter_by(
            "snowflake_clock_backwards",
            "Times the clock was found behind the newest id: waited out, or refused "
            "with InvalidSystemClock.",
            "action",
            {"waited": counts.clock_backwards_waited, "refused": counts.clock_backwards_refused},
        )
        yield _counter(
            "clock_sequence_switches",
            "Times the clock was behind every id of the clock-sequence value in use (beyond "
            "--max-backwards-ms, or at start-up) and the server moved to another value "
            "instead of refusing or waiting (--clock-sequence-bits).",
            counts.clock_sequence_switches,
        )
        yield from self._clock_health(counts.max_backward_step_ms)
        yield _counter(
            "sequence_exhausted_waits",
            "Times all sequence numbers of a ms were used and generation waited for the next ms.",
            counts.sequence_exhausted_waits,
        )
        yield _counter(
            "reservation_stalls",
            "Times a call found no high-water mark covering its ms and asked the renewal "
            "to write one at once (it waits at most 100 ms, then fails over).",
            counts.reservation_stalls,
        )
        yield _counter(
            "connections_accepted", "Client connections accepted.", self.connections_accepted
        )
        yield counter_by(
            "snowflake_connections_rejected",
            "Client connections closed at once because their port's slots were all in use "
            "(--max-connections for thrift, --http-max-connections for http), by protocol.",
            "protocol",
            dict(self._rejected),
        )
        yield _gauge_by(
            "snowflake_connections_open", "Client connections open now, by protocol.",
            dict(self._open),
        )  # fmt: skip
        yield _gauge_by(
            "snowflake_connections_limit",
            "The most client connections a port serves at once, by protocol (a few more are "
            "kept on the thrift port for the peer checks of joining nodes).",
            dict(self._limits),
        )
        yield from _native_series(native)
        yield _counter(
            "turn_waits",
            "Times a connection had spent its share of the event loop and waited for its "
            "next turn (fairness by work: a flood, or costly requests).",
            self.turn_waits(),
        )
        ids = gen.settings
        yield _gauge("worker_id", "This server's worker id.", ids.worker_id)
        yield _gauge("datacenter_id", "This server's datacenter id.", ids.datacenter_id)
        info = GaugeMetricFamily(
            "snowflake_info",
            "1, labelled with the node's ids and where its worker id came from (--worker-id: "
            "number, auto, ordinal, ip or mac): two series with one pair across a fleet "
            "are two nodes that can hand out the same ids.",
            labels=["datacenter_id", "worker_id", "worker_id_source"],
        )
        info.add_metric([str(ids.datacenter_id), str(ids.worker_id), self._worker_id_source], 1)
        yield info
        build = GaugeMetricFamily(
            "snowflake_build_info",
            "1, labelled with the server's version and the Python running it.",
            labels=["version", "python"],
        )
        build.add_metric([__version__, platform.python_version()], 1)
        yield build

    def _clock_health(self, max_backward_step_ms: int) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "snowflake_clock_max_backward_step_seconds",
            "The largest step back of the wall clock seen, measured from the newest id's "
            "time (0: none since the start).",
            value=max_backward_step_ms / 1000,
        )
        synced = synchronized(self._kernel_clock())
        if synced is not None:
            yield GaugeMetricFamily(
                "snowflake_clock_synchronized",
                "1 while the kernel calls the wall clock synchronised (adjtimex: not "
                "TIME_ERROR, STA_UNSYNC clear), 0 while not; absent where the kernel "
                "cannot be asked.",
                value=int(synced),
            )

    def _calls(self, by_protocol: Mapping[str, ConnectionStats]) -> Iterable[Metric]:
        # Every series that can move is there from the start (zeros, not gaps): each
        # method of each protocol served with each outcome, and the connection's own
        # failures under NO_METHOD.
        requests = CounterMetricFamily(
            "snowflake_requests",
            "Calls served, by protocol (thrift, http), method and outcome: ok, or the kind "
            "of failure.",
            labels=["method", "outcome", "protocol"],
        )
        exceptions = CounterMetricFamily(
            "snowflake_exceptions",
            f"Failures, by protocol, kind and method ({NO_METHOD}: the connection's, or a "
            "method not served).",
            labels=["kind", "method", "protocol"],
        )
        latency = HistogramMetricFamily(
            "snowflake_request_duration_seconds",
            "Time to serve a call, from its request read to its reply ready to send, by "
            "protocol and method.",
            labels=["method", "protocol"],
        )
        for protocol, total in sorted(by_protocol.items()):
            served = self._methods_of(protocol)
            # Derived, not counted per call: every call answered is in its method's
            # latency histogram, and every failed one in the failures by kind and method.
            for method in sorted({*served, *total.latency}):
                hist = total.latency.get(method) or _Latency()
                latency.add_metric([method, protocol], _cumulative(hist.counts), hist.total)
                failed = {k: total.exceptions.get((k, method), 0) for k in CALL_FAILURES}
                requests.add_metric([method, OK, protocol], sum(hist.counts) - sum(failed.values()))
                for kind, n in failed.items():
                    requests.add_metric([method, kind, protocol], n)
            failures = dict.fromkeys(((k, m) for k in CALL_FAILURES for m in served), 0)
            failures.update(((k, NO_METHOD), 0) for k in EXCEPTION_KINDS if k not in CALL_FAILURES)
            failures.update(total.exceptions)
            for (kind, method), n in sorted(failures.items()):
                exceptions.add_metric([kind, method, protocol], n)
        yield requests
        yield exceptions
        yield latency


def _native_series(native: Sequence[tuple[dict[str, Any], int]]) -> Iterable[Metric]:
    handoffs = dict.fromkeys(NATIVE_HANDOFF_REASONS, 0)
    for snapshot, _ in native:
        for reason, n in snapshot["handoffs"].items():
            handoffs[reason] = handoffs.get(reason, 0) + n
    yield _counter(
        "native_calls",
        "get_id calls answered by the native listener's threads (also counted in every "
        "thrift series: requests, latency, ids by agent).",
        sum(snapshot["calls"] for snapshot, _ in native),
    )
    yield counter_by(
        "snowflake_native_handoffs",
        "Frames the native listener handed to Python, by reason: length or request (not a "
        "get_id it serves), agent (not registered natively yet: Python serves an agent "
        "first), slow (a case only Python's generator resolves), contended (the generator "
        "stayed busy), gate (the session gate closed or expired).",
        "reason",
        handoffs,
    )
    yield _gauge(
        "native_threads",
        "Threads of the native listener serving get_id (0: served by Python alone).",
        sum(threads for _, threads in native),
    )


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip([*map(str, LATENCY_BUCKETS_S), "+Inf"], counts, strict=True):
        running += n
        out.append((bound, running))
    return out


def counter_by(name: str, doc: str, label: str, counts: Mapping[str, float]) -> Metric:
    """The counter ``name`` with a sample per value of ``label``, in ``counts``' order."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, count in counts.items():
        family.add_metric([value], count)
    return family


def _gauge_by(name: str, doc: str, values: Mapping[str, float]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["protocol"])
    for protocol, value in sorted(values.items()):
        family.add_metric([protocol], value)
    return family


def _counter(name: str, doc: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(f"snowflake_{name}", doc, value=value)


def _gauge(name: str, doc: str, value: int) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"snowflake_{name}", doc, value=value)
