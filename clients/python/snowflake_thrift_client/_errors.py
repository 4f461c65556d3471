"""Every error of the snowflake client and server, under one root.

::

    SnowflakeError
    ├── ConfigurationError              a value that cannot work (also a ValueError)
    ├── RequestError                    a call the server refused; declared in the IDL
    │   ├── ClockMovedBackwardsError    <- InvalidSystemClock
    │   ├── InvalidUserAgentError       <- InvalidUserAgentError
    │   ├── InvalidCountError           <- InvalidCountError
    │   └── UnavailableError            <- UnavailableError: not serving now, try another node
    ├── CallFailedError                 a call to one server failed any other way
    └── NoServerAvailableError          a pool ran out of servers or attempts

The server (``snowflake_server``) adds its own errors under the same root.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CallFailedError",
    "ClockMovedBackwardsError",
    "ConfigurationError",
    "InvalidCountError",
    "InvalidUserAgentError",
    "NoServerAvailableError",
    "RequestError",
    "SnowflakeError",
    "UnavailableError",
]


class SnowflakeError(Exception):
    """Root of every error raised by the snowflake client and server."""


class ConfigurationError(SnowflakeError, ValueError):
    """A value that cannot work (a layout, an address, a setting): the message says
    which value and why."""


class RequestError(SnowflakeError):
    """A request that cannot be served; the client is told why."""


class ClockMovedBackwardsError(RequestError):
    """The clock is behind the newest id already issued, by more than the tolerance.

    ``behind_ms`` is how far behind it is; ids resume once the clock passes
    the last issued timestamp.
    """

    def __init__(self, behind_ms: int, message: str | None = None) -> None:
        self.behind_ms = behind_ms
        super().__init__(
            message
            or f"Clock moved backwards.  Refusing to generate id for {behind_ms} milliseconds"
        )


class InvalidUserAgentError(RequestError):
    """The user agent is not a letter followed by letters, digits and dashes."""


class InvalidCountError(RequestError):
    """A batch size outside the allowed range."""


class UnavailableError(RequestError):
    """This node cannot hand out ids right now (not registered in ZooKeeper, session
    in doubt, high-water mark not writable, shutting down); another node can."""


class CallFailedError(SnowflakeError):
    """A call to one server failed for a reason the IDL does not declare.

    The cause (a timeout, a refused or dropped connection, a Thrift application
    error...) is ``__cause__``. The connection was discarded.
    """

    def __init__(
        self, address: str, reason: str, *, connected: bool, timed_out: bool = False
    ) -> None:
        self.address = address
        #: False if no connection could be opened at all.
        self.connected = connected
        #: True if the server did not answer within the timeout.
        self.timed_out = timed_out
        #: What went wrong, in a few words.
        self.reason = reason
        super().__init__(f"{address}: {reason}")


class NoServerAvailableError(SnowflakeError):
    """No server could serve the call: every attempt failed.

    ``failures`` lists ``(address, error)`` for each attempt, in order; each
    error is a :class:`CallFailedError`, or the declared error with which that
    node refused (:class:`ClockMovedBackwardsError`, say).
    """

    def __init__(self, message: str, failures: Sequence[tuple[str, SnowflakeError]] = ()) -> None:
        self.failures = tuple(failures)
        details = "; ".join(f"{error}" for _, error in self.failures)
        super().__init__(f"{message}: {details}" if details else message)
