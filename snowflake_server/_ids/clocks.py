"""The real clocks and sleep that servers inject wherever time decides a branch.

Tests inject fakes instead. What else reads the time only measures how long
something took (latency, a bounded wait), never what an id or the gate decides.
"""

from __future__ import annotations

import threading
import time

__all__ = ["METER", "Meter", "boot_clock", "pause", "wall_clock_ms"]


def wall_clock_ms() -> int:
    """The system's wall clock in whole ms since the Unix epoch: what ids are stamped with."""
    return time.time_ns() // 1_000_000


def boot_clock() -> float:
    """Seconds on CLOCK_BOOTTIME: like monotonic, but it also runs while the host is
    suspended, which a ZooKeeper session's expiry does too. The session gate's clock."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


_NEVER_SET = threading.Event()


class Meter(threading.local):
    """What a thread's calls owe the serving loop beyond the time they took, in
    seconds (one per thread: only the loop's own is read).

    The serving core prices each request by the loop time it took plus what it
    added here (:mod:`snowflake_server._serving.fairness`): a wait for the next ms
    (:func:`pause`) is given back, since the ids it waits for were taken by others,
    and a batch of ids owes its share of the ms of ids the generator can make
    (``get_ids(4096)``: a whole ms), so that whoever takes the ids pays for them.
    """

    owed = 0.0


METER = Meter()


def pause(seconds: float) -> None:
    """Sleep ``seconds``: the real ``sleep`` a server gives its generator (the time
    slept is given back on this thread's :data:`METER`).

    Not ``time.sleep``: that is ``clock_nanosleep`` on CLOCK_MONOTONIC with an
    absolute deadline, which libfaketime (faking only the wall clock, as the
    black-box clock tests do) breaks with EINVAL. An Event wait is as precise.
    """
    started = time.perf_counter()
    _NEVER_SET.wait(seconds)
    METER.owed -= time.perf_counter() - started
