"""What /readyz and /livez are built from: the node's phase and checks, the loop's lag
and whether it turns (with a fake clock: each tick of the serving loop is told by hand)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from snowflake_server import ServerSettings
from snowflake_server._observability.lifecycle import Lifecycle, Phase
from snowflake_server._observability.probes import LoopWatch, Readiness
from tests.support.fakes import SecondsClock
from tests.support.inprocess import InProcessServer
from tests.support.waiting import wait_until


def ready_gauge(readiness: Readiness) -> float | None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(readiness)
    return registry.get_sample_value("snowflake_ready")


def test_only_a_serving_node_whose_checks_pass_is_ready() -> None:
    failing: list[str] = []
    lifecycle = Lifecycle()
    readiness = Readiness(lifecycle)
    readiness.add_check(lambda: None)
    readiness.add_check(lambda: failing[0] if failing else None)
    assert readiness.reason() == "starting: the node does not serve yet"
    assert ready_gauge(readiness) == 0
    lifecycle.serving()
    assert readiness.reason() is None and ready_gauge(readiness) == 1
    failing.append("the disk is full")
    assert readiness.reason() == "the disk is full" and ready_gauge(readiness) == 0
    failing.clear()
    lifecycle.draining()
    assert (
        readiness.reason() == "draining: the node is stopping; clients should move to other nodes"
    )
    lifecycle.stopped()
    assert readiness.reason() == "stopped" and readiness.phase is Phase.STOPPED


def test_the_phase_never_goes_back() -> None:
    lifecycle = Lifecycle()
    readiness = Readiness(lifecycle)
    lifecycle.draining()  # a SIGTERM during start-up
    lifecycle.serving()  # start-up finishing after it must not make the node ready
    assert readiness.phase is Phase.DRAINING and readiness.reason() is not None


def test_a_check_is_not_asked_before_the_node_serves() -> None:
    asked: list[int] = []

    def check() -> str | None:
        asked.append(1)
        return None

    lifecycle = Lifecycle()
    readiness = Readiness(lifecycle)
    readiness.add_check(check)
    readiness.reason()
    assert asked == []
    lifecycle.serving()
    assert readiness.reason() is None and asked == [1]


# -- the serving loop: lag (readiness) and turning (liveness) ----------------------------

INTERVAL_S = 0.1
WINDOW_S = 5.0


def watch_with(clock: SecondsClock, max_lag_s: float = 0.25) -> LoopWatch:
    return LoopWatch(
        max_lag_s=max_lag_s, max_stall_s=30, window_s=WINDOW_S, interval_s=INTERVAL_S, clock=clock
    )


def run(watch: LoopWatch, clock: SecondsClock, seconds: float, late_s: float = 0.0) -> None:
    """The loop turns for ``seconds``, each tick's timer firing ``late_s`` late."""
    end = clock.now + seconds - 1e-9
    while clock.now + INTERVAL_S + late_s <= end + 1e-6:
        clock.advance(INTERVAL_S + late_s)
        watch.turned(late_s)


