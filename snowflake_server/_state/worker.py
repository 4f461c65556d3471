"""One worker id served by this process.

A :class:`Worker` is everything that makes ids for one (datacenter, worker):
the host lock, the locked state file, the high-water marks (disk, and
ZooKeeper in cluster mode), the start-up wait for the clock (or, with no mark
anywhere, the first-start wait), the generator and its reservation. Cluster
mode serves it from a slot (``_cluster/slot.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._config.settings import WorkerSettings
from .._ids.clocks import pause
from .._ids.generator import (
    IdGenerator,
    NativeStateIdGenerator,
    pick_clock_sequence,
)
from .._native import native_core
from .hostlock import HostLock
from .reservation import RESERVE_AHEAD_MS, MarkStore, Reservation, wait_for_clock
from .statefile import StateFile

if TYPE_CHECKING:
    from .._native._core import GeneratorState

__all__ = ["Worker", "generator_class"]

log = logging.getLogger(__name__)


@functools.cache
def generator_class(native: bool = True) -> type[IdGenerator]:
    """The generator a worker gets: on the native state where native threads will serve it
    (``native``) and the native core is there (said once), else the pure-Python one
    (``native_core`` says why it is not there)."""
    if not native or native_core() is None:
        return IdGenerator
    log.info("native generator state: each worker's ids come from one state in the native core")
    return NativeStateIdGenerator


@dataclass(eq=False)
class Worker:
    """Ids for one (datacenter, worker id): open with :meth:`open`, end with :meth:`close`.

    ``state`` and ``host_lock`` are held until :meth:`close`.
    """

    generator: IdGenerator
    reservation: Reservation
    state: StateFile
    host_lock: HostLock

    @property
    def worker_id(self) -> int:
        return self.generator.settings.worker_id

    @property
    def native_state(self) -> GeneratorState | None:
        """The generator's native state (None: pure Python): its gate starts closed;
        whoever serves the worker opens it (the session gate, or standalone mode)."""
        generator = self.generator
        return generator.native_state if isinstance(generator, NativeStateIdGenerator) else None

    @classmethod
    def open(
        cls,
        settings: WorkerSettings,
        worker_id: int,
        *,
        clock: Callable[[], int],
        sleep: Callable[[float], object] = pause,
        wait: Callable[[float], object] | None = None,
        remote: tuple[MarkStore, int] | None = None,
        first_start_waited: float | None = None,
        before_first_write: Callable[[], None] | None = None,
    ) -> Worker:
        """Take the worker's host lock, lock its state, honour its marks (waiting for
        the clock if it is behind them, or raising ``StartupRefused``), reserve ahead
        and start renewing. With no mark anywhere, wait ``first_start_wait`` first.
        With a clock sequence, a clock behind the marks of the value last in use
        starts with another value whose marks it is past, at once; only if there is
        none does it wait (for the value with the lowest marks) or refuse.

        ``remote`` is a second mark store and its margin (ZooKeeper in cluster
        mode): the mark of a worker id recycled from another host. Cluster mode
        waits out a worker id without a mark in ZooKeeper itself (then reads it
        again), and says so with ``first_start_waited``: the seconds it waited (None:
        ZooKeeper holds a mark).

        ``sleep`` is the generator's (waits of a ms while serving); ``wait`` (default:
        ``sleep``) the start-up waits', which a stop may end by raising
        ``StartupInterrupted``: nothing is reserved or written before they are over.

        ``before_first_write`` is called once every wait is over, right before the
        first mark is written (cluster mode confirms the cluster's layout there); if it
        raises, nothing is reserved or written and the locks are given back.
        """
        wait = sleep if wait is None else wait
        dc = settings.datacenter_id
        with contextlib.ExitStack() as undo:  # what is taken is given back if opening fails
            host_lock = HostLock.acquire(dc, worker_id, settings.host_lock_scope)
            undo.callback(host_lock.release)
            state = StateFile.open(Path(settings.state_dir), dc, worker_id, settings.layout)
            undo.callback(state.close)
            loaded = state.load(discard_corrupt=settings.discard_corrupt_state)
            found: list[MarkStore] = [state] if loaded is not None else []
            stores: list[tuple[MarkStore, int]] = [(state, RESERVE_AHEAD_MS)]
            if remote is not None:
                store, _ = remote
                if max(store.marks) >= 0:
                    found.append(store)
                stores.append(remote)
            # Per clock-sequence value, the newest mark any store holds; the value last
            # in use as the state file says (ZooKeeper's for a worker id new here).
            used = [max(marks) for marks in zip(*(store.marks for store in found), strict=True)]
            used = used or [-1] * (settings.layout.max_clock_sequence + 1)
            last = found[0].clock_sequence if found else 0
            value = last
            now = clock()
            # A clock behind by no more than a step the generator waits out is waited
            # for here too: a move would end the ids' increase for a few ms.
            if len(used) > 1 and used[last] - now > settings.max_backwards_ms:
                picked = pick_clock_sequence(used, last, now)
                if picked is None:  # no value the clock is past: wait for the lowest marks
                    value = used.index(min(used))
                else:
                    value = picked
                    log.warning(
                        "the clock is %d ms behind the high-water mark of clock sequence %d: "
                        "starting with clock sequence %d, whose ids it is past (ids made "
                        "from now on are lower than some made before)",
                        used[last] - now, last, value,
                    )  # fmt: skip
            resume_after = used[value]
            reservation = Reservation(stores, clock, clock_sequence=value)
            # Until the first reservation is stored the ceiling is the resume point:
            # no id can be stamped with a time that is not reserved.
            generator = generator_class(settings.native_state)(
                settings.generator(worker_id),
                clock=clock,
                sleep=sleep,
                resume_after_ms=resume_after,
                ceiling_ms=resume_after,
                reserve=reservation.reserve,
                clock_sequence=value,
                used_until_ms=used,
                switch=reservation.switch,
            )
            if value != last:
                generator.clock_sequence_switches = 1  # not started yet: nothing reads it
            if first_start_waited is not None:
                reservation.first_start = True
                reservation.first_start_wait_s = first_start_waited
            elif not found:
                looked_in = [store.where for store, _ in stores]
                _first_start(reservation, worker_id, looked_in, settings.first_start_wait, wait)
            if found:
                source = max(found, key=lambda store: store.marks[value]).where
                reservation.startup_wait_s = wait_for_clock(
                    resume_after, clock, wait, settings.max_startup_wait, source
                )
            if before_first_write is not None:
                before_first_write()
            generator.raise_ceiling(reservation.reserve(clock()), value)
            reservation.start(generator)
            undo.pop_all()
        return cls(generator, reservation, state, host_lock)

    def unavailable_reason(self) -> str | None:
        """Why a call would fail now (the marks cannot be written, the clock is
        refused), or None."""
        failing = self.reservation.failing
        if failing is not None:
            return f"the high-water mark cannot be written: {failing}"
        return self.generator.clock_refusal()

    def close(self) -> None:
        """Stop for good: seal the generator, store the exact last mark, unlock."""
        try:
            self.reservation.finish(self.generator)
        finally:
            self.state.close()
            self.host_lock.release()


def _first_start(
    reservation: Reservation,
    worker_id: int,
    looked_in: list[str],
    wait_s: float,
    sleep: Callable[[float], object],
) -> None:
    """No mark anywhere: a first start, or a lost state. The last run's ids (if there
    was one) are unknown, so wait as Twitter did at every start: a clock behind by
    less than the wait cannot stamp an id that run already stamped."""
    reservation.first_start = True
    where = ", ".join(looked_in)
    if wait_s <= 0:
        log.warning(
            "no high-water mark for worker %d anywhere (%s): a first start, or a lost state "
            "directory; not waiting (--first-start-wait 0): if this worker served before "
            "and the clock is now behind, ids can repeat",
            worker_id, where,
        )  # fmt: skip
        return
    log.warning(
        "no high-water mark for worker %d anywhere (%s): a first start, or a lost state "
        "directory; waiting --first-start-wait %g s before the first id, so that a clock "
        "behind by less than that cannot repeat ids a lost state covered",
        worker_id, where, wait_s,
    )  # fmt: skip
    sleep(wait_s)
    reservation.first_start_wait_s = wait_s
