"""Keeping the high-water mark on disk ahead of the clock, and honouring it at start-up.

A server reserves time ahead (now + 1 s) in its state file before it issues
an id, and a background thread renews the reservation every 250 ms, so the
per-id path never touches the disk. The generator never stamps an id after
the reserved time; if the renewal ever falls behind, the generator renews
synchronously first (counted as a reservation stall). After a crash the next
start finds a mark at most 1 s ahead of the last id, and waits for the clock
to pass it: Twitter slept 10 s at every start instead, and Leaf's 3 s
heartbeat let a quick restart with a small rollback through.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._errors import ReservationError, StartupRefused
from .._ids.generator import IdGenerator

__all__ = ["RENEW_EVERY_S", "RESERVE_AHEAD_MS", "MarkStore", "Reservation", "wait_for_clock"]

log = logging.getLogger(__name__)

RESERVE_AHEAD_MS = 1000
RENEW_EVERY_S = 0.25


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def wait_for_clock(
    mark_ms: int,
    clock: Callable[[], int],
    sleep: Callable[[float], object],
    max_wait_s: float,
    source: str,
) -> float:
    """Block until ``clock()`` is past ``mark_ms``; return the seconds waited.

    Raises ``StartupRefused`` at once if the clock is more than ``max_wait_s``
    behind, or if it has still not passed the mark after that long.
    """
    behind = mark_ms - clock()
    if behind < 0:
        return 0.0
    if behind > max_wait_s * 1000:
        raise StartupRefused(
            f"the clock is {behind / 1000:.3f} s behind the high-water mark {_iso(mark_ms)} "
            f"in {source}: this worker may already have issued ids up to then. Fix the clock "
            f"(is NTP running? run it in slew mode), or start with --max-startup-wait "
            f"{behind // 1000 + 1} or more to wait it out. Do not delete the state file: "
            "that can hand out duplicate ids"
        )
    log.warning(
        "the clock is %d ms behind the high-water mark %s in %s: waiting until it passes "
        "(at most --max-startup-wait %g s)",
        behind, _iso(mark_ms), source, max_wait_s,
    )  # fmt: skip
    # Elapsed time on the monotonic clock, so a wall clock that steps again cannot stall us.
    started = time.monotonic()
    while (behind := mark_ms - clock()) >= 0:
        if time.monotonic() - started > max_wait_s:
            raise StartupRefused(
                f"waited {max_wait_s:g} s and the clock is still {behind} ms behind the "
                f"high-water mark {_iso(mark_ms)} in {source}; fix the clock"
            )
        sleep(min(0.05, (behind + 1) / 1000))
    waited = time.monotonic() - started
    log.info("the clock passed the high-water mark after %.3f s", waited)
    return waited


class MarkStore(ABC):
    """Somewhere a high-water mark is kept (the state file, or ZooKeeper): the one
    place that decides when a mark is written and counts the writes.

    Subclasses say where (:attr:`where`, :attr:`name`) and how (:meth:`_store`,
    which raises if the mark was not stored); :meth:`_target` may round a mark up
    to write less often.
    """

    name: str = ""
    """A label value for metrics: "disk", "zookeeper"."""

    def __init__(self, mark_ms: int) -> None:
        self._written = mark_ms
        self._write_lock = threading.Lock()
        self.writes = 0
        self.write_errors = 0

    @property
    @abstractmethod
    def where(self) -> str:
        """The file or znode, for messages."""

    @property
    def mark_ms(self) -> int:
        """The mark last stored or loaded; -1 if none."""
        return self._written

    def advance(self, mark_ms: int) -> int:
        """Store ``mark_ms`` unless a later one is stored; return the stored mark.

        Raises whatever :meth:`_store` raised if the write failed (the old mark
        is then still in place).
        """
        target = self._target(mark_ms)
        with self._write_lock:
            if target > self._written:
                self._write(target)
            return self._written

    def finish(self, mark_ms: int) -> None:
        """Store the exact final mark (possibly lower), once ids have stopped."""
        with self._write_lock:
            self._write(mark_ms)

    def _target(self, mark_ms: int) -> int:
        return mark_ms

    def _write(self, mark_ms: int) -> None:
        try:
            self._store(mark_ms)
        except BaseException:
            self.write_errors += 1
            raise
        self._written = mark_ms
        self.writes += 1

    @abstractmethod
    def _store(self, mark_ms: int) -> None:
        """Persist ``mark_ms``; raise if it was not stored."""


class Reservation(Collector):
    """The reserved high-water mark of one worker, renewed in the background.

    Each store keeps its own margin ahead of the clock; the generator's ceiling
    is the lowest mark stored, so every id is covered by every store.
    ``reserve`` is what the generator calls when an id would pass the ceiling;
    :meth:`start` runs the renewal thread; :meth:`finish` seals the generator
    and writes the final, exact mark to every store.
    """

    def __init__(
        self,
        stores: Sequence[tuple[MarkStore, int]],
        clock: Callable[[], int],
        *,
        every_s: float = RENEW_EVERY_S,
    ) -> None:
        self._stores = list(stores)
        self._clock = clock
        self._every = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.startup_wait_s = 0.0

    def reserve(self, now_ms: int) -> int:
        """Persist marks ahead of ``now_ms`` in every store; return the lowest stored."""
        ceiling = None
        for store, ahead_ms in self._stores:
            try:
                stored = store.advance(now_ms + ahead_ms)
            except Exception as e:  # noqa: BLE001 - OSError, ZooKeeper errors: all mean "not stored"
                raise ReservationError(
                    f"cannot write the high-water mark to {store.where}: {e}"
                ) from None
            ceiling = stored if ceiling is None else min(ceiling, stored)
        assert ceiling is not None, "a reservation needs a store"
        return ceiling

    def start(self, generator: IdGenerator) -> None:
        """Renew in the background, raising ``generator``'s ceiling after each write."""

        def renew() -> None:
            while not self._stop.wait(self._every):
                try:
                    generator.raise_ceiling(self.reserve(self._clock()))
                except ReservationError as e:
                    # Ids go on up to the old ceiling; past it each call retries the write.
                    log.error("%s", e)

        self._thread = threading.Thread(target=renew, name="high-water-mark", daemon=True)
        self._thread.start()

    def finish(self, generator: IdGenerator, floor_ms: int) -> None:
        """Stop renewing, seal ``generator`` and store the newest timestamp it used
        (at least ``floor_ms``), so that a clean restart need not wait."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        final = max(generator.seal(), floor_ms)
        for store, _ in self._stores:
            try:
                store.finish(final)
            except Exception as e:  # noqa: BLE001 - the reserved mark stays: safe, a wait at most
                log.error("cannot write the final high-water mark to %s: %s", store.where, e)

    def collect(self) -> Iterable[Metric]:
        mark = GaugeMetricFamily(
            "snowflake_high_water_mark_timestamp_seconds",
            "The high-water mark in each store: no id of this worker is stamped after it.",
            labels=["store"],
        )
        writes = CounterMetricFamily(
            "snowflake_state_writes", "Writes of the high-water mark, by store.", labels=["store"]
        )
        errors = CounterMetricFamily(
            "snowflake_state_write_errors",
            "Failed writes of the high-water mark, by store.",
            labels=["store"],
        )
        for store, _ in self._stores:
            mark.add_metric([store.name], store.mark_ms / 1000)
            writes.add_metric([store.name], store.writes)
            errors.add_metric([store.name], store.write_errors)
        yield from (mark, writes, errors)
        yield GaugeMetricFamily(
            "snowflake_startup_clock_wait_seconds",
            "How long start-up waited for the clock to pass the previous run's high-water mark.",
            value=self.startup_wait_s,
        )
