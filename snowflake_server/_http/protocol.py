"""The HTTP/1.1 protocol plugged into the serving core: requests parsed strictly by
:mod:`.parser`, answered by the :class:`~.api.HttpApi`, in order.

Keep-alive and pipelining are served in order; a request that cannot be trusted
(malformed, too large, too slow) gets its error status and a close. Bytes are
parsed at most ``_CHUNK`` at a time, so that the serving core prices each step
and a buffer of a thousand pipelined requests is not parsed in one go.

The fast path: a client repeating itself (most do) sends, read after read, the same
bytes of one ``GET /v1/id`` kept alive. Bytes that were exactly one such request,
parsed strictly and answered, are recognised by comparison the next time and
answered without parsing or routing (0.6 of the cost of the whole way). Only those:
a HEAD, a second request in the read, a body, a request begun in an earlier read,
a query with more than the agent, or anything else goes the whole way.
"""

from __future__ import annotations

import collections

from .._ids.generator import WouldBlock
from .._observability.metrics import ConnectionStats
from .._service import SnowflakeHandler
from .._serving.refusal import Cause, Refused
from .api import RETRY_AFTER_S, HttpApi, plain_agent
from .parser import HttpError, Request, RequestParser
from .responses import error_response

__all__ = ["HttpProtocol"]

_CHUNK = 4096
_STATUS_OF_CAUSE = {
    Cause.MALFORMED: 400,
    Cause.TOO_LARGE: 413,
    Cause.HEAD_TOO_LARGE: 431,
    Cause.NOT_IMPLEMENTED: 501,
    Cause.VERSION: 505,
    Cause.TOO_SLOW: 408,
    Cause.UNAVAILABLE: 503,
    Cause.INTERNAL: 500,
}
_CAUSE_OF_STATUS = {status: cause for cause, status in _STATUS_OF_CAUSE.items()}
_KINDS = {
    Cause.UNAVAILABLE: "unavailable",
    Cause.TOO_SLOW: "request_timeout",
    Cause.INTERNAL: "internal_error",
}


def _refused(error: HttpError) -> Refused:
    return Refused(
        "protocol_error", str(error), _CAUSE_OF_STATUS.get(error.status, Cause.MALFORMED)
    )


class HttpProtocol:
    """One connection's HTTP requests; see the module docstring."""

    def __init__(self, handler: SnowflakeHandler, stats: ConnectionStats) -> None:
        self._api = HttpApi(handler, stats)
        self._parser = RequestParser()
        self._parsed: collections.deque[Request] = collections.deque()
        self.closes = False
        self._whole: tuple[bytes, Request] | None = None  # one read that was one request
        self._repeat = b"\xff"  # the bytes of the last plain GET /v1/id answered
        self._repeat_query = ""

    @property
    def remembered(self) -> bytes | None:
        """The bytes the fast path answers if they come again in one read (the last
        plain ``GET /v1/id`` that came whole in one read), or None."""
        return None if self._repeat == b"\xff" else self._repeat

    def fast(self, data: bytes) -> bytes | None:
        parser = self._parser
        if data != self._repeat or self._parsed or parser.mid_request or parser.error:
            return None
        try:
            return self._api.id_response(self._repeat_query)
        except WouldBlock:
            return None  # served the whole way, where it may wait on a thread

    def pending(self, buf: bytearray) -> bool:
        if self.closes:
            return False  # nothing after a request that closes is served
        parser = self._parser
        return bool(buf or self._parsed) or parser.mid_request or parser.error is not None

    def next_request(self, buf: bytearray, pos: int) -> tuple[Request | None, int]:
        if self.closes:
            return None, pos  # after a request that closes, nothing more is served
        if self._parsed:
            return self._parsed.popleft(), pos
        if self._parser.error is not None:  # after the requests before it were answered
            raise _refused(self._parser.error)
        if pos == len(buf):
            return None, pos
        end = min(len(buf), pos + _CHUNK)
        chunk = bytes(buf[pos:end])
        idle = not self._parser.mid_request
        try:
            parsed = self._parser.feed(chunk)
        except HttpError as e:
            raise _refused(e) from None
        # Bytes that were exactly one request, with no body and nothing of another
        # before or after them: what the fast path may recognise next time.
        whole = (
            idle
            and len(parsed) == 1
            and pos == 0
            and end == len(buf)
            and not self._parser.mid_request
            and chunk.find(b"\r\n\r\n") == len(chunk) - 4
        )
        self._whole = (chunk, parsed[0]) if whole else None
        self._parsed.extend(parsed)
        return (self._parsed.popleft() if self._parsed else None), end

    def reply(self, request: Request) -> bytes:
        reply = self._api.respond(request)
        if not request.keep_alive:
            self.closes = True
        whole = self._whole
        if (
            whole is not None
            and whole[1] is request
            and request.method == "GET"
            and request.path == "/v1/id"
            and request.keep_alive
            and plain_agent(request.query)  # no query worth parsing: a replay costs little
        ):
            self._repeat, self._repeat_query = whole[0], request.query
        return reply

    def refusal(self, error: Refused) -> bytes:
        status = _STATUS_OF_CAUSE[error.cause]
        kind = _KINDS.get(error.cause, "bad_request")
        retry = (("Retry-After", str(RETRY_AFTER_S)),) if status == 503 else ()
        return error_response(status, kind, str(error), close=True, headers=retry)
