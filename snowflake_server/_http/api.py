"""The HTTP/JSON API's routes: one whole request's bytes in, the response's bytes out.

::

    GET /v1/id?agent=A              {"id": "..."}
    GET /v1/ids?agent=A&count=N     {"ids": ["...", ...]}      (N: 1..--max-batch)
    GET /v1/decode/{id}             {"id", "time", "timestamp_ms", "datacenter_id", ...}
    GET /v1/layout                  the layout and this node's ids
    GET /v1/openapi.json            the OpenAPI document of all of the above

Ids are JSON strings: they exceed 2^53, past which JSON numbers lose digits in
JavaScript. Errors are ``{"error": kind, "message": ...}``: 400 for a bad agent,
count or id; 503 with ``Retry-After`` when this node cannot hand out ids now (its
clock, its state, its cluster session); 404, 405; 500 for a bug, never with a
traceback. The same handler as the Thrift side serves the calls: one generator,
one user-agent rule, the same per-agent counters and audit trail.

Hand-written rather than on a framework or on httptools' callback parser: a
request here is a request line and a few headers with no body, found whole by the
connection (which shares its buffering, limits, TLS and shutdown with the Thrift
connections), and parsing that takes a split or two.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, unquote

from .._errors import (
    ClockMovedBackwardsError,
    ConfigurationError,
    InvalidCountError,
    InvalidUserAgentError,
    UnavailableError,
)
from .._ids.generator import WouldBlock
from .._observability.metrics import NO_METHOD, ConnectionStats
from .._service import SnowflakeHandler
from .._state.statefile import layout_fields
from .openapi import openapi_document

__all__ = ["MAX_HEADERS", "MAX_HEAD_BYTES", "BadRequest", "HttpApi", "response"]

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
"""The longest request line and headers accepted (431 past it)."""
MAX_HEADERS = 64
"""The most header fields accepted (431 past it)."""
RETRY_AFTER_S = 1

_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    413: "Content Too Large", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}  # fmt: skip

# Each request error's status and the kind its JSON (and the metrics) name it by.
_FAILURES: tuple[tuple[type[Exception], int, str], ...] = (
    (InvalidUserAgentError, 400, "invalid_user_agent"),
    (InvalidCountError, 400, "invalid_count"),
    (ClockMovedBackwardsError, 503, "invalid_system_clock"),
    (UnavailableError, 503, "unavailable"),
)


Route = Callable[[dict[str, list[str]]], dict[str, object]]
"""Answers a request's query (parsed) with the JSON body of its 200."""


class BadRequest(Exception):
    """A request that cannot be served: answer ``status`` with ``kind``, then close
    the connection (what follows it on the wire cannot be trusted)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def response(
    status: int,
    body: dict[str, object] | bytes,
    *,
    head: bool = False,
    close: bool = False,
    headers: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """A whole HTTP/1.1 response with a JSON body (``bytes``: already encoded)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        "Cache-Control: no-store",
        *(f"{name}: {value}" for name, value in headers),
    ]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head else data)


_ID_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
    b"Cache-Control: no-store\r\n\r\n"
)
_ID_HEAD_CLOSE = _ID_HEAD[:-2] + b"Connection: close\r\n\r\n"


def error(status: int, kind: str, message: str, **kwargs: Any) -> bytes:
    return response(status, {"error": kind, "message": message}, **kwargs)


