"""Strict HTTP/1.1 request parsing for the API and the admin endpoint.

Feed a connection's bytes to a :class:`RequestParser`; it returns the requests
they complete, in order, or raises :class:`HttpError` (answer its status, then
close: what follows a request that cannot be trusted is not read)::

    parser = RequestParser()
    for request in parser.feed(data):   # pipelined: none, one or several
        ...                             # request.method, .path, .query, .keep_alive

The request line and headers are parsed by llhttp (Node.js's parser) through
``httptools``, uvicorn's fast path, rather than by hand or by ``h11``:

- cost, measured on this project's 2-core VM (CPython 3.11, httptools 0.9.0,
  h11 0.16.0, best of 5 timeit rounds): a 3-header ``GET`` costs llhttp 0.37 µs,
  this parser 0.9 µs (2.6 µs for a request unlike the connection's last), h11
  11 µs (28 µs on a reused connection, with the response cycle h11 requires);
  100 pipelined ``GET`` s in one buffer 0.28 / 0.75 / 27 µs a request;
- strictness: llhttp refuses two ``Content-Length`` headers (even equal ones),
  ``+10``, ``1_0``, ``-1``, ``Transfer-Encoding`` beside ``Content-Length``,
  bare LF line endings, obs-fold, control characters in the target; h11 accepts
  a repeated length, chunked beside a length and bare LF.

What llhttp leaves to its caller is done here: ``Host`` (exactly one on
HTTP/1.1, at most one on 1.0), the version (1.0 or 1.1; 505 for any other), an
origin-form target (``/...``; ``*`` and absolute URLs are refused), no
``Transfer-Encoding`` at all (501: an id request has no body to stream), and the
limits: the head (request line, headers, blank line) at most ``max_head`` bytes
and ``max_headers`` fields (431), a body at most ``max_body`` bytes (413).

The head limit holds however the head arrives: the parser finds where each head
ends itself (llhttp refuses a bare CR or LF, so it is the first CRLFCRLF) and
feeds llhttp one head, then exactly the body its ``Content-Length`` announced
(llhttp validated that value: plain ASCII digits), so a head trickled a byte at
a time is counted byte by byte and never more than ``max_head`` bytes of one are
held. Once llhttp has accepted a head, what it leaves to its caller is read from
the head's bytes (one callback only, for speed), and a head the same as the
last one (most clients repeat one request) reuses the last one's result. A
body is drained and ignored, never parsed as a request: a request hidden in a
body does not come out. After a request that closes the connection
(``Connection: close``, HTTP/1.0 without keep-alive, an ``Upgrade``, which is
not served) nothing more is parsed.

Never parse a header value with Python's ``int()``: it accepts ``+10``, ``1_0``
and `` 10 ``. llhttp checks ``Content-Length``; a request's ``count`` is the
API's own plain decimal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import httptools

__all__ = ["HttpError", "Request", "RequestParser"]

_END = b"\r\n\r\n"
_BAD = "bad_request"


@dataclass(frozen=True, slots=True)
class Request:
    """One request's line and what the server needs of its headers."""

    method: str
    """As sent: ``"GET"``, ``"HEAD"``, ... (llhttp accepts upper-case methods only)."""
    path: str
    """The target's path, percent-encoded as sent, e.g. ``"/v1/decode/123"``."""
    query: str
    """The raw query string after ``?``; ``""`` if none."""
    keep_alive: bool
    """False: the response must close the connection."""
    headers: tuple[tuple[str, str], ...] = ()
    """Every header as (lower-cased name, value), only from ``RequestParser(keep_headers=True)``."""


