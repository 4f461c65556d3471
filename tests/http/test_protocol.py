"""The HTTP protocol plugged into the serving core (snowflake_server/_http/protocol.py):
pipelined requests in order, closes, HEAD, and what the core does with its refusals;
through a Connection on a fake transport (tests/support/serving.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from snowflake_server._http.protocol import HttpProtocol
from snowflake_server._observability.metrics import NO_METHOD
from tests.support.serving import Driven, one_turn


class _Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)


def _responses(data: bytes, *, head_only: tuple[int, ...] = ()) -> list[_Response]:
    """The responses in ``data``, in order; those at ``head_only`` answer a HEAD (their
    Content-Length is the GET's: no body follows)."""
    out: list[_Response] = []
    while data:
        head, data = data.split(b"\r\n\r\n", 1)
        line, *fields = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (f.split(":", 1) for f in fields)}
        length = 0 if len(out) in head_only else int(headers["content-length"])
        out.append(_Response(int(line.split()[1]), headers, data[:length]))
        data = data[length:]
    return out


@pytest.fixture
def http() -> Iterator[Driven]:
    made = Driven(protocol="http")
    yield made
    made.close()


def _get(path: str, *, method: str = "GET", close: bool = False) -> bytes:
    extra = "Connection: close\r\n" if close else ""
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def test_pipelined_requests_are_answered_in_order_however_they_are_split(http: Driven) -> None:
    stream = (_get("/v1/id?agent=a") + _get("/v1/layout") + _get("/v1/ids?agent=a&count=3")) * 2
    for cut in (len(stream), 7, 1):  # all at once, then in 7-byte pieces, then byte by byte
        for start in range(0, len(stream), cut):
            http.connection.data_received(stream[start : start + cut])
        answers = _responses(http.written())
        assert [a.status for a in answers] == [200] * 6
        ids: list[int] = []
        for answer in answers:
            body = answer.json()
            ids.extend(int(i) for i in body.get("ids", [body["id"]] if "id" in body else []))
        assert "timestamp_bits" in json.dumps(answers[1].json())
        assert len(ids) == 8 and ids == sorted(set(ids))
        assert not http.transport.closed
    assert http.generator.counters().ids_generated == 24


def test_connection_close_closes_after_its_reply_and_nothing_after_is_answered(
    http: Driven,
) -> None:
    http.connection.data_received(
        _get("/v1/id?agent=a") + _get("/v1/id?agent=b", close=True) + _get("/v1/id?agent=c")
    )
    first, last = _responses(http.written())
    assert first.status == last.status == 200
    assert last.headers["connection"] == "close"
    assert http.transport.closed
    assert http.generator.counters().ids_generated == 2  # the request after it: no id


def test_head_of_an_id_is_refused_and_issues_no_id(http: Driven) -> None:
    http.connection.data_received(_get("/v1/id?agent=a", method="HEAD"))
    data = http.written()
    # No body, not even an error's: a client reads none after a HEAD, and would take
    # the bytes for its next response.
    assert data.endswith(b"\r\n\r\n"), data
    (answer,) = _responses(data, head_only=(0,))
    assert answer.status == 405
    assert answer.headers["allow"] == "GET"
    http.connection.data_received(_get("/v1/ids?agent=a&count=2", method="HEAD"))
    (answer,) = _responses(http.written(), head_only=(0,))
    assert answer.status == 405
    assert http.generator.counters().ids_generated == 0


def test_head_of_the_layout_is_its_gets_headers_without_a_body(http: Driven) -> None:
    http.connection.data_received(_get("/v1/layout", method="HEAD") + _get("/v1/layout"))
    head, get = _responses(http.written(), head_only=(0,))
    assert head.status == get.status == 200
    assert head.body == b"" and get.body
    assert head.headers == get.headers
    assert int(head.headers["content-length"]) == len(get.body)
    assert not http.transport.closed


@pytest.mark.parametrize("count", ["5_0", "+5", "%2B5", "%205", "5.0", "0x5", "%D9%A5"])
def test_a_count_is_a_plain_decimal(http: Driven, count: str) -> None:
    http.connection.data_received(_get(f"/v1/ids?agent=a&count={count}"))
    (answer,) = _responses(http.written())
    assert answer.status == 400 and answer.json()["error"] == "invalid_count"
    assert http.generator.counters().ids_generated == 0
    assert not http.transport.closed  # a declared error: the connection serves on


