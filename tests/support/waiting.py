"""Waiting for another process to reach a state: the one place tests poll.

Tests never sleep to let time pass (they inject a clock) nor to wait for
readiness (servers print a ready line). What remains is a real process whose
state shows only from outside (a log line, a metric, a child restarted): poll
it here, briefly and with a deadline that names what never happened.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_POLL_S = 0.02
_never = threading.Event()


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 20.0) -> None:
    """Return once ``condition()`` is true; ``AssertionError`` naming ``what`` after
    ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        _never.wait(_POLL_S)


def run_in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Start ``target()`` in a thread; its result (or exception) lands in the list, so
    that a test can see whether a call returned while something else is held."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(target())
        except Exception as e:  # noqa: BLE001 - handed to the test to look at
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome
