"""The HTTP request parser's conformance table: raw requests and what comes of them.

The table (``CASES``) is data: docs/interface.md shows it rendered, and a test
here fails when the two differ (``python -m tests.http.test_parser`` rewrites the
docs' copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from snowflake_server._http.parser import HttpError, Request, RequestParser
from tests.docs.render import ROOT, replace_section, section

INTERFACE = ROOT / "docs" / "interface.md"
SECTION = "http-conformance"

GET = b"GET /v1/id?agent=a HTTP/1.1\r\nHost: x\r\nUser-Agent: t\r\n\r\n"
HIDDEN = b"GET /v1/ids?agent=a&count=4096 HTTP/1.1\r\nHost: x\r\n\r\n"


def _get(path: str = "/v1/id", query: str = "agent=a", keep_alive: bool = True) -> Request:
    return Request("GET", path, query, keep_alive)


@dataclass(frozen=True)
class Case:
    name: str
    raw: bytes
    expect: int | tuple[Request, ...]  # a status (HttpError), or the requests parsed
    trickled: bool = False  # fed a byte at a time rather than at once


def _with(headers: bytes, body: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return b"GET / " + version + b"\r\n" + headers + b"\r\n" + body


def _head(size: int) -> bytes:
    """A request whose head (line, headers, blank line) is ``size`` bytes."""
    raw = _with(b"Host: x\r\nX: " + b"a" * (size - 32) + b"\r\n")
    assert len(raw) == size
    return raw


def _fields(count: int) -> bytes:
    return b"Host: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(count - 1))


CASES = [
    Case("a plain GET", GET, (_get(),)),
    Case("three pipelined GETs in one piece", GET * 3, (_get(),) * 3),
    Case("a GET a byte at a time", GET, (_get(),), trickled=True),
    Case(
        "HEAD", b"HEAD /readyz HTTP/1.1\r\nHost: x\r\n\r\n", (Request("HEAD", "/readyz", "", True),)
    ),
    Case(
        "header names in any case",
        b"GET / HTTP/1.1\r\nhOsT: x\r\nCONTENT-LENGTH: 0\r\n\r\n",
        (_get("/", ""),),
    ),
    Case(
        "two different Content-Length",
        _with(b"Host: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n", b"ab"),
        400,
    ),
    Case(
        "the same Content-Length twice",
        _with(b"Host: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n", b"a"),
        400,
    ),
    Case("Content-Length: +10", _with(b"Host: x\r\nContent-Length: +10\r\n", b"0123456789"), 400),
    Case("Content-Length: 1_0", _with(b"Host: x\r\nContent-Length: 1_0\r\n", b"0123456789"), 400),
    Case("Content-Length: -1", _with(b"Host: x\r\nContent-Length: -1\r\n"), 400),
    Case("Content-Length: abc", _with(b"Host: x\r\nContent-Length: abc\r\n"), 400),
    Case(
        "Transfer-Encoding: chunked",
        _with(b"Host: x\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n"),
        501,
    ),
    Case(
        "Transfer-Encoding and Content-Length",
        _with(b"Host: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n", b"0\r\n\r\n"),
        400,
    ),
    Case(
        "a body (drained) hiding a request, then a GET",
        _with(b"Host: x\r\nContent-Length: %d\r\n" % len(HIDDEN), HIDDEN) + GET,
        (_get("/", ""), _get()),
    ),
    Case(
        "the same, a byte at a time",
        _with(b"Host: x\r\nContent-Length: %d\r\n" % len(HIDDEN), HIDDEN) + GET,
        (_get("/", ""), _get()),
        trickled=True,
    ),
    Case("a body over 1024 bytes", _with(b"Host: x\r\nContent-Length: 1025\r\n", b"a" * 1025), 413),
    Case("HTTP/1.1 without Host", b"GET /v1/id HTTP/1.1\r\n\r\n", 400),
    Case("two Host", _with(b"Host: x\r\nHost: y\r\n"), 400),
    Case("HTTP/1.0 without Host", b"GET / HTTP/1.0\r\n\r\n", (_get("/", "", keep_alive=False),)),
    Case(
        "HTTP/1.0 with keep-alive",
        _with(b"Connection: keep-alive\r\n", version=b"HTTP/1.0"),
        (_get("/", ""),),
    ),
    Case(
        "Connection: close, then a GET (not parsed)",
        _with(b"Host: x\r\nConnection: close\r\n") + GET,
        (_get("/", "", keep_alive=False),),
    ),
    Case(
        "Upgrade: h2c, then a GET (not parsed: answered on HTTP/1.1, then closed)",
        _with(b"Host: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n") + GET,
        (_get("/", "", keep_alive=False),),
    ),
    Case("bare LF line endings", b"GET / HTTP/1.1\nHost: x\n\n", 400),
    Case("a bare LF ending one header", b"GET / HTTP/1.1\r\nHost: x\n\r\n", 400),
    Case(
        "obs-fold (a header continued on the next line)", _with(b"Host: x\r\nX: a\r\n b\r\n"), 400
    ),
    Case("a request line of 2 parts", b"GET /\r\n\r\n", 400),
    Case("a request line of 4 parts", b"GET / x HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    Case("a lower-case method", b"get / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    Case("HTTP/2.0", _with(b"Host: x\r\n", version=b"HTTP/2.0"), 505),
    Case("HTTP/1.2", _with(b"Host: x\r\n", version=b"HTTP/1.2"), 505),
    Case("a head of 8192 bytes", _head(8192), (_get("/", ""),)),
    Case("a head of 8193 bytes", _head(8193), 431),
    Case("a head of 8193 bytes, a byte at a time", _head(8193), 431, trickled=True),
    Case(
        "a head never ending, over 8192 bytes",
        b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 9000,
        431,
    ),
    Case("64 header fields", _with(_fields(64)), (_get("/", ""),)),
    Case("65 header fields", _with(_fields(65)), 431),
    Case("non-ASCII in the target", "GET /v1/decode/é HTTP/1.1\r\nHost: x\r\n\r\n".encode(), 400),
    Case("a control character in the target", b"GET /v1/\x01 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    Case("a fragment in the target", b"GET /v1/id#x HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    Case("an absolute-form target", b"GET http://x/v1/id HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    Case("the target *", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
]


def run(case: Case) -> int | tuple[Request, ...]:
    parser = RequestParser()
    pieces = [case.raw[i : i + 1] for i in range(len(case.raw))] if case.trickled else [case.raw]
    got: list[Request] = []
    try:
        for piece in pieces:
            got += parser.feed(piece)
    except HttpError as e:
        assert e.kind == "bad_request" and str(e)
        return e.status
    return tuple(got)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_conformance(case: Case) -> None:
    assert run(case) == case.expect


def test_a_get_split_at_every_byte_boundary_is_the_same_request() -> None:
    for at in range(len(GET) + 1):
        parser = RequestParser()
        assert parser.feed(GET[:at]) + parser.feed(GET[at:]) == [_get()], at


def test_a_bare_lf_is_named_in_the_message() -> None:
    with pytest.raises(HttpError, match="bare LF"):
        RequestParser().feed(b"GET / HTTP/1.1\nHost: x\n\n")


def test_mid_request_is_true_while_a_request_is_incomplete() -> None:
    parser = RequestParser()
    assert not parser.mid_request
    assert parser.feed(GET[:10]) == [] and parser.mid_request
    assert parser.feed(GET[10:]) == [_get()] and not parser.mid_request
    body = _with(b"Host: x\r\nContent-Length: 5\r\n", b"ab")
    assert parser.feed(body) == [] and parser.mid_request  # in the body
    assert parser.feed(b"cde") == [_get("/", "")] and not parser.mid_request


def test_a_parser_that_refused_stays_refused() -> None:
    parser = RequestParser()
    with pytest.raises(HttpError) as first:
        parser.feed(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(HttpError) as again:
        parser.feed(GET)
    assert again.value is first.value and not parser.mid_request


def test_headers_are_kept_only_when_asked() -> None:
    raw = (
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding:  gzip \r\nACCEPT: text/plain\r\n\r\n"
    )
    assert RequestParser().feed(raw)[0].headers == ()
    (request,) = RequestParser(keep_headers=True).feed(raw)
    assert request.headers == (("host", "x"), ("accept-encoding", "gzip"), ("accept", "text/plain"))


def test_the_limits_are_the_caller_s() -> None:
    parser = RequestParser(max_head=64, max_headers=2, max_body=0)
    assert parser.feed(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n") == [_get("/", "")]
    with pytest.raises(HttpError) as refused:
        RequestParser(max_body=0).feed(_with(b"Host: x\r\nContent-Length: 1\r\n", b"a"))
    assert refused.value.status == 413
    with pytest.raises(HttpError) as refused:
        RequestParser(max_headers=2).feed(_with(_fields(3)))
    assert refused.value.status == 431


# -- the docs' copy of the table ------------------------------------------------------------


def _shown(raw: bytes) -> str:
    text = raw.decode("utf-8", "backslashreplace")
    if len(text) > 80:
        text = f"{text[:50]}… ({len(raw)} bytes)"
    text = text.replace("\r", "\\r").replace("\n", "\\n").replace("\x01", "\\x01")
    return "`" + text.replace("|", "\\|") + "`"


def _answer(expect: int | tuple[Request, ...]) -> str:
    if isinstance(expect, int):
        return f"**{expect}**, then close"
    shown = [
        f"`{r.method} {r.path}{'?' + r.query if r.query else ''}`"
        + ("" if r.keep_alive else " (then close)")
        for r in expect
    ]
    return ", ".join(shown)


def conformance_table() -> str:
    """``CASES`` as the Markdown table docs/interface.md shows."""
    rows = ["| case | raw request | fed | answer |", "|---|---|---|---|"]
    for case in CASES:
        fed = "a byte at a time" if case.trickled else "at once"
        rows.append(f"| {case.name} | {_shown(case.raw)} | {fed} | {_answer(case.expect)} |")
    return "\n" + "\n".join(rows) + "\n"


def test_the_docs_show_this_table() -> None:
    documented = section(INTERFACE.read_text(encoding="utf-8"), SECTION)
    assert documented == conformance_table(), "run `.venv/bin/python -m tests.http.test_parser`"


if __name__ == "__main__":
    INTERFACE.write_text(
        replace_section(INTERFACE.read_text(encoding="utf-8"), SECTION, conformance_table()),
        encoding="utf-8",
    )
