"""A process's phases: forward only, whatever order the calls come in."""

from __future__ import annotations

import threading

from snowflake_server._observability.lifecycle import Lifecycle, Phase


def phases_after(*steps: str) -> list[Phase]:
    """The phase after each call, in order, on a fresh lifecycle."""
    lifecycle = Lifecycle()
    seen = [lifecycle.phase]
    for step in steps:
        getattr(lifecycle, step)()
        seen.append(lifecycle.phase)
    return seen


def test_the_phases_go_starting_serving_draining_stopped() -> None:
    assert phases_after("serving", "draining", "stopped") == list(Phase)


def test_a_phase_never_goes_back() -> None:
    # A SIGTERM while starting, then start-up finishing after it: still draining.
    assert phases_after("draining", "serving", "stopped", "draining", "serving") == [
        Phase.STARTING,
        Phase.DRAINING,
        Phase.DRAINING,
        Phase.STOPPED,
        Phase.STOPPED,
        Phase.STOPPED,
    ]


def test_racing_calls_leave_the_latest_phase_of_the_order() -> None:
    lifecycle = Lifecycle()
    start = threading.Barrier(3)

    def call(step: str) -> None:
        start.wait()
        for _ in range(1000):
            getattr(lifecycle, step)()

    threads = [threading.Thread(target=call, args=(s,)) for s in ("serving", "draining", "stopped")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert lifecycle.phase is Phase.STOPPED
