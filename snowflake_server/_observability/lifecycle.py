"""A process's life: starting, serving, draining, stopped, in that order and never back.

The node (or the supervisor) drives it; readiness reads it. One home for the order, so
that a late ``serving()`` (start-up finishing after a SIGTERM) never undoes a drain that
began first.
"""

from __future__ import annotations

import enum
import threading

__all__ = ["Lifecycle", "Phase"]


class Phase(enum.Enum):
    """Where a node is in its life; only ``SERVING`` may be ready."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


_ORDER = list(Phase)


class Lifecycle:
    """The phase of one process, which only moves forward; safe from any thread.

    A call that would move it back (``serving()`` after ``draining()``) does nothing.
    """

    def __init__(self) -> None:
        self._phase = Phase.STARTING
        self._lock = threading.Lock()

    @property
    def phase(self) -> Phase:
        return self._phase

    def serving(self) -> None:
        self._advance(Phase.SERVING)

    def draining(self) -> None:
        self._advance(Phase.DRAINING)

    def stopped(self) -> None:
        self._advance(Phase.STOPPED)

    def _advance(self, phase: Phase) -> None:
        with self._lock:
            if _ORDER.index(phase) > _ORDER.index(self._phase):
                self._phase = phase
