"""Every error this package raises, under one root.

::

    SnowflakeError
    ├── ConfigurationError              bad settings, found at start-up (also a ValueError)
    ├── StartupRefused                  starting now could repeat ids: state file, clock
    ├── TimestampOverflowError          the layout's timestamp bits ran out
    └── RequestError                    a request that cannot be served; declared in the IDL
        ├── ClockMovedBackwardsError    -> InvalidSystemClock
        ├── InvalidUserAgentError       -> InvalidUserAgentError
        ├── InvalidCountError           -> InvalidCountError
        └── UnavailableError            -> UnavailableError: not serving now, try another node
            └── ReservationError        no high-water mark on disk covers the next id

The Thrift handler maps each ``RequestError`` onto the IDL exception named on
its right; anything else that escapes a call, ``TimestampOverflowError``
included, reaches the client as a Thrift application error (INTERNAL_ERROR),
never as a dropped connection.
"""

from __future__ import annotations

__all__ = [
    "ClockMovedBackwardsError",
    "ConfigurationError",
    "InvalidCountError",
    "InvalidUserAgentError",
    "RequestError",
    "ReservationError",
    "SnowflakeError",
    "StartupRefused",
    "TimestampOverflowError",
    "UnavailableError",
]


class SnowflakeError(Exception):
    """Root of every error raised by ``snowflake_server``."""


class ConfigurationError(SnowflakeError, ValueError):
    """Settings that cannot work: the message says which value and why."""


class StartupRefused(SnowflakeError):
    """Starting now could hand out ids already issued: the message says why and
    what the operator can do (fix the clock, wait, repair the state file)."""


class TimestampOverflowError(SnowflakeError):
    """The clock has run past the last ms the layout's timestamp bits can hold."""


class RequestError(SnowflakeError):
    """A request that cannot be served; the client is told why."""


class ClockMovedBackwardsError(RequestError):
    """The clock is behind the newest id already issued, by more than the tolerance.

    ``behind_ms`` is how far behind it is; ids resume once the clock passes
    the last issued timestamp.
    """

    def __init__(self, behind_ms: int) -> None:
        self.behind_ms = behind_ms
        super().__init__(
            f"Clock moved backwards.  Refusing to generate id for {behind_ms} milliseconds"
        )


class InvalidUserAgentError(RequestError):
    """The user agent is not a letter followed by letters, digits and dashes."""


class InvalidCountError(RequestError):
    """A batch size outside the allowed range."""


class UnavailableError(RequestError):
    """This node cannot hand out ids right now (not registered in ZooKeeper, session
    in doubt, high-water mark not writable, shutting down); another node can."""


class ReservationError(UnavailableError):
    """The high-water mark could not be moved past the next id's time, or the
    generator was shut down."""
