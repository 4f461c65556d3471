"""One HTTP/1.1 client connection on the server's event loop.

A Thrift :class:`~snowflake_server._thrift.connection.Connection` with another
framing: the same admission, back-pressure, fairness per turn, idle timeout,
TLS (reloaded by SIGHUP like the Thrift side's), calls that must wait run on a
worker thread, and the same graceful stop. Only where a request ends and what
answers it differ. Keep-alive and pipelining are served in order; a request
that cannot be trusted (malformed, too large) gets its error and a close.
"""

from __future__ import annotations

from .._ids.generator import WouldBlock
from .._observability.metrics import NO_METHOD
from .._thrift.connection import Connection, Refused, Shared
from .api import MAX_HEAD_BYTES, MAX_HEADERS, RETRY_AFTER_S, BadRequest, HttpApi, error

__all__ = ["HttpConnection"]

_END = b"\r\n\r\n"
_MAX_BODY = 1024  # a GET has none; a small one is read and ignored


class HttpConnection(Connection):
    """Serves the HTTP/JSON API to one client; see the module docstring."""

    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        self._framed = False  # no Thrift framing, and never the Thrift fast path
        self._api: HttpApi | None = None
        self._last = False  # a request asked to close after its response: none follow
        # The fast path: a request byte for byte the same as the last plain GET /v1/id
        # served (a client repeating itself, as most do) is answered without parsing.
        self._last_request = b""
        self._id_agent: tuple[str, str] = ("", "")

    def data_received(self, data: bytes) -> None:
        if data == self._last_request and self._fast_ok():
            self._read = True
            try:
                assert self._api is not None
                self._write(self._api.id_response(*self._id_agent))
                return
            except WouldBlock:
                pass  # served below, as any request that must wait
        super().data_received(data)

    def _fast_ok(self) -> bool:
        return (
            not (
                self._buf or self._busy or self._closing or self._draining or self._tls is not None
            )
            and self._writable
        )

    def _request_end(self, buf: bytearray, pos: int) -> int | None:
        if self._last:
            return None
        head_end = buf.find(_END, pos, pos + MAX_HEAD_BYTES + len(_END))
        if head_end < 0:
            if len(buf) - pos > MAX_HEAD_BYTES:
                raise Refused("protocol_error", f"request head over {MAX_HEAD_BYTES} bytes", 431)
            return None
        head = bytes(buf[pos:head_end]).lower()
        if head.count(b"\r\n") > MAX_HEADERS:
            raise Refused("protocol_error", f"more than {MAX_HEADERS} header fields", 431)
        if b"\r\ntransfer-encoding:" in head:
            raise Refused("protocol_error", "chunked request bodies are not served", 501)
        length = 0
        at = head.find(b"\r\ncontent-length:")
        if at >= 0:
            line_end = head.find(b"\r\n", at + 2)
            value = head[at + 17 : None if line_end < 0 else line_end]
            try:
                length = int(value.strip())
            except ValueError:
                raise Refused("protocol_error", "Content-Length is not a number") from None
            if not 0 <= length <= _MAX_BODY:
                raise Refused("protocol_error", f"a request body over {_MAX_BODY} bytes", 413)
        end = head_end + len(_END) + length
        return end if end <= len(buf) else None

    def _reply(self, request: bytes) -> bytes:
        api = self._api
        if api is None:
            assert self._processor is not None and self._stats is not None
            api = self._api = HttpApi(self._processor.handler, self._stats)
        head = request[: request.find(_END)]
        try:
            reply, close = api.respond(head)
        except BadRequest as e:
            raise Refused("protocol_error", str(e), e.status) from None
        if close:
            self._last = self._draining = True  # close after this reply, as asked
        agent = api.last_id_agent
        if agent is not None and not close:
            self._last_request, self._id_agent = request, agent
        return reply

    def _refuse(self, error_: Refused) -> None:
        assert self._stats is not None
        self._stats.count_exception(error_.kind, NO_METHOD)
        # A call refused for want of a thread is the node's trouble, not the request's.
        unavailable = error_.status == 503
        self._write(
            error(
                error_.status,
                "unavailable" if unavailable else "bad_request",
                str(error_),
                close=True,
                headers=(("Retry-After", str(RETRY_AFTER_S)),) if unavailable else (),
            )
        )
        self._close()
