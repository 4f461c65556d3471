"""What ``/readyz`` and ``/livez`` answer: whether ids can be had here now, and
whether the process still works.

Readiness is ready exactly when a ``get_id`` would succeed now: the node has
finished starting (its state reserved and, in cluster mode, its worker id
registered), is not draining, and every check passes (the high-water mark is
being written, the ZooKeeper session is proven, the clock is not refused).
Liveness only says whether the process is wedged: a node that cannot hand out
ids because ZooKeeper is down is alive, and restarting it would not help.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["Check", "Liveness", "Phase", "Readiness"]

Check = Callable[[], str | None]
"""Why ids cannot be had now, or None if this check passes."""


class Phase(enum.Enum):
    """Where a node is in its life; only ``SERVING`` may be ready."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


_PHASE_REASONS = {
    Phase.STARTING: "starting: the node does not serve yet",
    Phase.DRAINING: "draining: the node is stopping; clients should move to other nodes",
    Phase.STOPPED: "stopped",
}


class Readiness(Collector):
    """The node's phase and its checks; exported as ``snowflake_ready``.

    The phase only moves forward (starting, serving, draining, stopped), so a
    late ``serving()`` never undoes a drain that began first. Checks are called
    on every probe and scrape: each must be cheap and never block.
    """

    def __init__(self) -> None:
        self._phase = Phase.STARTING
        self._lock = threading.Lock()
        self._checks: list[Check] = []

    @property
    def phase(self) -> Phase:
        return self._phase

    def add_check(self, check: Check) -> None:
        self._checks.append(check)

    def serving(self) -> None:
        self._advance(Phase.SERVING)

    def draining(self) -> None:
        self._advance(Phase.DRAINING)

    def stopped(self) -> None:
        self._advance(Phase.STOPPED)

    def _advance(self, phase: Phase) -> None:
        order = list(Phase)
        with self._lock:
            if order.index(phase) > order.index(self._phase):
                self._phase = phase

    def reason(self) -> str | None:
        """Why a ``get_id`` would fail now, or None when it would succeed."""
        phase = self._phase
        if phase is not Phase.SERVING:
            return _PHASE_REASONS[phase]
        for check in self._checks:
            why = check()
            if why is not None:
                return why
        return None

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "snowflake_ready",
            "1 while /readyz answers 200: a get_id would succeed now.",
            value=int(self.reason() is None),
        )


class Liveness:
    """Whether the serving loop still turns: it calls :meth:`beat` every second or so;
    if no beat came for ``max_stall_s`` the process is wedged.

    Before the first beat (starting) and after :meth:`rest` (stopping) the
    process counts as alive: its start-up and its stop have their own time limits.
    ``clock`` is monotonic seconds.
    """

    def __init__(
        self, max_stall_s: float = 30.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_stall_s = max_stall_s
        self._clock = clock
        self._last_beat: float | None = None

    def beat(self) -> None:
        self._last_beat = self._clock()

    def rest(self) -> None:
        self._last_beat = None

    def reason(self) -> str | None:
        """Why the process is wedged, or None while it works."""
        last = self._last_beat
        if last is None:
            return None
        stalled = self._clock() - last
        if stalled <= self._max_stall_s:
            return None
        return f"the serving loop has not turned for {stalled:.1f} s"
