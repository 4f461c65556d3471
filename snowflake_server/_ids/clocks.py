"""The real clocks and sleep that servers inject wherever time decides a branch.

Tests inject fakes instead. What else reads the time only measures how long
something took (latency, a bounded wait), never what an id or the gate decides.
"""

from __future__ import annotations

import threading
import time

__all__ = ["boot_clock", "pause", "wall_clock_ms"]


def wall_clock_ms() -> int:
    """The system's wall clock in whole ms since the Unix epoch: what ids are stamped with."""
    return time.time_ns() // 1_000_000


def boot_clock() -> float:
    """Seconds on CLOCK_BOOTTIME: like monotonic, but it also runs while the host is
    suspended, which a ZooKeeper session's expiry does too. The session gate's clock."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


_NEVER_SET = threading.Event()


def pause(seconds: float) -> None:
    """Sleep ``seconds``: the real ``sleep`` a server gives its generator.

    Not ``time.sleep``: that is ``clock_nanosleep`` on CLOCK_MONOTONIC with an
    absolute deadline, which libfaketime (faking only the wall clock, as the
    black-box clock tests do) breaks with EINVAL. An Event wait is as precise.
    """
    _NEVER_SET.wait(seconds)
