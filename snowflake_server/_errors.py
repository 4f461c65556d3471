"""The server's errors, under the one root the client package defines.

::

    SnowflakeError                          (snowflake_thrift_client)
    ├── ConfigurationError                  bad settings, found at start-up (also a ValueError)
    ├── StartupRefused                      starting could repeat ids: state file, clock (exit 3)
    ├── StartupDeferred                     cannot start yet, nothing unsafe: try again (exit 75)
    ├── StartupInterrupted                  a stop signal arrived while starting (exit 0)
    ├── TimestampOverflowError              the layout's timestamp bits ran out
    └── RequestError                        a request that cannot be served; declared in the IDL
        ├── ClockMovedBackwardsError        -> InvalidSystemClock
        ├── InvalidUserAgentError           -> InvalidUserAgentError
        ├── InvalidCountError               -> InvalidCountError
        └── UnavailableError                -> UnavailableError: not serving now, try another node
            └── ReservationError            no high-water mark on disk covers the next id

The Thrift handler maps each ``RequestError`` onto the IDL exception named on
its right; anything else that escapes a call, ``TimestampOverflowError``
included, reaches the client as a Thrift application error (INTERNAL_ERROR),
never as a dropped connection.
"""

from __future__ import annotations

from snowflake_thrift_client import (
    ClockMovedBackwardsError,
    ConfigurationError,
    InvalidCountError,
    InvalidUserAgentError,
    RequestError,
    SnowflakeError,
    UnavailableError,
)

__all__ = [
    "ClockBehindMark",
    "ClockMovedBackwardsError",
    "ConfigurationError",
    "InvalidCountError",
    "InvalidUserAgentError",
    "RequestError",
    "ReservationError",
    "SnowflakeError",
    "StartupDeferred",
    "StartupInterrupted",
    "StartupRefused",
    "TimestampOverflowError",
    "UnavailableError",
]


class StartupRefused(SnowflakeError):
    """Starting now could hand out ids already issued: the message says why and
    what the operator can do (fix the clock, wait, repair the state file)."""


class StartupDeferred(SnowflakeError):
    """Starting failed for a reason that passes by itself (a peer that cannot be
    checked yet, ZooKeeper failing mid-start): nothing would be unsafe, but nothing
    was served either. Exit 75 (``EX_TEMPFAIL``): a supervisor should try again
    after a delay."""


class StartupInterrupted(SnowflakeError):
    """A stop (SIGTERM, SIGINT) arrived while the node was starting: what was opened
    is closed again, no mark was written by a node that had not reserved, and the
    process exits 0."""


class ClockBehindMark(StartupRefused):
    """The clock is further behind a high-water mark than ``--max-startup-wait``:
    ``behind_ms`` behind the mark in ``source``. With ``--worker-id auto`` another
    worker id is taken instead (a clock that jumped forward used this one)."""

    def __init__(self, message: str, behind_ms: int, source: str) -> None:
        super().__init__(message)
        self.behind_ms = behind_ms
        self.source = source


class TimestampOverflowError(SnowflakeError):
    """The clock has run past the last ms the layout's timestamp bits can hold."""


class ReservationError(UnavailableError):
    """The high-water mark could not be moved past the next id's time, or the
    generator was shut down."""
