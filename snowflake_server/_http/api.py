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

``HEAD`` is answered with headers only where that is free of effects (the
layout, a decode, the OpenAPI document); on ``/v1/id`` and ``/v1/ids`` it is
refused (405): its headers would need an id issued and thrown away.

Requests come parsed (:mod:`.parser`); the connection, its limits, TLS and stop
are the serving core's. Not on a web framework: the routes are four, and a
framework's request objects and middleware would cost more than the call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from urllib.parse import parse_qs, unquote

from .._errors import (
    ClockMovedBackwardsError,
    ConfigurationError,
    InvalidCountError,
    InvalidUserAgentError,
    UnavailableError,
)
from .._ids.generator import WouldBlock
from .._ids.layouts import layout_fields, parse_id
from .._observability.metrics import NO_METHOD, ConnectionStats
from .._service import SnowflakeHandler
from .openapi import openapi_document
from .parser import Request
from .responses import error_response, json_response, response

__all__ = ["RETRY_AFTER_S", "HttpApi", "plain_agent"]

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1

# Each request error's status and the kind its JSON (and the metrics) name it by.
_FAILURES: tuple[tuple[type[Exception], int, str], ...] = (
    (InvalidUserAgentError, 400, "invalid_user_agent"),
    (InvalidCountError, 400, "invalid_count"),
    (ClockMovedBackwardsError, 503, "invalid_system_clock"),
    (UnavailableError, 503, "unavailable"),
)
_ISSUES_IDS = frozenset({"/v1/id", "/v1/ids"})


Route = Callable[[dict[str, list[str]]], dict[str, object]]
"""Answers a request's query (parsed) with the JSON body of its 200."""


_ID_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
    b"Cache-Control: no-store\r\n\r\n"
)
_ID_HEAD_CLOSE = _ID_HEAD[:-2] + b"Connection: close\r\n\r\n"


class HttpApi:
    """Serves the routes of one connection with its ``handler`` (counting into
    ``stats``): a parsed request in, the whole response out (:meth:`respond`)."""

    def __init__(self, handler: SnowflakeHandler, stats: ConnectionStats) -> None:
        self._handler = handler
        self._stats = stats
        # path -> (the method name it is counted under, what answers it)
        self._routes: dict[str, tuple[str, Route]] = {
            "/v1/ids": ("get_ids", self._ids),
            "/v1/layout": ("get_layout", self._layout),
        }

    def respond(self, request: Request) -> bytes:
        """The whole response to ``request`` (closing the connection after it unless
        the request keeps it alive). Raises ``WouldBlock``, nothing issued, when the
        call must run off the loop."""
        close = not request.keep_alive
        method, path = request.method, request.path
        if method == "GET" and path == "/v1/id":
            return self.id_response(request.query, close)
        if method != "GET" and not (method == "HEAD" and path not in _ISSUES_IDS):
            self._stats.count_exception("unknown_method", NO_METHOD)
            allow = "GET" if path in _ISSUES_IDS else "GET, HEAD"
            why = "HEAD would issue an id; use GET" if method == "HEAD" else f"use {allow}"
            return error_response(405, "method_not_allowed", f"{method} is not served: {why}",
                                  head=method == "HEAD", close=close,
                                  headers=(("Allow", allow),))  # fmt: skip
        return self._route(path, request.query, head=method == "HEAD", close=close)

    def id_response(self, query: str, close: bool = False) -> bytes:
        """``GET /v1/id``: the common call, its agent read without parsing the query
        when it is the only parameter and needs no decoding."""
        started = time.perf_counter()
        try:
            agent = query[6:] if plain_agent(query) else _one(_query(query), "agent",
                                                                InvalidUserAgentError)  # fmt: skip
            handler = self._handler
            id_ = handler.issue_id(handler.label(agent), agent)
        except WouldBlock:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a JSON answer, never a drop
            return self._failed("get_id", e, started, head=False, close=close)
        self._stats.observe("get_id", time.perf_counter() - started)
        body = b'{"id": "%d"}' % id_
        return (_ID_HEAD_CLOSE if close else _ID_HEAD) % len(body) + body

    def _route(self, path: str, query: str, *, head: bool, close: bool) -> bytes:
        if path == "/v1/openapi.json":
            return response(200, openapi_document(), head=head, close=close)
        found = self._routes.get(path)
        if found is None and path.startswith("/v1/decode/"):
            found = ("decode", self._decode(unquote(path[len("/v1/decode/") :])))
        if found is None:
            self._stats.count_exception("unknown_method", NO_METHOD)
            return error_response(404, "not_found", f"no route {path!r}; see /v1/openapi.json",
                         head=head, close=close)  # fmt: skip
        method, route = found
        started = time.perf_counter()
        try:
            body = route(_query(query))
        except WouldBlock:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a JSON answer, never a drop
            return self._failed(method, e, started, head=head, close=close)
        self._stats.observe(method, time.perf_counter() - started)
        return json_response(200, body, head=head, close=close)

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
        return error_response(status, kind, message, head=head, close=close, headers=retry)

    def _ids(self, query: dict[str, list[str]]) -> dict[str, object]:
        agent = _one(query, "agent", InvalidUserAgentError)
        text = _one(query, "count", InvalidCountError)
        if not (text.isascii() and text.isdigit()) or len(text) > 10:
            # A plain decimal: int() would take "+10", "1_0" and " 10".
            raise InvalidCountError(f"count must be a decimal integer, got {text[:40]!r}")
        count = int(text)
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
            try:
                value = parse_id(text)
            except ConfigurationError as e:
                raise _InvalidId(f"{text[:40]!r} is not an id: {e}") from None
            try:
                return self._handler.settings.layout.decompose(value).to_json()
            except ConfigurationError as e:
                raise _InvalidId(f"{value} is not an id of this layout: {e}") from None
            except OverflowError:  # a layout reaching past year 9999
                raise _InvalidId(f"{value} is past the dates a time can hold") from None

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


def plain_agent(query: str) -> bool:
    """Whether ``query`` is ``agent=...`` alone, with nothing to decode."""
    return query.startswith("agent=") and not any(c in query for c in "&%+;")


def _query(query: str) -> dict[str, list[str]]:
    return parse_qs(query, keep_blank_values=True)
