"""The id generator: pure logic, no I/O.

Time is an input: an ``IdGenerator`` reads the time only through the ``clock``
it is given (ms since the Unix epoch) and waits only through the ``sleep`` it
is given, so tests drive it with a fake clock and servers with the real one.
How ids are packed is the client package's :class:`Layout`.

With a clock sequence in the layout (``clock_sequence_bits``), a clock that
steps back further than the tolerance does not refuse calls: the generator moves
to another clock-sequence value whose used times the clock is past, and issues at
the earlier time under it. An id is then unique as long as no (timestamp, clock
sequence) pair is used twice, which the generator keeps to by remembering, per
value, the newest timestamp used with it. Ids stop increasing across such a move.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Protocol

from snowflake_thrift_client import Layout
from snowflake_thrift_client._layout import check_int

from .._errors import (
    ClockMovedBackwardsError,
    ConfigurationError,
    InvalidCountError,
    ReservationError,
    TimestampOverflowError,
)
from .clocks import METER, pause, wall_clock_ms

if TYPE_CHECKING:
    from .._native._core import GeneratorState

__all__ = [
    "Contended",
    "GeneratorCounters",
    "GeneratorSettings",
    "IdGenerator",
    "IdSource",
    "NativeStateIdGenerator",
    "WouldBlock",
    "forbid_waiting",
    "pick_clock_sequence",
    "waiting_forbidden",
]

log = logging.getLogger(__name__)

# Threads that must not wait (an event loop's): a call there that would wait longer
# than _LOOP_WAIT_LIMIT_MS, or for a new reservation, raises WouldBlock instead,
# before anything is claimed or counted. Read only on those slow paths, never per id.
_no_waiting = threading.local()
_LOOP_WAIT_LIMIT_MS = 1


class WouldBlock(Exception):
    """Internal, never seen by a client (so outside the ``SnowflakeError`` tree): a
    call made on a thread that must not wait (the event loop's) would have to wait
    longer than a ms or for a new reservation. Nothing was issued or counted; run
    the same call again on a thread that may wait."""


class Contended(WouldBlock):
    """A ``WouldBlock`` because another call holds the generator (a call on a worker
    thread waiting out the next ms or a clock step): the same call is best made
    again on the loop a moment later, not queued behind the worker threads' calls
    (every call would then join that queue, one ms each)."""


def forbid_waiting(forbidden: bool = True) -> None:
    """Mark the calling thread as one that must not wait: from now on a generator
    call on it that would wait for more than a ms (a clock stepped back) or for a
    new reservation raises ``WouldBlock``, having issued and counted nothing, so
    that the caller can make the same call on a thread that may wait. Waiting out
    an exhausted sequence (under a ms) still happens in place."""
    _no_waiting.forbidden = forbidden


def waiting_forbidden() -> bool:
    """Whether :func:`forbid_waiting` marked the calling thread."""
    return bool(getattr(_no_waiting, "forbidden", False))


@dataclass(frozen=True, slots=True)
class GeneratorSettings:
    """Who this generator is and how it treats a clock that steps back.

    ``max_backwards_ms``: a backwards step of at most this many ms is waited
    out; a larger one makes ``next_id`` raise ``ClockMovedBackwardsError``.
    0 is Twitter's strict behaviour (never wait).

    ``sequence_start``: ``"zero"`` starts each ms at sequence 0 (Twitter);
    ``"random"`` at a small random offset (Leaf), so that at low traffic the
    low digits of ids (``id % 100``) are spread evenly instead of all alike.

    ``max_batch``: the most ids one ``next_ids`` call returns (``--max-batch``),
    whatever the layout; never more than one ms holds (2^sequence_bits).
    """

    datacenter_id: int = 0
    worker_id: int = 0
    layout: Layout = field(default_factory=Layout)
    max_backwards_ms: int = 5
    sequence_start: Literal["zero", "random"] = "zero"
    max_batch: int = 4096

    def __post_init__(self) -> None:
        if not isinstance(self.layout, Layout):
            raise ConfigurationError(f"layout must be a Layout, got {self.layout!r}")
        self.layout.node_bits(self.datacenter_id, self.worker_id)
        check_int("max_backwards_ms", self.max_backwards_ms, 0, 60_000)
        check_int("max_batch", self.max_batch, 1, 2**31 - 1)
        if self.sequence_start not in ("zero", "random"):
            raise ConfigurationError(
                f"sequence_start must be 'zero' or 'random', got {self.sequence_start!r}"
            )

    @property
    def random_start_bound(self) -> int:
        """With ``sequence_start="random"``, each ms starts at a sequence below this
        (100, as Leaf; less for a narrow sequence field, so half of it stays usable)."""
        return min(100, (self.layout.max_sequence + 1) // 2) or 1


@dataclass(frozen=True, slots=True)
class GeneratorCounters:
    """What a generator (or every generator a slot has held) counted so far."""

    ids_generated: int = 0
    clock_backwards_waited: int = 0
    clock_backwards_refused: int = 0
    sequence_exhausted_waits: int = 0
    reservation_stalls: int = 0
    clock_sequence_switches: int = 0
    max_backward_step_ms: int = 0
    """The largest step back of the clock seen, in ms behind the newest id (a maximum:
    adding counters keeps the larger)."""

    def __add__(self, other: GeneratorCounters) -> GeneratorCounters:
        sums = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name != "max_backward_step_ms"
        }
        step = max(self.max_backward_step_ms, other.max_backward_step_ms)
        return GeneratorCounters(**sums, max_backward_step_ms=step)


class _Lock(Protocol):
    """What the generator needs of its lock: ``threading.Lock``, or the native state's
    mutex (:class:`NativeStateIdGenerator`)."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class IdSource(Protocol):
    """What the Thrift handler and the metrics need: an ``IdGenerator``, or a slot
    whose generator changes (cluster mode re-leases worker ids)."""

    @property
    def settings(self) -> GeneratorSettings: ...

    def next_id(self) -> int: ...

    def next_ids(self, count: int) -> list[int]: ...

    def counters(self) -> GeneratorCounters: ...


def pick_clock_sequence(used_until_ms: Sequence[int], first: int, now_ms: int) -> int | None:
    """The first clock-sequence value, looking from ``first`` on and wrapping, whose
    used times ``now_ms`` is past (``used_until_ms[value] < now_ms``); None if every
    value was used at ``now_ms`` or later."""
    count = len(used_until_ms)
    for step in range(count):
        value = (first + step) % count
        if used_until_ms[value] < now_ms:
            return value
    return None


# How long to yield while waiting for the next ms after the sequence ran out:
# short, because the wait ends within one ms and throughput is lost meanwhile.
_EXHAUSTED_POLL_S = 0.00005
_RESERVES_PER_CALL = 3
"""How often one call may ask for a new ceiling. A ceiling can be passed again
before the call takes the lock back (a write that ended just short of now, a busy
machine); the next ask then waits for a fresh write. Bounded, so a store that never
keeps up fails the call rather than holding it."""


class IdGenerator:
    """Thread-safe source of unique, increasing ids for one (datacenter, worker).

    Within one generator no id is ever repeated and every id is greater than
    the one before it, whatever the clock does: a backwards step of at most
    ``settings.max_backwards_ms`` is waited out, a larger one raises
    ``ClockMovedBackwardsError`` before any state is touched.

    ``resume_after_ms``: only timestamps after this one are used (a restart
    passes the high-water mark of the previous run). ``ceiling_ms`` and
    ``reserve``: ids are never stamped after ``ceiling_ms``; a new ms past it
    first calls ``reserve(ms)``, which must persist and return a new ceiling
    of at least ``ms`` (or raise). Without them the only ceiling is the layout's.

    ``reserve`` is called outside the generator's lock: the lock is released
    for it and taken again after, and the call then starts over with a fresh
    clock reading, so a slow write never holds up calls that need no new
    ceiling. How long it may take is up to ``reserve`` (``Reservation.reserve``
    waits a short, fixed time for its renewal thread). If the ceiling still does
    not cover the fresh reading, the call raises ``ReservationError``.

    Its counters are updated under the generator's lock; :meth:`counters`
    reads them at any time.

    With ``clock_sequence_bits`` in the layout, ``clock_sequence`` is the value to
    start with and ``used_until_ms`` the newest timestamp each value may have used
    (from the stored marks; -1: never). A backwards step beyond the tolerance then
    moves to the next value whose times the clock is past (see
    :func:`pick_clock_sequence`) instead of raising: ``switch(value, ms)`` must
    persist a mark of at least ``ms`` for ``value`` and return it (or raise) before
    any id uses it. It is called under the lock (a rare event, and two calls must
    not move at once); a thread that must not wait gets ``WouldBlock`` instead.
    Only when every value's times are ahead of the clock does the call raise
    ``ClockMovedBackwardsError``.
    """

    def __init__(
        self,
        settings: GeneratorSettings,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        sleep: Callable[[float], object] = pause,
        randbelow: Callable[[int], int] = random.randrange,
        resume_after_ms: int = -1,
        ceiling_ms: int | None = None,
        reserve: Callable[[int], int] | None = None,
        clock_sequence: int = 0,
        used_until_ms: Sequence[int] = (),
        switch: Callable[[int, int], int] | None = None,
    ) -> None:
        layout = settings.layout
        now = clock()
        if now < layout.epoch_ms:
            raise ConfigurationError(
                f"epoch {layout.epoch_ms} is {layout.epoch_ms - now} ms in the future"
            )
        if now > layout.max_timestamp_ms:
            raise ConfigurationError(
                f"the layout's {layout.timestamp_bits} timestamp bits ran out at "
                f"{layout.max_timestamp_ms} ms; use a later epoch or more timestamp bits"
            )
        self.settings = settings
        self._clock = clock
        self._sleep = sleep
        self._randbelow = randbelow
        self._lock: _Lock = threading.Lock()
        self._acquire = self._lock.acquire
        self._release = self._lock.release
        # Hot-path constants, read once instead of through properties per id.
        self._epoch = layout.epoch_ms
        self._ts_shift = layout.timestamp_shift
        self._node_ids = layout.node_bits(settings.datacenter_id, settings.worker_id)
        self._clock_sequence_shift = layout.clock_sequence_shift
        values = layout.max_clock_sequence + 1
        if len(used_until_ms) > values:
            raise ConfigurationError(
                f"{len(used_until_ms)} clock-sequence marks for {values} values"
            )
        # The newest timestamp each clock-sequence value may have used; the current
        # value's entry is stale while it is current (_last_ts is the truth then).
        self._used_until = [*used_until_ms, *([-1] * (values - len(used_until_ms)))]
        self._clock_sequence = clock_sequence
        self._node = self._node_ids | layout.node_bits(0, 0, clock_sequence)
        if reserve is not None and switch is None and values > 1:
            raise ConfigurationError("a clock sequence with a reservation needs switch")
        self._switch = switch
        self._sealed = False
        self._long_hold = False  # a call waits out a clock step, or writes a switch, under the lock
        self._max_sequence = layout.max_sequence
        self._ms_per_id = 0.001 / (layout.max_sequence + 1)  # seconds of id capacity per id
        self._max_ts = layout.max_timestamp_ms
        self._tolerance = settings.max_backwards_ms
        self._random_start = (
            settings.random_start_bound if settings.sequence_start == "random" else 0
        )
        # One call never builds more than this many ids (a 22-bit sequence field would
        # otherwise let one get_ids ask for 4,194,304 of them, hundreds of MB).
        self._max_batch = min(settings.max_batch, self._max_sequence + 1)
        self._batch_limit_reason = (
            f"one call returns at most --max-batch {settings.max_batch} ids"
            if settings.max_batch <= self._max_sequence + 1
            else f"one call returns at most one ms of ids: {self._max_sequence + 1} with "
            f"{layout.sequence_bits} sequence bits"
        )
        self._reserve = reserve
        # One comparison per new ms checks both the reservation and the layout's end.
        self._ceiling = self._max_ts if ceiling_ms is None else min(ceiling_ms, self._max_ts)
        # The resume point counts as used up: the next id is stamped after it.
        self._last_ts = resume_after_ms
        self._sequence = self._max_sequence
        self._base = 0  # the id bits of the current ms; set with each new ms
        # The hot path reads nanoseconds: the default clock is then time.time_ns itself,
        # a builtin, with no Python call in between.
        self._clock_ns: Callable[[], int] = (
            time.time_ns if clock is wall_clock_ms else (lambda: clock() * 1_000_000)
        )
        # ids_generated is derived, not counted per id: the ids of finished ms plus
        # the span of the current ms (sequences _first_sequence.._sequence).
        self._ids_before_this_ms = 0
        self._first_sequence = self._max_sequence + 1  # no id in the resume ms
        self.clock_backwards_waited = 0
        self.clock_backwards_refused = 0
        self.sequence_exhausted_waits = 0
        self.reservation_stalls = 0
        self.clock_sequence_switches = 0
        self.max_backward_step_ms = 0

    @property
    def clock_sequence(self) -> int:
        """The clock-sequence value new ids are made with (0 without a clock sequence)."""
        return self._clock_sequence

    @property
    def ceiling_ms(self) -> int:
        """No id is stamped after this ms until the ceiling is raised."""
        return self._ceiling

    def raise_ceiling(self, ceiling_ms: int, clock_sequence: int = 0) -> None:
        """Allow ids up to ``ceiling_ms`` (already persisted by the caller for
        ``clock_sequence``). Never lowers; a mark of another value than the current
        one (written before a switch) is ignored."""
        with self._lock:
            if clock_sequence == self._clock_sequence:
                self._raise_ceiling_locked(ceiling_ms)

    def _raise_ceiling_locked(self, ceiling_ms: int) -> None:
        # Sealed: stay sealed. Already higher: never lower. Caller holds the lock.
        if self._reserve is not None and ceiling_ms > self._ceiling:
            self._ceiling = min(ceiling_ms, self._max_ts)

    def clock_refusal(self) -> str | None:
        """Why a call would be refused for the clock now (``ClockMovedBackwardsError``),
        or None. A probe's reading: without the lock, never blocking."""
        now = self._clock()
        behind = self._last_ts - now
        if behind <= self._tolerance:
            return None
        if len(self._used_until) > 1:
            used = [*self._used_until]
            used[self._clock_sequence] = self._last_ts
            if pick_clock_sequence(used, self._clock_sequence, now) is not None:
                return None
            return (
                f"the clock is {behind} ms behind the newest id and every clock-sequence "
                f"value was used at a later time: calls are refused with InvalidSystemClock"
            )
        return (
            f"the clock is {behind} ms behind the newest id (more than --max-backwards-ms "
            f"{self._tolerance}): calls are refused with InvalidSystemClock"
        )

    def seal(self) -> int:
        """Stop issuing ids for good; return the newest timestamp used.

        Afterwards every call raises ``ReservationError``, so the returned
        timestamp is final and may be written down as the high-water mark.
        """
        with self._lock:
            self._reserve = None
            self._sealed = True
            self._ceiling = self._last_ts
            self._close_ms()
            return self._last_ts

    def next_id(self) -> int:
        """One new id. Raises ``ClockMovedBackwardsError`` or ``TimestampOverflowError``."""
        # Bound acquire/release in try/finally: measurably cheaper than `with` per id.
        if not self._acquire(False):
            self._acquire_contended()
        try:
            # The common case inline: same ms, sequence left. Everything else,
            # the clock checks first of all, is in _advance.
            now = self._clock_ns() // 1_000_000
            sequence = self._sequence + 1
            if now == self._last_ts and sequence <= self._max_sequence:
                self._sequence = sequence
            else:
                self._advance(now)
                sequence = self._sequence
            return self._base | sequence
        finally:
            self._release()

    def next_ids(self, count: int) -> list[int]:
        """``count`` new ids, increasing: 1 up to ``settings.max_batch`` (4,096 by
        default) and at most one ms worth (2^sequence_bits).

        Raises ``InvalidCountError`` for a count out of range, else as ``next_id``.
        The batch is all or nothing: an error leaves no id of it issued. A batch
        that moved to another clock sequence is sorted, so it is increasing too.
        """
        if type(count) is not int or not 1 <= count <= self._max_batch:
            raise InvalidCountError(
                f"count must be an integer in 1..{self._max_batch}, got {count!r}: "
                f"{self._batch_limit_reason}"
            )
        ids: list[int] = []
        if not self._acquire(False):
            self._acquire_contended()
        try:
            waits = (self.sequence_exhausted_waits, self.clock_backwards_waited)
            switches = self.clock_sequence_switches
            while len(ids) < count:
                self._advance(self._clock())
                first = self._sequence
                last = min(first + count - len(ids), self._max_sequence + 1) - 1
                # Ids of one ms differ only in the sequence field: a contiguous range.
                base = self._base
                ids.extend(range(base + first, base + last + 1))
                self._sequence = last
            if self.clock_sequence_switches != switches:
                ids.sort()  # a move to another clock sequence mid-batch: still increasing
            METER.owed += count * self._ms_per_id  # its share of the ids a ms can hold
        except BaseException as e:
            self._ids_before_this_ms -= len(ids)  # claimed but never handed out
            if isinstance(e, WouldBlock):  # made again elsewhere: its waits count there
                self.sequence_exhausted_waits, self.clock_backwards_waited = waits
            raise
        finally:
            self._release()
        return ids

    def _acquire_contended(self) -> None:
        """Take the lock another call holds: wait for it; on a thread that must not
        wait, a ms at most (a scrape reading the counters, the renewal raising the
        ceiling let go at once, given the GIL a blocking wait hands them), then
        ``Contended``; at once if that call is sleeping out a clock step or writing a
        clock-sequence switch under the lock."""
        if waiting_forbidden():
            # Not at all while the holder waits out a clock step or writes a switch: the
            # loop would stall a ms per try for as long as that lasts.
            if self._long_hold or not self._lock.acquire(timeout=_LOOP_WAIT_LIMIT_MS / 1000):
                raise Contended("another call holds the generator")
            return
        self._acquire()

    @property
    def ids_generated(self) -> int:
        """Ids handed out so far (exact: read under the lock)."""
        return self.counters().ids_generated

    def counters(self) -> GeneratorCounters:
        """What this generator counted so far (exact: read under the lock)."""
        with self._lock:
            return GeneratorCounters(
                ids_generated=self._ids_before_this_ms + self._sequence - self._first_sequence + 1,
                clock_backwards_waited=self.clock_backwards_waited,
                clock_backwards_refused=self.clock_backwards_refused,
                sequence_exhausted_waits=self.sequence_exhausted_waits,
                reservation_stalls=self.reservation_stalls,
                clock_sequence_switches=self.clock_sequence_switches,
                max_backward_step_ms=self.max_backward_step_ms,
            )

    def _advance(self, now: int) -> None:
        """Claim the next free (timestamp, sequence) slot, ``now`` being the clock's
        reading. The claimed sequence is left in ``self._sequence`` and the id bits of
        its ms in ``self._base``. Caller holds the lock (released while a new ceiling
        is reserved). The backwards check comes before the sequence is touched
        (Twitter #6).
        """
        last = self._last_ts
        waited_back = waited_full = False
        reserved = 0
        while True:
            if now > last:
                if now > self._ceiling:
                    try:
                        self._pass_ceiling(now, reserved)
                    except WouldBlock:
                        self._uncount(waited_full, waited_back)
                        raise
                    # Other calls ran meanwhile: start over from a fresh reading.
                    reserved += 1
                    now = self._clock()
                    last = self._last_ts
                    continue
                self._ids_before_this_ms += self._sequence - self._first_sequence + 1
                self._last_ts = now
                self._base = ((now - self._epoch) << self._ts_shift) | self._node
                self._first_sequence = self._sequence = (
                    self._randbelow(self._random_start) if self._random_start else 0
                )
                return
            elif now == last:
                if self._sequence < self._max_sequence:
                    self._sequence += 1
                    return
                if not waited_full:
                    waited_full = True
                    self.sequence_exhausted_waits += 1
                self._sleep(_EXHAUSTED_POLL_S)
            else:
                behind = last - now
                # Off the per-id path: only a clock found behind the newest id gets here.
                self.max_backward_step_ms = max(self.max_backward_step_ms, behind)
                if behind > self._tolerance:
                    if len(self._used_until) > 1:
                        self._switch_clock_sequence(now, behind, waited_full, waited_back)
                        last = self._last_ts
                        continue
                    self.clock_backwards_refused += 1
                    raise ClockMovedBackwardsError(behind)
                if behind > _LOOP_WAIT_LIMIT_MS and waiting_forbidden():
                    self._uncount(waited_full, waited_back)
                    raise WouldBlock(f"the clock is {behind} ms behind the newest id")
                if not waited_back:
                    waited_back = True
                    self.clock_backwards_waited += 1
                self._long_hold = True
                try:
                    self._sleep(behind / 1000)
                finally:
                    self._long_hold = False
            now = self._clock()

    def _switch_clock_sequence(
        self, now: int, behind: int, waited_full: bool, waited_back: bool
    ) -> None:
        """Move to the next clock-sequence value whose times ``now`` is past, its mark
        persisted first; raise ``ClockMovedBackwardsError`` if there is none. Caller
        holds the lock (and keeps it through the write: see the class docstring)."""
        current = self._clock_sequence
        used = self._used_until
        used[current] = max(used[current], self._last_ts)
        value = pick_clock_sequence(used, current + 1, now)
        if value is None:
            self.clock_backwards_refused += 1
            raise ClockMovedBackwardsError(
                behind,
                f"Clock moved backwards by {behind} milliseconds and every clock-sequence "
                f"value was used at a later time. Refusing to generate id for {behind} "
                "milliseconds",
            )
        if self._sealed:
            raise ReservationError("the generator is shut down: no more ids")
        if waiting_forbidden():
            self._uncount(waited_full, waited_back)
            raise WouldBlock(f"the clock is {behind} ms behind: a clock-sequence switch writes")
        ceiling = self._max_ts
        if self._switch is not None:
            self._long_hold = True
            try:
                ceiling = self._switch(value, now)
            finally:
                self._long_hold = False
            if ceiling < now:
                raise ReservationError(
                    f"switch({value}, {now}) returned {ceiling}, before the ms asked for"
                )
        log.warning(
            "the clock is %d ms behind the newest id: moving from clock sequence %d to %d "
            "(ids made from now on are lower than some made before)",
            behind, current, value,
        )  # fmt: skip
        self.clock_sequence_switches += 1
        # Close the current ms, then start the new value just before now: its used times
        # are all before now.
        self._close_ms()
        self._clock_sequence = value
        self._node = self._node_ids | (value << self._clock_sequence_shift)
        self._last_ts = now - 1
        self._ceiling = min(ceiling, self._max_ts)

    def _close_ms(self) -> None:
        """Take no more ids in the current ms, keeping the derived id count exact.
        Caller holds the lock."""
        self._ids_before_this_ms += self._sequence - self._first_sequence + 1
        self._first_sequence = self._max_sequence + 1
        self._sequence = self._max_sequence

    def _uncount(self, waited_full: bool, waited_back: bool) -> None:
        # A call that raises WouldBlock is made again elsewhere and counts its waits there.
        self.sequence_exhausted_waits -= waited_full
        self.clock_backwards_waited -= waited_back

    def _pass_ceiling(self, now: int, reserved: int) -> None:
        """Reserve past ``now``, with the lock released meanwhile (the caller holds it,
        and holds it again afterwards, whatever happens); ``reserved``: how often this
        call did so already."""
        if now > self._max_ts:
            raise TimestampOverflowError(
                f"the layout's timestamp bits ran out at {self._max_ts} ms"
            )
        reserve = self._reserve
        if reserve is None:
            raise ReservationError("the generator is shut down: no more ids")
        if reserved >= _RESERVES_PER_CALL:
            # The clock passed each ceiling this call was given: the writes lag it.
            raise ReservationError(
                f"no high-water mark covers ms {now} yet: the reservation reached only "
                f"ms {self._ceiling}"
            )
        if waiting_forbidden():
            raise WouldBlock(f"ms {now} needs a new reservation")
        # The background renewal fell behind: renew now, on this id's time, and
        # never under the lock (a write to ZooKeeper may take seconds).
        self.reservation_stalls += 1
        # Any move meanwhile (even one away and back to this value) makes the ceiling
        # asked for now no ceiling of the value then in use.
        switches = self.clock_sequence_switches
        self._release()
        try:
            ceiling = reserve(now)
        finally:
            self._acquire()
        if ceiling < now:
            raise ReservationError(f"reserve({now}) returned {ceiling}, before the ms asked for")
        # Another call moved to another clock sequence meanwhile (perhaps away and back):
        # this ceiling may be another value's, or an earlier stretch's of this one.
        if switches == self.clock_sequence_switches:
            self._raise_ceiling_locked(ceiling)  # sealed or raised meanwhile: kept so


class NativeStateIdGenerator(IdGenerator):
    """An :class:`IdGenerator` whose state lives in the native core's ``GeneratorState``
    (:attr:`native_state`), under its mutex, instead of in Python attributes: the one state
    of its worker, which native threads serve the common cases from (in C, without the GIL)
    while every call made from Python, and every case the fast path hands back as SLOW,
    runs this class's code on the same fields under the same mutex. Behaves exactly as an
    ``IdGenerator`` with the same arguments.

    The fast path also needs the session gate open: it starts closed, and whoever owns the
    gate opens it with ``native_state.set_gate(deadline)`` and closes it with
    ``native_state.close()``. Raises ``ConfigurationError`` where the native core is off or
    not built (:func:`snowflake_server._native.native_core`).

    While a call waits out a clock step or writes a clock-sequence switch under the mutex
    (``_long_hold``), the state says so to native threads too: their fast calls give up at
    once instead of trying the mutex.

    In a child of ``os.fork`` a generator made before the fork is unusable: every call
    raises ``RuntimeError`` (its parent goes on issuing the same ids from its own copy, and
    the mutex may be held by a thread the child does not have), and native fast calls on
    its state are SLOW. Make a new generator in the child.
    """

    # The fields the fast path reads and writes: the state's, read and written with its
    # mutex held (the lock below), as IdGenerator's own attributes are with its lock.
    _state: GeneratorState

    def __init__(self, settings: GeneratorSettings, **kwargs: object) -> None:
        from .._native import native_core

        core = native_core()
        if core is None:
            raise ConfigurationError(
                "the native core is not available (not built, or SNOWFLAKE_NO_NATIVE=1)"
            )
        layout = settings.layout
        self._state = core.GeneratorState(
            layout.epoch_ms,
            layout.timestamp_shift,
            layout.max_sequence,
            settings.sequence_start == "zero",
        )
        super().__init__(settings, **kwargs)  # type: ignore[arg-type]
        self._lock = self._state
        self._acquire = self._state.acquire
        self._release = self._state.release

    @property
    def native_state(self) -> GeneratorState:
        """The state native threads serve from (one per worker: never make another)."""
        return self._state

    @property
    def _last_ts(self) -> int:
        return self._state.last_ts

    @_last_ts.setter
    def _last_ts(self, value: int) -> None:
        self._state.last_ts = value

    @property
    def _sequence(self) -> int:
        return self._state.sequence

    @_sequence.setter
    def _sequence(self, value: int) -> None:
        self._state.sequence = value

    @property
    def _base(self) -> int:
        return self._state.base

    @_base.setter
    def _base(self, value: int) -> None:
        self._state.base = value

    @property
    def _first_sequence(self) -> int:
        return self._state.first_sequence

    @_first_sequence.setter
    def _first_sequence(self, value: int) -> None:
        self._state.first_sequence = value

    @property
    def _ids_before_this_ms(self) -> int:
        return self._state.ids_before_this_ms

    @_ids_before_this_ms.setter
    def _ids_before_this_ms(self, value: int) -> None:
        self._state.ids_before_this_ms = value

    @property
    def _ceiling(self) -> int:
        return self._state.ceiling

    @_ceiling.setter
    def _ceiling(self, value: int) -> None:
        self._state.ceiling = value

    @property
    def _node(self) -> int:
        return self._state.node

    @_node.setter
    def _node(self, value: int) -> None:
        self._state.node = value

    @property
    def _long_hold(self) -> bool:
        return self._state.long_hold

    @_long_hold.setter
    def _long_hold(self, value: bool) -> None:
        self._state.long_hold = value

    @property
    def _sealed(self) -> bool:
        return self._state.sealed

    @_sealed.setter
    def _sealed(self, value: bool) -> None:
        self._state.sealed = value