class HttpError(Exception):
    """A request that cannot be served: answer ``status`` (with ``kind`` in the JSON
    error) and close. ``str(e)`` is the message."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class RequestParser:
    """One connection's requests, parsed strictly by llhttp (httptools). Not
    reusable after :class:`HttpError` (it raises the same error again)."""

    __slots__ = (
        "_body_left",
        "_done",
        "_error",
        "_head",
        "_keep_alive",
        "_keep_headers",
        "_last",
        "_last_head",
        "_llhttp",
        "_max_body",
        "_max_head",
        "_max_headers",
        "_partial",
        "_pending",
        "_stopped",
        "_tail",
    )

    def __init__(
        self,
        *,
        max_head: int = 8192,
        max_headers: int = 64,
        max_body: int = 1024,
        keep_headers: bool = False,
    ) -> None:
        self._max_head = max_head
        self._max_headers = max_headers
        self._max_body = max_body
        self._keep_headers = keep_headers
        # Only one callback, for speed: the rest is read from the head's bytes once
        # llhttp has accepted them (it refuses a bare CR or LF, so a line is CRLF-ended).
        self._llhttp = httptools.HttpRequestParser(self)
        self._done: list[Request] = []
        self._error: HttpError | None = None  # raised: raised again by every feed
        self._stopped = False  # a request that closes the connection was parsed
        self._head = 0  # bytes of the current head fed so far
        self._partial = bytearray()  # those bytes, while the head spans feeds
        self._tail = b""  # their last 3 (a CRLFCRLF split across feeds)
        self._keep_alive: bool | None = None  # llhttp's, set when a head completes
        self._body_left = 0  # bytes of the current body not yet fed
        self._pending: Request | None = None  # its body still draining
        # The last head parsed and what came of it: most clients repeat one request.
        self._last_head = b""
        self._last: tuple[Request, int] | None = None

    @property
    def error(self) -> HttpError | None:
        """Why what followed the requests already returned cannot be served (answer it
        after them, then close), or None."""
        return self._error

    @property
    def mid_request(self) -> bool:
        """Bytes of a request not yet complete were received (for a request deadline)."""
        return bool(self._head or self._body_left) and self._error is None

    def feed(self, data: bytes) -> list[Request]:
        """The requests completed by ``data``, in order (pipelining: several, or none
        yet). Raises :class:`HttpError`; when good requests came before the bad one,
        they are returned and the error is kept (:attr:`error`, raised by the next feed)."""
        if self._error is not None:
            raise self._error
        done = self._done = []
        view = memoryview(data)
        pos, size = 0, len(data)
        try:
            while pos < size and not self._stopped:
                if self._body_left:
                    take = min(self._body_left, size - pos)
                    self._body_left -= take
                    self._execute(view[pos : pos + take])
                    pos += take
                    if not self._body_left and self._pending is not None:
                        self._complete(self._pending)
                    continue
                end = self._head_end(data, pos)
                piece = (size if end < 0 else end) - pos
                if self._head + piece > self._max_head:
                    raise HttpError(431, _BAD, f"request head over {self._max_head} bytes")
                self._head += piece
                if end < 0:
                    self._partial += view[pos:]
                    self._tail = (self._tail + data[max(pos, size - 3) :])[-3:]
                    self._execute(view[pos:])
                    break
                self._execute(data if end - pos == size else view[pos:end])
                if self._keep_alive is not None:  # a head, not blank lines before one
                    head = bytes(self._partial + view[pos:end]) if self._partial else data[pos:end]
                    self._head = 0
                    self._partial.clear()
                    self._tail = b""
                    self._headed(head)
                pos = end
        except HttpError as e:
            self._error = e
            self._stopped = True
            if not done:
                raise
            # The requests before the bad one are answered first; the error comes next.
        return done

    def _head_end(self, data: bytes, pos: int) -> int:
        """Where the head being read ends in ``data`` (after its CRLFCRLF), or -1."""
        if self._tail:
            joined = self._tail + data[pos : pos + 3]
            at = joined.find(_END)
            if at >= 0:
                return pos + at + len(_END) - len(self._tail)
        at = data.find(_END, pos)
        return at if at < 0 else at + len(_END)

    def _execute(self, piece: bytes | memoryview) -> None:
        try:
            self._llhttp.feed_data(piece)
        except httptools.HttpParserUpgrade:
            # Upgrades (h2c, websocket) are not served: the request is answered on
            # HTTP/1.1 and the connection closed; what follows it is not parsed.
            self._keep_alive = False
        except httptools.HttpParserError as e:
            raise _malformed(str(e)) from None

    def on_headers_complete(self) -> None:
        self._keep_alive = self._llhttp.should_keep_alive()

    def _headed(self, head: bytes) -> None:
        """Check a head llhttp accepted; the request is complete, or once its body is."""
        keep_alive = bool(self._keep_alive)
        self._keep_alive = None
        if head == self._last_head and self._last is not None:
            request, length = self._last  # the same bytes: the same checks, the same request
        else:
            request, length = self._check(head, keep_alive)
            self._last_head, self._last = head, (request, length)
        if self._stopped:  # an upgrade: llhttp reads no body
            self._complete(
                Request(request.method, request.path, request.query, False, request.headers)
            )
        elif length:
            self._body_left, self._pending = length, request
        else:
            self._complete(request)

    def _check(self, head: bytes, keep_alive: bool) -> tuple[Request, int]:
        """The request in a head llhttp accepted, and its body's length; or HttpError."""
        head = head.lstrip(b"\r\n")  # blank lines before a request are allowed
        line_end = head.find(b"\r\n")
        parts = head[:line_end].split(b" ")
        if len(parts) != 3:  # llhttp accepts "GET /" as HTTP/0.9
            self._refuse(400, "not an HTTP/1.x request line (method, target, version)")
        method, target, version = parts
        if version != b"HTTP/1.1" and version != b"HTTP/1.0":
            self._refuse(
                505, f"{version[:20].decode('ascii', 'replace')} is not served; use HTTP/1.1"
            )
        fields = head.count(b"\r\n") - 2  # less the request line's and the blank line's
        if fields > self._max_headers:
            self._refuse(431, f"more than {self._max_headers} header fields")
        lower = head.lower()
        hosts = lower.count(b"\r\nhost:")
        if hosts > 1:
            self._refuse(400, "more than one Host header")
        if not hosts and version == b"HTTP/1.1":
            self._refuse(400, "an HTTP/1.1 request must have a Host header")
        if b"\r\ntransfer-encoding:" in lower:
            self._refuse(501, "request bodies with Transfer-Encoding are not served")
        at = lower.find(b"\r\ncontent-length:")
        length = 0
        if at >= 0:  # one only, digits only: llhttp has checked
            at += len(b"\r\ncontent-length:")
            length = _decimal(head[at : head.find(b"\r\n", at)])
            if length > self._max_body:
                self._refuse(413, f"a request body over {self._max_body} bytes")
        if not (target.startswith(b"/") and target.isascii()) or b"#" in target:
            self._refuse(400, f"the target must be a path (/...), got {target[:80]!r}")
        path, _, query = target.decode("ascii").partition("?")
        headers = _headers(head, line_end) if self._keep_headers else ()
        return Request(method.decode("ascii"), path, query, keep_alive, headers), length

    def _complete(self, request: Request) -> None:
        self._pending = None
        self._done.append(request)
        if not request.keep_alive:
            self._stopped = True  # what follows a closing request is never parsed

    def _refuse(self, status: int, message: str) -> NoReturn:
        raise HttpError(status, _BAD, message)


def _headers(head: bytes, line_end: int) -> tuple[tuple[str, str], ...]:
    lines = head[line_end + 2 : -4].split(b"\r\n") if head.count(b"\r\n") > 2 else []
    fields = (line.partition(b":") for line in lines)
    return tuple(
        (name.lower().decode("latin-1"), value.strip(b" \t").decode("latin-1"))
        for name, _, value in fields
    )


def _malformed(reason: str) -> HttpError:
    if reason == "Invalid HTTP version":
        return HttpError(505, _BAD, "the HTTP version is not served; use HTTP/1.1")
    message = f"malformed request: {reason}"
    if "CR" in reason or "LF" in reason:
        message += " (lines must end in CRLF; a bare LF is refused)"
    return HttpError(400, _BAD, message)


def _decimal(text: bytes) -> int:
    """A plain ASCII decimal (llhttp has checked a ``Content-Length`` already)."""
    digits = text.strip(b" \t")
    if not digits.isdigit() or len(digits) > 19:  # bytes.isdigit: ASCII digits only
        raise HttpError(400, _BAD, "Content-Length is not a decimal number")
    return int(digits)
