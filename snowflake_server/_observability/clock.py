"""The kernel's view of the wall clock: is it synchronised (NTP, PTP, chrony)?

Read with ``adjtimex(2)`` in read-only mode (modes 0: no privilege needed) when
Prometheus scrapes, never on the id path. Where the call does not exist (not Linux,
no libc found) or is refused (a seccomp filter), the state is unknown and the
gauge is left out rather than guessed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

__all__ = ["STA_UNSYNC", "TIME_ERROR", "KernelClockReader", "read_kernel_clock", "synchronized"]

TIME_ERROR = 5
"""adjtimex's return value for a clock not synchronised (or its status saying so)."""
STA_UNSYNC = 0x0040
"""The status bit the kernel keeps set until a time daemon says the clock is in sync."""

KernelClockReader = Callable[[], "tuple[int, int] | None"]
"""Reads (clock state returned by adjtimex, ``status`` field), or None if unavailable."""


class _Timeval(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long))


class _Timex(ctypes.Structure):
    # glibc's struct timex (<sys/timex.h>); the trailing ints are reserved padding.
    _fields_ = (
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("constant", ctypes.c_long),
        ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long),
        ("time", _Timeval),
        ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long),
        ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long),
        ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long),
        ("tai", ctypes.c_int),
        ("_reserved", ctypes.c_int * 11),
    )


def _libc_adjtimex() -> Callable[..., int] | None:
    # The process's own symbols (libc is loaded already): no ctypes.util.find_library,
    # which runs ldconfig or a compiler in a subprocess.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    call = getattr(libc, "adjtimex", None) or getattr(libc, "ntp_adjtime", None)
    if call is None:
        return None
    call.argtypes = (ctypes.POINTER(_Timex),)
    call.restype = ctypes.c_int
    return call  # type: ignore[no-any-return]


_ADJTIMEX = _libc_adjtimex()


def read_kernel_clock() -> tuple[int, int] | None:
    """This host's (clock state, status) from ``adjtimex`` with modes 0, or None where
    the call is missing or refused."""
    if _ADJTIMEX is None:
        return None
    timex = _Timex()  # modes 0: read only
    state = _ADJTIMEX(ctypes.byref(timex))
    if state < 0:
        return None
    return state, timex.status


def synchronized(reading: tuple[int, int] | None) -> bool | None:
    """Whether the kernel calls its clock synchronised: None if it was not asked."""
    if reading is None:
        return None
    state, status = reading
    return state != TIME_ERROR and not status & STA_UNSYNC
