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
    │   ├── ConnectionFailedError       no connection could be opened    (also a ConnectionError)
    │   │   └── WrongProtocolError      the port answered in another protocol (HTTP, TLS...)
    │   └── CallTimedOutError           no answer in time                (also a TimeoutError)
    └── NoServerAvailableError          a pool ran out of servers, tries (also a ConnectionError)
        └── NoServerAnsweredError       every try timed out              (also a TimeoutError)

The builtin bases let a caller catch the client's failures as it catches any other
network failure (``except (ConnectionError, TimeoutError)``, or ``except OSError``),
without importing this package. The server (``snowflake_server``) adds its own errors
under the same root.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CallFailedError",
    "CallTimedOutError",
    "ClockMovedBackwardsError",
    "ConfigurationError",
    "ConnectionFailedError",
    "InvalidCountError",
    "InvalidUserAgentError",
    "NoServerAnsweredError",
    "NoServerAvailableError",
    "RequestError",
    "SnowflakeError",
    "UnavailableError",
    "WrongProtocolError",
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

    Like ``OSError(errno, ...)``, the constructor returns the subclass that the flags
    call for: :class:`CallTimedOutError` if ``timed_out``, else
    :class:`ConnectionFailedError` if not ``connected``. So every place that makes
    one, old or new, gives a caller the builtin base it expects.
    """

    def __new__(
        cls, address: str, reason: str, *, connected: bool, timed_out: bool = False
    ) -> CallFailedError:
        if cls is CallFailedError:
            if timed_out:
                cls = CallTimedOutError
            elif not connected:
                cls = ConnectionFailedError
        # The message goes to __new__ too: for the OSError subclasses, OSError.__new__
        # sets ``args`` and OSError.__init__ then does nothing.
        return super().__new__(cls, f"{address}: {reason}")

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


class ConnectionFailedError(CallFailedError, ConnectionError):
    """No connection to the server could be opened (refused, unreachable, a TLS
    handshake that failed: ``connected`` is False), or it broke during the call
    (``connected`` is True)."""


class WrongProtocolError(ConnectionFailedError):
    """What answered is not a Thrift server: its first bytes are an HTTP reply, a TLS
    record, an SSH banner or a line of text (``protocol`` says which: ``"HTTP"``,
    ``"TLS"``, ``"SSH"``, ``"text"``). Raised as soon as those bytes arrive, rather than
    after the timeout: the address names another service's port (the HTTP API's or the
    admin endpoint's, say), which no retry will change."""

    def __new__(
        cls, address: str, reason: str, *, protocol: str, connected: bool = True,
        timed_out: bool = False,
    ) -> WrongProtocolError:  # fmt: skip
        error = super().__new__(cls, address, reason, connected=True)
        assert isinstance(error, WrongProtocolError)
        return error

    def __init__(
        self, address: str, reason: str, *, protocol: str, connected: bool = True,
        timed_out: bool = False,
    ) -> None:  # fmt: skip
        #: ``"HTTP"``, ``"TLS"``, ``"SSH"`` or ``"text"``.
        self.protocol = protocol
        super().__init__(address, reason, connected=True)


class CallTimedOutError(CallFailedError, TimeoutError):
    """The server did not answer within the timeout, while connecting (``connected``
    False) or while the client waited for a reply."""


class NoServerAvailableError(SnowflakeError, ConnectionError):
    """No server could serve the call: every attempt failed (or server discovery did,
    with no earlier list to fall back on).

    ``failures`` lists ``(address, error)`` for each attempt, in order; each
    error is a :class:`CallFailedError`, or the declared error with which that
    node refused (:class:`ClockMovedBackwardsError`, say). The constructor returns a
    :class:`NoServerAnsweredError` when every failure is a :class:`CallTimedOutError`.
    """

    def __new__(
        cls, message: str, failures: Sequence[tuple[str, SnowflakeError]] = ()
    ) -> NoServerAvailableError:
        if (
            cls is NoServerAvailableError
            and failures
            and all(isinstance(error, CallTimedOutError) for _, error in failures)
        ):
            cls = NoServerAnsweredError
        return super().__new__(cls, _no_server_message(message, failures))

    def __init__(self, message: str, failures: Sequence[tuple[str, SnowflakeError]] = ()) -> None:
        self.failures = tuple(failures)
        super().__init__(_no_server_message(message, self.failures))


class NoServerAnsweredError(NoServerAvailableError, TimeoutError):
    """No server could serve the call, and every attempt timed out: the servers (or the
    network to them) are too slow for the timeout, rather than down or refusing."""


def _no_server_message(message: str, failures: Sequence[tuple[str, SnowflakeError]]) -> str:
    details = "; ".join(f"{error}" for _, error in failures)
    return f"{message}: {details}" if details else message
