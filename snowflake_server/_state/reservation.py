"""Keeping the high-water mark on disk ahead of the clock, and honouring it at start-up.

A server reserves time ahead (now + 1 s) in its state file before it issues
an id, and a background thread renews the reservation every 250 ms, so the
per-id path never touches the disk. The generator never stamps an id after
the reserved time. If the renewal ever falls behind, a call that needs a
later ceiling (counted as a reservation stall) wakes the renewal thread and
waits for it, outside the generator's lock and for at most ``RENEW_WAIT_S``;
then it fails with ``ReservationError`` saying which store is behind and why,
so that the client goes to another node. Writes never happen on the id path
and never under the generator's lock. After a crash the next
start finds a mark at most 1 s ahead of the last id, and waits for the clock
to pass it: Twitter slept 10 s at every start instead, and Leaf's 3 s
heartbeat let a quick restart with a small rollback through.

With a clock sequence in the layout a store keeps one mark per clock-sequence
value, and the value in use when it last wrote. A move to another value
(:meth:`Reservation.switch`) writes that value's mark, ahead of the clock, to
every store before any id uses it.
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

from .._errors import ClockBehindMark, ReservationError, StartupRefused
from .._ids.generator import IdGenerator

__all__ = [
    "RENEW_EVERY_S",
    "RENEW_WAIT_S",
    "RESERVE_AHEAD_MS",
    "MarkStore",
    "Reservation",
    "valid_marks",
    "wait_for_clock",
]

log = logging.getLogger(__name__)

RESERVE_AHEAD_MS = 1000
RENEW_EVERY_S = 0.25
RENEW_WAIT_S = 0.1
"""How long a call past the reserved mark waits for the renewal thread: a client
fails over to another node sooner than a slow write (ZooKeeper: up to 2 s) ends,
and at 1 s ahead a renewal that is merely late catches up well within it."""


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

    Raises ``ClockBehindMark`` at once if the clock is more than ``max_wait_s``
    behind, ``StartupRefused`` if it has still not passed the mark after that long.
    """
    behind = mark_ms - clock()
    if behind < 0:
        return 0.0
    if behind > max_wait_s * 1000:
        raise ClockBehindMark(
            f"the clock is {behind / 1000:.3f} s behind the high-water mark {_iso(mark_ms)} "
            f"in {source}: this worker may already have issued ids up to then. Fix the clock "
            f"(is NTP running? run it in slew mode), or start with --max-startup-wait "
            f"{behind // 1000 + 1} or more to wait it out. Do not delete the state file: "
            "that can hand out duplicate ids",
            behind,
            source,
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


def valid_marks(by_value: object, in_use: object, newest: int) -> bool:
    """Whether a stored record's marks per clock-sequence value (``by_value``, -1 for
    none) and the value in use are well formed, the newest of them being ``newest``."""
    return (
        isinstance(by_value, list)
        and bool(by_value)
        and all(type(mark) is int and mark >= -1 for mark in by_value)
        and max(by_value) == newest
        and type(in_use) is int
        and 0 <= in_use < len(by_value)
    )


class MarkStore(ABC):
    """Somewhere a high-water mark is kept (the state file, or ZooKeeper): the one
    place that decides when a mark is written and counts the writes.

    Subclasses say where (:attr:`where`, :attr:`name`) and how (:meth:`_store`,
    which raises if the marks were not stored); :meth:`_target` may round a mark
    up to write less often.

    With a clock sequence, ``marks`` holds one mark per value (-1: none) and
    ``clock_sequence`` the value in use: each write names the value it is for.
    """

    name: str = ""
    """A label value for metrics: "disk", "zookeeper"."""

    def __init__(self, mark_ms: int, marks: Sequence[int] = (), clock_sequence: int = 0) -> None:
        self._marks = list(marks) if marks else [mark_ms]
        self._value = clock_sequence
        self._write_lock = threading.Lock()
        self.writes = 0
        self.write_errors = 0

    @property
    @abstractmethod
    def where(self) -> str:
        """The file or znode, for messages."""

    @property
    def mark_ms(self) -> int:
        """The mark of the value in use, last stored or loaded; -1 if none."""
        return self._marks[self._value]

    @property
    def marks(self) -> tuple[int, ...]:
        """The mark of each clock-sequence value (one value without a clock sequence)."""
        return tuple(self._marks)

    @property
    def clock_sequence(self) -> int:
        """The clock-sequence value the last write (or the loaded record) was for."""
        return self._value

    def advance(self, mark_ms: int, clock_sequence: int = 0, *, switching: bool = False) -> int:
        """Store ``mark_ms`` for ``clock_sequence`` unless a later one is stored; return
        its stored mark. ``switching``: name that value as the one in use too (only a
        move does, so that a renewal of the old value landing after it cannot).

        Raises whatever :meth:`_store` raised if the write failed (the old marks
        are then still in place).
        """
        target = self._target(mark_ms)
        with self._write_lock:
            stored = self._marks[clock_sequence]
            in_use = clock_sequence if switching else self._value
            if target > stored or in_use != self._value:
                self._write(max(target, stored), clock_sequence, in_use)
            return self._marks[clock_sequence]

    def finish(self, mark_ms: int, clock_sequence: int = 0) -> None:
        """Store the exact final mark of ``clock_sequence`` (possibly lower), the value in
        use, once ids have stopped."""
        with self._write_lock:
            self._write(mark_ms, clock_sequence, clock_sequence)

    def _target(self, mark_ms: int) -> int:
        return mark_ms

    def _write(self, mark_ms: int, clock_sequence: int, in_use: int) -> None:
        marks = [*self._marks]
        marks[clock_sequence] = mark_ms
        try:
            self._store(tuple(marks), in_use)
        except BaseException:
            self.write_errors += 1
            raise
        self._marks, self._value = marks, in_use
        self.writes += 1

    @abstractmethod
    def _store(self, marks: tuple[int, ...], clock_sequence: int) -> None:
        """Persist ``marks`` (one per clock-sequence value) and the value in use;
        raise if they were not stored."""


class Reservation(Collector):
    """The reserved high-water mark of one worker, renewed in the background.

    Each store keeps its own margin ahead of the clock; the generator's ceiling
    is the lowest mark stored, so every id is covered by every store.
    ``reserve`` is what the generator calls (outside its lock) when an id would
    pass the ceiling; :meth:`start` runs the renewal thread; :meth:`finish`
    seals the generator and writes the final, exact mark to every store.

    ``wait_s``: how long ``reserve`` waits for the renewal thread once it runs.
    ``clock_sequence``: the value reserved for until :meth:`switch` moves on.
    """

    def __init__(
        self,
        stores: Sequence[tuple[MarkStore, int]],
        clock: Callable[[], int],
        *,
        every_s: float = RENEW_EVERY_S,
        wait_s: float = RENEW_WAIT_S,
        clock_sequence: int = 0,
    ) -> None:
        self._stores = list(stores)
        self._value = clock_sequence
        self._clock = clock
        self._every = every_s
        self._wait = wait_s
        self._stop = threading.Event()
        self._wake = threading.Event()  # a call asks the renewal thread to write now
        self._thread: threading.Thread | None = None
        # What callers waiting in reserve() watch, guarded by _changed: the lowest mark
        # stored by the last complete write, the latest ms a caller asked for, the
        # writes started and the last one that failed (numbered), and why it failed.
        self._changed = threading.Condition()
        self._ceiling = -1
        self._wanted = -1
        self._started = 0
        self._failed = 0
        self._last_error = ""
        # The store being written now and since when (monotonic), for messages only.
        self._writing: tuple[str, float] | None = None
        self.startup_wait_s = 0.0
        # Set by Worker.open: whether no mark existed anywhere, and how long it waited.
        self.first_start = False
        self.first_start_wait_s = 0.0

    def reserve(self, now_ms: int) -> int:
        """A ceiling of at least ``now_ms``: the lowest mark then stored.

        Before :meth:`start` it writes every store itself. Once the renewal thread
        runs it only asks that thread to write at once, and waits at most
        ``wait_s`` for it. Raises ``ReservationError`` saying what happened: a
        write failed (which store, and why), or none covers ``now_ms`` in time.
        """
        if self._thread is None:  # the start-up write: it names the value chosen
            return self._write_all(now_ms, self._value, switching=True)
        with self._changed:
            if self._ceiling < now_ms:
                self._wanted = max(self._wanted, now_ms)
                # The next write to start includes now_ms: if it fails, waiting longer is moot.
                ticket = self._started + 1
                self._wake.set()
                self._changed.wait_for(
                    lambda: (
                        self._ceiling >= now_ms or self._failed >= ticket or self._stop.is_set()
                    ),
                    self._wait,
                )
            if self._ceiling >= now_ms:
                return self._ceiling
            if self._stop.is_set():
                raise ReservationError("the generator is shut down: no more ids")
            raise ReservationError(self._behind(now_ms))

    def switch(self, clock_sequence: int, now_ms: int) -> int:
        """Move to ``clock_sequence``: write its mark ahead of ``now_ms`` to every store
        and return the lowest stored, to be its ceiling; from then on renewals are for
        it. Raises ``ReservationError`` (and stays on the old value) if a write fails.
        The generator calls it under its lock, before any id uses the value."""
        return self._write_all(now_ms, clock_sequence, switching=True)

    @property
    def clock_sequence(self) -> int:
        """The clock-sequence value the marks are reserved for."""
        return self._value

    @property
    def failing(self) -> str | None:
        """Why the marks are not being kept ahead of the clock, or None: the latest
        write failed (calls fail once the stored ceiling is passed, within a second),
        or no stored mark covers now (a write that hangs: calls fail already)."""
        if self._stop.is_set():
            return None  # finished: the generator is sealed on purpose
        with self._changed:
            if self._last_error:
                return self._last_error
            now = self._clock()
            if self._ceiling < now:
                return self._behind(now)
        return None

    def _behind(self, now_ms: int) -> str:
        """Why no mark covers ``now_ms`` yet (caller holds ``_changed``)."""
        behind = [store.where for store, _ in self._stores if store.mark_ms < now_ms]
        message = (
            f"no high-water mark covers ms {now_ms} ({_iso(now_ms)}) yet: the renewal of "
            f"{', '.join(behind) or 'the high-water mark'} is behind"
        )
        writing = self._writing
        if writing is not None:
            where, since = writing
            message += f"; it has been writing {where} for {time.monotonic() - since:.3f} s"
        if self._last_error:
            message += f"; its last write failed: {self._last_error}"
        return message

    def _write_all(self, now_ms: int, value: int, *, switching: bool = False) -> int:
        """Persist marks of clock sequence ``value`` ahead of ``now_ms`` in every store;
        return the lowest stored."""
        ceiling = None
        for store, ahead_ms in self._stores:
            self._writing = (store.where, time.monotonic())
            try:
                stored = store.advance(now_ms + ahead_ms, value, switching=switching)
            except Exception as e:  # noqa: BLE001 - OSError, ZooKeeper errors: all mean "not stored"
                # Some errors have no text (a ZooKeeper timeout): their type says it. An
                # OSError's words, not Python's "[Errno 27] ...", reach /readyz and the log.
                said = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                message = (
                    f"cannot write the high-water mark to {store.where}: {said or type(e).__name__}"
                )
                with self._changed:
                    self._last_error = message  # the calls fail: /readyz says why
                raise ReservationError(message) from None
            finally:
                self._writing = None
            ceiling = stored if ceiling is None else min(ceiling, stored)
        assert ceiling is not None, "a reservation needs a store"
        with self._changed:
            if switching:
                # The new value's ceiling replaces the old one's, even if lower; what
                # callers asked for of the old value no longer applies.
                self._value, self._ceiling, self._wanted = value, ceiling, -1
                self._changed.notify_all()
            elif value == self._value:  # else written before a switch: not the ceiling now
                self._ceiling = max(self._ceiling, ceiling)
            self._last_error = ""
        return ceiling

    def start(self, generator: IdGenerator) -> None:
        """Renew in the background, raising ``generator``'s ceiling after each write:
        every ``every_s``, and at once when a call in :meth:`reserve` asks."""

        def renew() -> None:
            failing = ""  # the error logged last; a write that keeps failing is logged once
            while not self._stop.is_set():
                self._wake.wait(self._every)
                self._wake.clear()
                if self._stop.is_set():
                    break
                with self._changed:
                    self._started += 1
                    attempt = self._started
                    now = max(self._clock(), self._wanted)
                    value = self._value
                try:
                    ceiling = self._write_all(now, value)
                except ReservationError as e:  # _write_all recorded it for /readyz
                    with self._changed:
                        self._failed = attempt
                        self._changed.notify_all()
                    # Ids go on up to the old ceiling; past it calls fail (clients go to
                    # other nodes) and each asks for another try.
                    if str(e) != failing:
                        failing = str(e)
                        log.error("%s", e)
                    continue
                generator.raise_ceiling(ceiling, value)
                with self._changed:
                    self._changed.notify_all()
                if failing:
                    failing = ""
                    log.info("the high-water mark is written again")

        self._thread = threading.Thread(target=renew, name="high-water-mark", daemon=True)
        self._thread.start()

    def finish(self, generator: IdGenerator) -> None:
        """Stop renewing, seal ``generator`` and store the newest timestamp it used with
        its clock sequence, so that a clean restart need not wait."""
        self._stop.set()
        self._wake.set()
        with self._changed:
            self._changed.notify_all()  # callers waiting in reserve() give up at once
        if self._thread is not None:
            self._thread.join()
        # After a first start with no id issued that is -1: no store takes it back.
        final = max(generator.seal(), 0)
        value = generator.clock_sequence
        for store, _ in self._stores:
            try:
                store.finish(final, value)
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
            "snowflake_clock_sequence",
            "The clock-sequence value ids are made with now (0 without --clock-sequence-bits).",
            value=self._value,
        )
        yield GaugeMetricFamily(
            "snowflake_startup_clock_wait_seconds",
            "How long start-up waited for the clock to pass the previous run's high-water mark.",
            value=self.startup_wait_s,
        )
        yield CounterMetricFamily(
            "snowflake_first_starts",
            "1 if this worker started with no high-water mark anywhere (a first start, or "
            "a lost state directory): it waited --first-start-wait before its first id.",
            value=int(self.first_start),
        )
