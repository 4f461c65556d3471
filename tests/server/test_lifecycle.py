"""A process's phases: forward only, whatever order the calls come in."""

from __future__ import annotations

import sys
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


def test_racing_calls_never_move_the_phase_back_and_end_in_the_last() -> None:
    """Callers on several threads (a signal, the start-up, the close) and a reader: the
    phase it sees only moves forward. (Under the GIL a lost lock is rarely caught here:
    the check-then-set window is a few bytecodes; the lock is there for that window.)"""
    lifecycle = Lifecycle()
    order = list(Phase)
    start = threading.Barrier(4)
    done = threading.Event()
    seen: list[Phase] = []

    def call(step: str) -> None:
        start.wait()
        for _ in range(2000):
            getattr(lifecycle, step)()

    def read() -> None:
        start.wait()
        while not done.is_set():
            seen.append(lifecycle.phase)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        reader = threading.Thread(target=read)
        callers = [
            threading.Thread(target=call, args=(s,)) for s in ("serving", "draining", "stopped")
        ]
        for thread in [reader, *callers]:
            thread.start()
        for thread in callers:
            thread.join(timeout=10)
        done.set()
        reader.join(timeout=10)
    finally:
        sys.setswitchinterval(interval)
    positions = [order.index(phase) for phase in seen]
    assert positions == sorted(positions), "the phase moved back"
    assert lifecycle.phase is Phase.STOPPED
