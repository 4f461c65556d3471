"""The OpenAPI 3.0 document of the HTTP/JSON API, served at ``/v1/openapi.json``.

The test suite checks the running server against it with schemathesis, so the
document and the routes in :mod:`.api` cannot drift apart unnoticed.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping

from .._ids.layouts import LAYOUT_FIELDS
from .._version import __version__

__all__ = ["openapi_document"]


def _decimal_at_most(limit: int) -> str:
    """A pattern of the decimal strings of 0..``limit`` (leading zeros allowed): a schema
    that says only "19 digits" lets a client send ids past 2^63 - 1, which are refused."""
    digits = str(limit)
    n = len(digits)
    shorter = f"[0-9]{{1,{n - 1}}}"
    under = [
        f"{digits[:i]}[0-{int(d) - 1}][0-9]{{{n - i - 1}}}"
        for i, d in enumerate(digits)
        if d != "0"
    ]
    return "^(?:" + "|".join([shorter, *under, digits]) + ")$"


_ID = {
    "type": "string",
    "pattern": _decimal_at_most(2**63 - 1),
    "description": "An id, as a decimal string (0 .. 2^63 - 1).",
}
_AGENT = {
    "name": "agent",
    "in": "query",
    "required": True,
    "description": "Who asks: a letter, then letters, digits or '-' (at most 128).",
    "schema": {"type": "string", "pattern": "^[a-zA-Z][a-zA-Z0-9-]{0,127}$"},
}
_ERROR = {
    "type": "object",
    "required": ["error", "message"],
    "properties": {
        "error": {
            "type": "string",
            "description": "invalid_user_agent, invalid_count, invalid_id, "
            "invalid_system_clock, unavailable, not_found, method_not_allowed, "
            "bad_request, internal_error",
        },
        "message": {"type": "string"},
    },
}


def _answer(description: str, schema: Mapping[str, object]) -> dict[str, object]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, object]:
    why = {
        400: "A bad agent, count or id.",
        503: "This node cannot hand out ids now (clock, state, cluster session): ask "
        "another one, or again after Retry-After seconds.",
    }
    out: dict[str, object] = {}
    for status in statuses:
        answer = _answer(why[status], {"$ref": "#/components/schemas/Error"})
        if status == 503:
            answer["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
        out[str(status)] = answer
    return out


def _get(
    summary: str, parameters: list[object], ok: Mapping[str, object], *errors: int
) -> dict[str, object]:
    responses: dict[str, object] = {"200": _answer("OK", ok), **_errors(*errors)}
    return {"get": {"summary": summary, "parameters": parameters, "responses": responses}}


@functools.cache
def openapi_document() -> bytes:
    """The document, as the JSON bytes served."""
    decoded = {
        "type": "object",
        "required": [
            "id",
            "time",
            "timestamp_ms",
            "datacenter_id",
            "worker_id",
            "sequence",
            "clock_sequence",
        ],
        "properties": {
            "id": _ID,
            "time": {"type": "string", "description": "ISO-8601, UTC, ms precision."},
            "timestamp_ms": {"type": "integer", "description": "ms since the Unix epoch."},
            "datacenter_id": {"type": "integer", "minimum": 0},
            "worker_id": {"type": "integer", "minimum": 0},
            "sequence": {"type": "integer", "minimum": 0},
            "clock_sequence": {
                "type": "integer",
                "minimum": 0,
                "description": "The clock-sequence value (0 unless the layout has one).",
            },
        },
    }
    fields = (*LAYOUT_FIELDS, "datacenter_id", "worker_id")
    layout = {
        "type": "object",
        "required": list(fields),
        "properties": {name: {"type": "integer", "minimum": 0} for name in fields},
    }
    document = {
        "openapi": "3.0.3",
        "info": {
            "title": "snowflake-server HTTP/JSON API",
            "version": __version__,
            "description": "Unique, time-ordered 64-bit ids (Twitter Snowflake layout). Ids "
            "are JSON strings: they exceed 2^53.",
        },
        "paths": {
            "/v1/id": _get(
                "One new id.",
                [_AGENT],
                {"type": "object", "required": ["id"], "properties": {"id": _ID}},
                400,
                503,
            ),
            "/v1/ids": _get(
                "count new ids, in increasing order.",
                [
                    _AGENT,
                    {
                        "name": "count",
                        "in": "query",
                        "required": True,
                        "description": "How many: 1 to the server's --max-batch (4096).",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 4096},
                    },
                ],
                {
                    "type": "object",
                    "required": ["ids"],
                    "properties": {"ids": {"type": "array", "items": _ID}},
                },
                400,
                503,
            ),
            "/v1/decode/{id}": _get(
                "The parts of an id, under this server's layout.",
                [{"name": "id", "in": "path", "required": True, "schema": _ID}],
                decoded,
                400,
            ),
            "/v1/layout": _get("This server's id layout and ids.", [], layout),
        },
        "components": {"schemas": {"Error": _ERROR}},
    }
    return json.dumps(document, indent=1).encode()
