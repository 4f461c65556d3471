"""What /readyz and /livez are built from: the node's phase and checks, the loop's beat."""

from __future__ import annotations

from prometheus_client.registry import CollectorRegistry

from snowflake_server._observability.probes import Liveness, Phase, Readiness
from tests.support.fakes import SecondsClock


def ready_gauge(readiness: Readiness) -> float | None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(readiness)
    return registry.get_sample_value("snowflake_ready")


def test_only_a_serving_node_whose_checks_pass_is_ready() -> None:
    failing: list[str] = []
    readiness = Readiness()
    readiness.add_check(lambda: None)
    readiness.add_check(lambda: failing[0] if failing else None)
    assert readiness.reason() == "starting: the node does not serve yet"
    assert ready_gauge(readiness) == 0
    readiness.serving()
    assert readiness.reason() is None and ready_gauge(readiness) == 1
    failing.append("the disk is full")
    assert readiness.reason() == "the disk is full" and ready_gauge(readiness) == 0
    failing.clear()
    readiness.draining()
    assert (
        readiness.reason() == "draining: the node is stopping; clients should move to other nodes"
    )
    readiness.stopped()
    assert readiness.reason() == "stopped" and readiness.phase is Phase.STOPPED


def test_the_phase_never_goes_back() -> None:
    readiness = Readiness()
    readiness.draining()  # a SIGTERM during start-up
    readiness.serving()  # start-up finishing after it must not make the node ready
    assert readiness.phase is Phase.DRAINING and readiness.reason() is not None


def test_a_check_is_not_asked_before_the_node_serves() -> None:
    asked: list[int] = []

    def check() -> str | None:
        asked.append(1)
        return None

    readiness = Readiness()
    readiness.add_check(check)
    readiness.reason()
    assert asked == []
    readiness.serving()
    assert readiness.reason() is None and asked == [1]


def test_the_process_is_wedged_only_when_its_loop_stops_beating() -> None:
    clock = SecondsClock()
    liveness = Liveness(max_stall_s=30, clock=clock)
    assert liveness.reason() is None, "starting: alive"
    liveness.beat()
    clock.advance(30)
    assert liveness.reason() is None
    clock.advance(0.5)
    assert liveness.reason() == "the serving loop has not turned for 30.5 s"
    liveness.beat()
    assert liveness.reason() is None
    clock.advance(100)
    liveness.rest()  # stopped serving: its stop has its own limits
    assert liveness.reason() is None