def test_a_malformed_request_is_refused_with_its_status_then_closed(http: Driven) -> None:
    http.connection.data_received(
        b"GET /v1/id?agent=a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
        b"Content-Length: 2\r\n\r\nab" + _get("/v1/id?agent=b")
    )
    (answer,) = _responses(http.written())
    assert answer.status == 400 and answer.headers["connection"] == "close"
    assert http.transport.closed
    assert http.generator.counters().ids_generated == 0
    assert http.metrics.totals().exceptions == {("protocol_error", NO_METHOD): 1}


@pytest.mark.parametrize(
    ("request_", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"GET /v1/id HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 501),
        (b"GET /v1/id HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    ],
)
def test_each_refusal_has_its_own_status(http: Driven, request_: bytes, status: int) -> None:
    http.connection.data_received(request_)
    (answer,) = _responses(http.written())
    assert answer.status == status and http.transport.closed


def test_a_repeated_get_of_an_id_is_answered_by_the_fast_path_and_nothing_else_is(
    http: Driven,
) -> None:
    conn = http.connection
    request = _get("/v1/id?agent=fast")
    conn.data_received(request)  # the whole way: parsed, routed, remembered
    protocol = conn.protocol
    assert isinstance(protocol, HttpProtocol) and protocol.remembered == request
    conn.data_received(request)  # the same bytes again: the fast path
    conn.data_received(request)
    first, *again = _responses(http.written())
    ids = [int(a.json()["id"]) for a in (first, *again)]
    assert len(again) == 2 and ids == sorted(set(ids))  # three ids, increasing
    assert http.generator.counters().ids_generated == 3
    # A HEAD is not the GET it resembles: 405, no id, whatever came before.
    conn.data_received(_get("/v1/id?agent=fast", method="HEAD"))
    [head] = _responses(http.written(), head_only=(0,))
    assert head.status == 405 and http.generator.counters().ids_generated == 3
    # Two of the remembered request in one read are two requests: both answered in full.
    conn.data_received(request * 2)
    assert [a.status for a in _responses(http.written())] == [200, 200]
    # Half of it, then the other half: the parser holds the first half; no replay.
    conn.data_received(request[:10])
    conn.data_received(request[10:])
    assert [a.status for a in _responses(http.written())] == [200]
    assert http.generator.counters().ids_generated == 6


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(_get("/v1/id?agent=a&x=1"), id="a query with more than the agent"),
        pytest.param(
            b"GET /v1/id?agent=a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
            id="a request with a body",
        ),
    ],
)
def test_only_a_plain_bodiless_get_of_an_id_is_remembered_for_the_fast_path(
    http: Driven, first: bytes
) -> None:
    http.connection.data_received(first)
    assert [a.status for a in _responses(http.written())] == [200]
    protocol = http.connection.protocol
    assert isinstance(protocol, HttpProtocol) and protocol.remembered != first


def test_bytes_that_end_a_request_begun_earlier_are_never_remembered(http: Driven) -> None:
    # "...Ho" then "st: x\r\n\r\n": the second read alone is no request, and must not be
    # answered as one if it comes again.
    conn = http.connection
    request = _get("/v1/id?agent=a")
    cut = request.index(b"Host") + 2
    conn.data_received(request[:cut])
    conn.data_received(request[cut:])
    assert [a.status for a in _responses(http.written())] == [200]
    conn.data_received(request[cut:])
    [answer] = _responses(http.written())
    assert answer.status == 400


def test_good_requests_before_a_malformed_one_are_answered_first(http: Driven) -> None:
    conn = http.connection
    conn.data_received(_get("/v1/id?agent=a") * 2 + b"GET / HTTP/1.1\nHost: x\n\n")
    answers = _responses(http.written())
    assert [a.status for a in answers] == [200, 200, 400]
    assert http.transport.closed


def test_a_request_that_closes_closes_whatever_follows_it_in_the_read(http: Driven) -> None:
    # More than a parse step (4 KiB) after it: never parsed, and no reason to stay open.
    http.connection.data_received(_get("/v1/layout", close=True) + b"x" * 5000)
    [answer] = _responses(http.written())
    assert answer.status == 200 and http.transport.closed


def test_the_400_after_good_requests_comes_at_the_next_turn_when_their_turn_is_spent() -> None:
    made = Driven(protocol="http", quantum=2)  # two requests a turn
    try:
        conn = made.connection
        conn.data_received(_get("/v1/id?agent=a") * 2 + b"GET / HTTP/1.1\nHost: x\n\n")
        assert [a.status for a in _responses(made.written())] == [200, 200]
        assert not made.transport.closed and len(made.turns) == 1  # the error waits its turn
        one_turn(made.loop)
        [refused] = _responses(made.written())
        assert refused.status == 400 and made.transport.closed
    finally:
        made.close()