class HttpApi:
    """Serves the routes of one connection with its ``handler`` (counting into
    ``stats``). :meth:`respond` returns the response and whether to close after it;
    it raises ``WouldBlock`` (nothing issued) when the call must run off the loop,
    and ``BadRequest`` for bytes that are not a request it can serve."""

    def __init__(self, handler: SnowflakeHandler, stats: ConnectionStats) -> None:
        self._handler = handler
        self._stats = stats
        self._last_id_agent: tuple[str, str] | None = None
        # path -> (the method name it is counted under, what answers it)
        self._routes: dict[str, tuple[str, Route]] = {
            "/v1/id": ("get_id", self._id),
            "/v1/ids": ("get_ids", self._ids),
            "/v1/layout": ("get_layout", self._layout),
        }

    def id_response(self, label: str, agent: str, close: bool = False) -> bytes:
        """The response to ``GET /v1/id`` for an agent already checked and labelled:
        the common call, answered without parsing (see ``HttpConnection``)."""
        started = time.perf_counter()
        try:
            id_ = self._handler.issue_id(label, agent)
        except WouldBlock:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a JSON answer, never a drop
            return self._failed("get_id", e, started, head=False, close=close)
        self._stats.observe("get_id", time.perf_counter() - started)
        body = b'{"id": "%d"}' % id_
        return (_ID_HEAD_CLOSE if close else _ID_HEAD) % len(body) + body

    @property
    def last_id_agent(self) -> tuple[str, str] | None:
        """The (label, agent) of the last request if it was a plain ``GET /v1/id`` served."""
        return self._last_id_agent

    def respond(self, request: bytes) -> tuple[bytes, bool]:
        method, target, version, headers = _parse(request)
        close = headers.get("connection", "").lower() == "close" or (
            version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive"
        )
        head = method == "HEAD"
        if method not in ("GET", "HEAD"):
            self._stats.count_exception("unknown_method", NO_METHOD)
            return error(405, "method_not_allowed", f"{method} is not served; use GET",
                         close=close, headers=(("Allow", "GET, HEAD"),)), close  # fmt: skip
        path, _, query = target.partition("?")
        self._last_id_agent = None
        return self._route(path, query, head=head, close=close), close

    def _route(self, path: str, query: str, *, head: bool, close: bool) -> bytes:
        if path == "/v1/openapi.json":
            return response(200, openapi_document(), head=head, close=close)
        found = self._routes.get(path)
        if found is None and path.startswith("/v1/decode/"):
            found = ("decode", self._decode(unquote(path[len("/v1/decode/") :])))
        if found is None:
            self._stats.count_exception("unknown_method", NO_METHOD)
            return error(404, "not_found", f"no route {path!r}; see /v1/openapi.json",
                         head=head, close=close)  # fmt: skip
        method, route = found
        started = time.perf_counter()
        try:
            body = route(parse_qs(query, keep_blank_values=True))
        except WouldBlock:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a JSON answer, never a drop
            return self._failed(method, e, started, head=head, close=close)
        self._stats.observe(method, time.perf_counter() - started)
        return response(200, body, head=head, close=close)

    def _failed(
        self, method: str, failure: Exception, started: float, *, head: bool, close: bool
    ) -> bytes:
        """The error response to a call of ``method`` that raised ``failure``, counted."""
        status, kind = _failure(failure)
        self._stats.count_exception(kind, method)
        self._stats.observe(method, time.perf_counter() - started)
        if status == 500:
            log.error("internal error in %s", method, exc_info=failure)
        retry = (("Retry-After", str(RETRY_AFTER_S)),) if status == 503 else ()
        message = str(failure) if status != 500 else f"internal error in {method}"
        return error(status, kind, message, head=head, close=close, headers=retry)

    def _id(self, query: dict[str, list[str]]) -> dict[str, object]:
        agent = _one(query, "agent", InvalidUserAgentError)
        handler = self._handler
        label = handler.label(agent)
        id_ = handler.issue_id(label, agent)
        self._last_id_agent = (label, agent)
        return {"id": str(id_)}

    def _ids(self, query: dict[str, list[str]]) -> dict[str, object]:
        agent = _one(query, "agent", InvalidUserAgentError)
        text = _one(query, "count", InvalidCountError)
        try:
            count = int(text, 10)
        except ValueError:
            raise InvalidCountError(f"count must be an integer, got {text[:40]!r}") from None
        return {"ids": [str(i) for i in self._handler.get_ids(agent, count)]}

    def _layout(self, _query: dict[str, list[str]]) -> dict[str, object]:
        settings = self._handler.settings
        return {
            **layout_fields(settings.layout),
            "datacenter_id": settings.datacenter_id,
            "worker_id": settings.worker_id,
        }

    def _decode(self, text: str) -> Route:
        def decode(_query: dict[str, list[str]]) -> dict[str, object]:
            if not (text.isascii() and text.isdigit()) or len(text) > 20:
                raise _InvalidId(f"an id is a decimal integer, got {text[:40]!r}")
            try:
                return self._handler.settings.layout.decompose(int(text)).to_json()
            except ConfigurationError as e:
                raise _InvalidId(f"{text} is not an id of this layout: {e}") from None
            except OverflowError:  # a layout reaching past year 9999
                raise _InvalidId(f"{text} is past the dates a time can hold") from None

        return decode


class _InvalidId(Exception):
    pass


def _failure(error: Exception) -> tuple[int, str]:
    if isinstance(error, _InvalidId):
        return 400, "invalid_id"
    for cls, status, kind in _FAILURES:
        if isinstance(error, cls):
            return status, kind
    return 500, "internal_error"


def _one(query: dict[str, list[str]], name: str, missing: type[Exception]) -> str:
    values = query.get(name)
    if not values:
        raise missing(f"query parameter {name!r} is missing")
    if len(values) > 1:
        raise missing(f"query parameter {name!r} is given {len(values)} times")
    return values[0]


def _parse(request: bytes) -> tuple[str, str, str, dict[str, str]]:
    """Method, target, version and headers (names lower-cased) of a whole request head."""
    try:
        text = request.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(400, "bad_request", "the request head is not ASCII") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[1].startswith("/"):
        raise BadRequest(400, "bad_request", f"not an HTTP request line: {lines[0][:80]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(505, "bad_request", f"{version[:20]!r} is not served; use HTTP/1.1")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            break
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise BadRequest(400, "bad_request", f"malformed header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return method, target, version, headers
