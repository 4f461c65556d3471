"""A request a connection will not serve: one refusal for every protocol, rendered by
each in its own terms (a Thrift application error, an HTTP status), then the close.

The serving core raises it for what it decides itself (no thread to run a call, a
request not received within ``--request-timeout``); each protocol raises it for the
bytes it cannot read. What follows a refused request on the wire cannot be trusted,
so the connection closes after the answer.
"""

from __future__ import annotations

import enum

__all__ = ["Cause", "Refused"]


class Cause(enum.Enum):
    """Why a request was refused, in terms any protocol can render."""

    MALFORMED = "malformed"
    """Not a request of the protocol (HTTP 400; Thrift PROTOCOL_ERROR)."""
    TOO_LARGE = "too_large"
    """A request or its body past a limit (HTTP 413; Thrift PROTOCOL_ERROR)."""
    HEAD_TOO_LARGE = "head_too_large"
    """A request line and headers past their limit (HTTP 431)."""
    NOT_IMPLEMENTED = "not_implemented"
    """A feature of the protocol this server does not serve (HTTP 501)."""
    VERSION = "version"
    """A protocol version this server does not serve (HTTP 505)."""
    TOO_SLOW = "too_slow"
    """The request did not arrive whole within ``--request-timeout`` (HTTP 408)."""
    UNAVAILABLE = "unavailable"
    """The node cannot serve it now; another node can (HTTP 503; Thrift INTERNAL_ERROR)."""
    INTERNAL = "internal"
    """A bug, logged with its traceback (HTTP 500; Thrift INTERNAL_ERROR)."""


class Refused(Exception):
    """Answer with an error, then close. ``kind`` is what the metrics count it as
    (``protocol_error``, ``frame_too_large``, ``request_timeout``, ``unavailable``)."""

    def __init__(self, kind: str, message: str, cause: Cause = Cause.MALFORMED) -> None:
        super().__init__(message)
        self.kind = kind
        self.cause = cause
