"""Whole HTTP/1.1 responses, for the API and the admin endpoint alike.

::

    response(200, b'{"id": "1"}')                  # JSON by default
    json_response(200, {"id": "1"}, close=True)    # ... with Connection: close
    error_response(400, "invalid_count", "count must be 1..4096")
    response(200, body, head=True)                 # HEAD: the same headers, no body

Every response carries ``Content-Type``, ``Content-Length`` and
``Cache-Control: no-store`` (an id, a probe's answer or a scrape is never to be
reused). A header name or value holding CR or LF raises ``ValueError`` rather
than letting text that reached a header split the response in two.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from http import HTTPStatus

__all__ = ["REASONS", "error_response", "json_response", "response"]

REASONS: dict[int, str] = {status.value: status.phrase for status in HTTPStatus}
"""Each status's reason phrase (RFC 9110's, where Python's still has an older name)."""
REASONS[413] = "Content Too Large"
REASONS[422] = "Unprocessable Content"


def response(
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    head: bool = False,
    close: bool = False,
    headers: Iterable[tuple[str, str]] = (),
) -> bytes:
    """A whole response: ``head`` drops the body but keeps the ``Content-Length`` a
    GET would get; ``close`` adds ``Connection: close`` (the caller closes)."""
    lines = [
        f"HTTP/1.1 {status} {REASONS[status]}",
        f"Content-Type: {_safe(content_type)}",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-store",
        *(f"{_safe(name)}: {_safe(value)}" for name, value in headers),
    ]
    if close:
        lines.append("Connection: close")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1") + (b"" if head else body)


def json_response(
    status: int,
    obj: object,
    *,
    head: bool = False,
    close: bool = False,
    headers: Iterable[tuple[str, str]] = (),
) -> bytes:
    """:func:`response` with ``obj`` as its JSON body."""
    return response(status, json.dumps(obj).encode(), head=head, close=close, headers=headers)


def error_response(
    status: int,
    kind: str,
    message: str,
    *,
    head: bool = False,
    close: bool = False,
    headers: Iterable[tuple[str, str]] = (),
) -> bytes:
    """:func:`response` with the JSON error ``{"error": kind, "message": message}``."""
    return json_response(
        status, {"error": kind, "message": message}, head=head, close=close, headers=headers
    )


def _safe(text: str) -> str:
    if "\r" in text or "\n" in text:
        raise ValueError(f"a header may not hold CR or LF (response splitting): {text[:80]!r}")
    return text
