"""What ``/readyz`` and ``/livez`` answer: whether ids can be had here now, and
whether the process still works.

Readiness is ready exactly when a ``get_id`` would succeed now: the node has
finished starting (its state reserved and, in cluster mode, its worker id
registered), is not draining, and every check passes (the high-water mark is
being written, the ZooKeeper session is proven, the clock is not refused).
One of those checks is the serving loop's lag (:class:`LoopWatch`): a node
whose loop falls seconds behind, for most of a window, serves its clients too
late to count as able to serve, so it leaves the rotation until it catches up.
Liveness only says whether the process is wedged: its loop has not turned for
``--live-max-stall``. A node that cannot hand out ids because ZooKeeper is down
is alive, and restarting it would not help; nor would restarting one that is
merely overloaded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .lifecycle import Lifecycle, Phase

__all__ = ["Check", "LoopWatch", "Readiness"]

Check = Callable[[], str | None]
"""Why ids cannot be had now, or None if this check passes."""


_PHASE_REASONS = {
    Phase.STARTING: "starting: the node does not serve yet",
    Phase.DRAINING: "draining: the node is stopping; clients should move to other nodes",
    Phase.STOPPED: "stopped",
}


class Readiness(Collector):
    """The node's phase (read from its :class:`Lifecycle`, which the node drives) and
    its checks; exported as ``snowflake_ready``.

    Checks are called on every probe and scrape: each must be cheap and never block.
    """

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle
        self._checks: list[Check] = []

    @property
    def phase(self) -> Phase:
        return self._lifecycle.phase

    def add_check(self, check: Check) -> None:
        self._checks.append(check)

    def reason(self) -> str | None:
        """Why a ``get_id`` would fail now, or None when it would succeed."""
        phase = self._lifecycle.phase
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


class _Tick(NamedTuple):
    """One turn of the serving loop's timer: armed at ``start``, fired at ``end``,
    ``late`` seconds after it was due."""

    start: float
    end: float
    late: float


_RECOVERED = 0.5
"""Overloaded until the lag falls to this share of ``--ready-max-lag``: a lag that
hovers at the limit must not flip readiness at every probe."""


class LoopWatch(Collector):
    """Watches the serving loop: its lag (readiness) and whether it turns at all (liveness).

    The loop runs a timer every :attr:`interval_s` and calls :meth:`turned` with how
    late it fired: that delay is the time a request arriving then waited for the loop.
    Each tick's delay stands for the whole time the tick covered (from the previous
    tick to this one), and a tick still awaited counts as late as it is so far, so a
    loop too busy to fire its timer at all reads as lagging more every moment.

    **Readiness** (:meth:`unready`, exported as ``snowflake_loop_lag_seconds``): the
    lag is the median over the last ``window_s`` of time of that delay, i.e. the loop
    ran at least this late for half of the window. Why the median over time, not a
    mean: a steady lag reads as itself (ticks all 0.3 s late: 0.3 s); one slow tick
    (a GC pause, a page fault, a 2 s hiccup) never makes a node unready, since it
    covers less than half the window; a loop stalled now does once the stall covers
    half the window (2.4 s with the defaults), long before liveness gives up. A mean
    per tick would hide a loop frozen 3 s of every 5 behind its twenty quick ticks; a
    mean over time would let one 1.1 s pause take a node out of rotation. The node is
    overloaded when the lag exceeds ``max_lag_s`` and stays so until it has fallen to
    half of that. Time before the first tick counts as no lag.

    **Liveness** (:meth:`wedged`): the loop is wedged when no tick came for
    ``max_stall_s``; before the first tick (starting) and after :meth:`rest` (stopping)
    it counts as alive, since start-up and stop have their own time limits.

    Threads: :meth:`turned` runs on the loop's thread; :meth:`unready`,
    :meth:`wedged` and :meth:`collect` on the admin endpoint's. No lock: the ticks
    are one immutable tuple that :meth:`turned` replaces whole (a reference store is
    atomic), so a reader sees the ticks before or after a turn, never half of one,
    and the loop never waits on a probe. Only the readers (and :meth:`rest`) write the
    overloaded flag; a reader that loses a race with :meth:`rest` leaves a stale flag
    that the next reading, with no ticks, clears.
    """

    def __init__(
        self,
        *,
        max_lag_s: float,
        max_stall_s: float,
        window_s: float = 5.0,
        interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        name: str = "the serving loop",
    ) -> None:
        if not (max_lag_s > 0 and max_stall_s > 0 and 0 < interval_s < window_s):
            raise ValueError(
                f"need max_lag_s > 0, max_stall_s > 0 and 0 < interval_s < window_s, got "
                f"{max_lag_s!r}, {max_stall_s!r}, {interval_s!r}, {window_s!r}"
            )
        self.interval_s = interval_s
        self.name = name  # in the probes' reasons: a native thread is watched as the loop is
        self._max_lag_s = max_lag_s
        self._max_stall_s = max_stall_s
        self._window_s = window_s
        self._clock = clock
        # A timer re-armed after each tick fires at most once per interval; the room
        # to spare only bounds the work if a caller ticks more often than it says.
        self._most = 2 * math.ceil(window_s / interval_s) + 2
        self._ticks: tuple[_Tick, ...] = ()
        self._overloaded = False

    @property
    def ticks(self) -> int:
        """How many ticks the watch holds now: those of the window, at most about
        2 x window / interval however often the loop ticks."""
        return len(self._ticks)

    def turned(self, late_s: float) -> None:
        """Called on the serving loop at each tick: how late the tick's timer fired
        (loop lag). The loop arms the next timer ``interval_s`` after this call."""
        now = self._clock()
        late = max(0.0, late_s)  # timers may fire a clock resolution early
        ticks = self._ticks
        start = ticks[-1].end if ticks else now - self.interval_s - late
        cutoff = now - self._window_s
        first = 0
        while first < len(ticks) and ticks[first].end <= cutoff:
            first += 1
        first = max(first, len(ticks) + 1 - self._most)
        self._ticks = (*ticks[first:], _Tick(start, now, late))

    def rest(self) -> None:
        """The loop stopped serving (the node stops): alive, its lag forgotten."""
        self._ticks = ()
        self._overloaded = False

    def unready(self) -> str | None:
        """A readiness check: why the node is not ready for its loop's lag, or None."""
        lag, _, overloaded = self._evaluate()
        if not overloaded:
            return None
        limit = self._max_lag_s
        return (
            f"overloaded: {self.name} has lagged {lag:.2f} s (the median over the last "
            f"{self._window_s:g} s) against --ready-max-lag {limit:g} s; ready again at "
            f"{limit * _RECOVERED:g} s or less"
        )

    def wedged(self) -> str | None:
        """Liveness: why the process is wedged (its loop has not turned for
        ``max_stall_s``), or None; None before the first tick and after :meth:`rest`."""
        ticks = self._ticks
        if not ticks:
            return None
        stalled = self._clock() - ticks[-1].end
        if stalled <= self._max_stall_s:
            return None
        return (
            f"{self.name} has not turned for {stalled:.1f} s "
            f"(--live-max-stall {self._max_stall_s:g} s)"
        )

    def collect(self) -> Iterable[Metric]:
        lag, worst, overloaded = self._evaluate()
        window = f"{self._window_s:g} s"
        yield GaugeMetricFamily(
            "snowflake_loop_lag_seconds",
            f"How late the serving loop runs: the median over the last {window} of how "
            f"late its {self.interval_s:g} s timer fired (a tick still awaited counts as "
            "late as it is so far). /readyz answers 503 above --ready-max-lag.",
            value=lag,
        )
        yield GaugeMetricFamily(
            "snowflake_loop_lag_max_seconds",
            f"How late the serving loop's slowest tick of the last {window} fired (or one "
            "still awaited is so far).",
            value=worst,
        )
        yield GaugeMetricFamily(
            "snowflake_loop_overloaded",
            "1 while /readyz answers 503 for the serving loop's lag: above --ready-max-lag, "
            "until it falls to half of it.",
            value=int(overloaded),
        )

    def _evaluate(self) -> tuple[float, float, bool]:
        """(lag, worst tick, overloaded) now; moves the overloaded flag."""
        lag, worst = self._measure()
        if lag > self._max_lag_s:
            overloaded = True
        elif lag <= self._max_lag_s * _RECOVERED:
            overloaded = False
        else:
            overloaded = self._overloaded
        self._overloaded = overloaded
        return lag, worst, overloaded

    def _measure(self) -> tuple[float, float]:
        """(the median lag over the window, its worst tick's)."""
        ticks = self._ticks
        now = self._clock()  # read after the ticks: no tick ends after now
        if not ticks:
            return 0.0, 0.0
        since = now - self._window_s
        spans = [(t.late, t.end - max(t.start, since)) for t in ticks if t.end > since]
        overdue = now - ticks[-1].end - self.interval_s
        if overdue > 0:
            spans.append((overdue, now - max(ticks[-1].end, since)))
        worst = max((late for late, _ in spans), default=0.0)
        # The time the spans do not cover (before the first tick) lagged 0.
        half, covered = self._window_s / 2, 0.0
        for late, span in sorted(spans, reverse=True):
            covered += span
            if covered >= half:
                return late, worst
        return 0.0, worst