def gauges(watch: LoopWatch) -> tuple[float, ...]:
    """(snowflake_loop_lag_seconds, snowflake_loop_lag_max_seconds, snowflake_loop_overloaded)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(watch)
    names = ("lag_seconds", "lag_max_seconds", "overloaded")
    values = [registry.get_sample_value(f"snowflake_loop_{name}") for name in names]
    assert None not in values, values
    return tuple(v for v in values if v is not None)


def test_a_loop_that_never_turned_is_alive_ready_and_lags_nothing() -> None:
    clock = SecondsClock()
    watch = watch_with(clock)
    clock.advance(3600)  # a start-up that takes long has its own limits
    assert watch.unready() is None and watch.wedged() is None
    assert gauges(watch) == (0, 0, 0)


def test_a_steady_lag_reads_as_itself_and_over_the_limit_makes_the_node_unready() -> None:
    clock = SecondsClock()
    watch = watch_with(clock)
    run(watch, clock, 10, late_s=0.2)
    assert watch.unready() is None, "0.2 s is under --ready-max-lag 0.25 s"
    assert gauges(watch) == pytest.approx((0.2, 0.2, 0))
    run(watch, clock, 10, late_s=0.8)
    assert watch.unready() == (
        "overloaded: the serving loop has lagged 0.80 s (the median over the last 5 s) "
        "against --ready-max-lag 0.25 s; ready again at 0.125 s or less"
    )
    assert gauges(watch) == pytest.approx((0.8, 0.8, 1))
    assert watch.wedged() is None, "a lagging loop still turns: alive"


def test_one_slow_tick_never_makes_the_node_unready() -> None:
    clock = SecondsClock()
    watch = watch_with(clock)
    run(watch, clock, 10)
    clock.advance(INTERVAL_S + 2.0)  # a 2 s pause: a GC, a page fault, a slow syscall
    watch.turned(2.0)
    for _ in range(50):  # every moment the pause stays in the window (5 s)
        assert watch.unready() is None
        lag, worst, overloaded = gauges(watch)
        assert (lag, overloaded) == (0, 0) and worst == pytest.approx(2.0)
        run(watch, clock, INTERVAL_S)
    assert gauges(watch) == (0, 0, 0), "the pause has left the window"


def test_pauses_that_hold_the_loop_most_of_the_time_make_it_unready() -> None:
    """A loop frozen 3 s of every 5 s, quick in between: a mean per tick would read
    0.15 s (one slow tick among twenty quick ones); over time it lags 3 s."""
    clock = SecondsClock()
    watch = watch_with(clock)
    run(watch, clock, 5)
    for _ in range(3):
        clock.advance(INTERVAL_S + 3.0)
        watch.turned(3.0)
        run(watch, clock, 2)
    assert watch.unready() is not None
    assert gauges(watch) == pytest.approx((3.0, 3.0, 1))


def test_the_node_is_ready_again_only_once_the_lag_is_well_under_the_limit() -> None:
    clock = SecondsClock()
    watch = watch_with(clock)
    run(watch, clock, 5, late_s=0.3)
    assert watch.unready() is not None
    run(watch, clock, 10, late_s=0.2)  # under the limit, but not by half: no flapping
    why = watch.unready()
    assert why is not None and "lagged 0.20 s" in why
    assert gauges(watch)[2] == 1
    run(watch, clock, 10, late_s=0.125)
    assert watch.unready() is None and gauges(watch) == pytest.approx((0.125, 0.125, 0))
    run(watch, clock, 10, late_s=0.2)  # back near the limit, from below: still ready
    assert watch.unready() is None


def test_a_loop_that_stops_turning_reads_as_lagging_then_as_wedged() -> None:
    clock = SecondsClock()
    watch = watch_with(clock)
    run(watch, clock, 10)
    clock.advance(2.0)  # no tick since: the one awaited is 1.9 s late so far
    assert watch.unready() is None, "2 s are less than half the window"
    assert gauges(watch) == pytest.approx((0, 1.9, 0))
    clock.advance(0.5)
    assert watch.unready() is not None and gauges(watch)[0] == pytest.approx(2.4)
    clock.advance(27.5)  # 30 s without a turn: not yet wedged
    assert watch.wedged() is None
    assert gauges(watch) == pytest.approx((29.9, 29.9, 1))
    clock.advance(1.0)
    assert watch.wedged() == ("the serving loop has not turned for 31.0 s (--live-max-stall 30 s)")
    # It turns again: alive at once; ready once quick ticks cover half the window.
    watch.turned(30.9)
    assert watch.wedged() is None and watch.unready() is not None
    run(watch, clock, 2.4)
    assert watch.unready() is not None
    run(watch, clock, 0.2)
    assert watch.unready() is None


def test_a_loop_at_rest_is_alive_and_its_lag_forgotten() -> None:
    clock = SecondsClock()
    watch = watch_with(clock)
    run(watch, clock, 10, late_s=1.0)
    assert watch.unready() is not None
    watch.rest()  # the node stops serving: its stop has its own limits
    clock.advance(100)
    assert watch.unready() is None and watch.wedged() is None
    assert gauges(watch) == (0, 0, 0)
    watch.turned(0.0)  # serving again: the old lag does not come back
    assert watch.unready() is None and gauges(watch) == (0, 0, 0)
    clock.advance(30.5)
    assert watch.wedged() is not None


def test_a_timer_firing_early_counts_as_on_time_and_too_many_ticks_are_bounded() -> None:
    clock = SecondsClock()
    watch = watch_with(clock)
    for _ in range(10_000):  # a caller ticking far more often than it said it would
        clock.advance(0.001)
        watch.turned(-0.001)
    assert gauges(watch) == (0, 0, 0)
    assert watch.ticks <= 2 * WINDOW_S / INTERVAL_S + 2


@pytest.mark.parametrize(
    "arguments",
    [
        {"max_lag_s": 0, "max_stall_s": 30},
        {"max_lag_s": 0.25, "max_stall_s": 0},
        {"max_lag_s": 0.25, "max_stall_s": 30, "interval_s": 0},
        {"max_lag_s": 0.25, "max_stall_s": 30, "interval_s": 5, "window_s": 5},
    ],
)
def test_a_watch_that_cannot_measure_is_refused(arguments: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="need max_lag_s > 0"):
        LoopWatch(**arguments)  # type: ignore[arg-type]


# -- a real node ---------------------------------------------------------------------------


def overloaded_gauge(server: InProcessServer) -> float:
    for family in text_string_to_metric_families(server.metrics()):
        if family.name == "snowflake_loop_overloaded":
            return family.samples[0].value
    raise AssertionError("no snowflake_loop_overloaded")


@pytest.mark.slow  # seconds of real time
def test_a_stalled_serving_loop_makes_a_real_node_unready_but_not_dead(tmp_path: Path) -> None:
    """The loop of a real node is held (a callback that blocks it): the admin thread
    says overloaded once the stall covers half the window, /livez stays 200, and the
    node is ready again once quick ticks cover half the window."""
    with InProcessServer(ServerSettings(), tmp_path) as server:
        wait_until(lambda: server.http_get("/readyz")[0] == 200, "ready", 10)
        assert overloaded_gauge(server) == 0
        node_server = server.node.server
        assert node_server is not None
        # Ready once started; the loop ticks once the serving thread runs it.
        wait_until(lambda: server.node.loop_watch.ticks, "the serving loop's first tick", 10)
        loop = node_server.loop
        assert loop is not None
        released = threading.Event()
        stalled = time.monotonic()
        loop.call_soon_threadsafe(released.wait, 30)  # the loop runs nothing else meanwhile
        try:
            wait_until(lambda: server.http_get("/readyz")[0] == 503, "/readyz 503", 10)
            took = time.monotonic() - stalled
            status, body = server.http_get("/readyz")
            reason = json.loads(body)["reason"]
            assert status == 503 and reason.startswith("overloaded: the serving loop has lagged")
            assert server.http_get("/livez")[0] == 200, "a few seconds' stall is no wedge"
            assert overloaded_gauge(server) == 1
        finally:
            released.set()
        released_at = time.monotonic()
        wait_until(lambda: server.http_get("/readyz")[0] == 200, "ready again", 10)
        recovered = time.monotonic() - released_at
        assert server.raw_client().get_id("probes") > 0
    print(f"stall to 503: {took:.2f} s; release to 200: {recovered:.2f} s")
    assert took >= 2.0, "unready before the stall covered half the window"
