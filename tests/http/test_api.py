"""The HTTP/JSON API against a real server in this process: routes, errors, limits,
keep-alive, TLS, and the OpenAPI document checked by schemathesis."""

from __future__ import annotations

import json
import re
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snowflake_server import ServerSettings, decompose
from snowflake_server._http.openapi import openapi_document
from snowflake_server._observability.metrics import HTTP_METHODS
from tests.support.fakes import FakeClock
from tests.support.inprocess import InProcessServer
from tests.support.processes import failures, parse_metrics

T0 = 1_800_000_000_000


class Http:
    """A server with its HTTP/JSON API on, and a way to call it."""

    def __init__(self, server: InProcessServer) -> None:
        self.server = server
        address = server.node.http_address
        assert address is not None
        self.host, self.port = address

    def get(self, path: str, context: ssl.SSLContext | None = None) -> tuple[int, Any, Any]:
        scheme = "https" if context else "http"
        url = f"{scheme}://{self.host}:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5, context=context) as answer:
                return answer.status, answer.headers, json.loads(answer.read())
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.headers, json.loads(e.read())

    def raw(self, data: bytes) -> bytes:
        """Send ``data`` on a connection of its own; all it gets until the server closes."""
        with socket.create_connection((self.host, self.port), timeout=5) as sock:
            sock.sendall(data)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def http(tmp_path: Path, clock: FakeClock) -> Iterator[Http]:
    settings_ = ServerSettings(http_port=0, worker_id=3, datacenter_id=2, max_backwards_ms=5)
    with InProcessServer(settings_, tmp_path, clock=clock) as server:
        yield Http(server)


def test_ids_as_json_strings(http: Http, clock: FakeClock) -> None:
    status, _, body = http.get("/v1/id?agent=web")
    assert status == 200 and isinstance(body["id"], str)
    parts = decompose(int(body["id"]))
    assert (parts.timestamp_ms, parts.datacenter_id, parts.worker_id) == (T0, 2, 3)
    status, _, body = http.get("/v1/ids?agent=web&count=5")
    ids = [int(i) for i in body["ids"]]
    assert status == 200 and len(ids) == 5 and ids == sorted(set(ids)) and ids[0] > int(parts.id)


def test_decode_and_layout(http: Http) -> None:
    status, _, body = http.get("/v1/decode/1541815603606036480")  # seed 003's example
    assert status == 200 and body == decompose(1541815603606036480).to_json()
    status, _, body = http.get("/v1/layout")
    assert status == 200 and body == {
        "epoch_ms": 1288834974657, "timestamp_bits": 41, "datacenter_id_bits": 5,
        "worker_id_bits": 5, "sequence_bits": 12, "clock_sequence_bits": 0,
        "datacenter_id": 2, "worker_id": 3,
    }  # fmt: skip
    status, _, body = http.get("/v1/openapi.json")
    assert status == 200 and body["openapi"].startswith("3.0")


@pytest.mark.parametrize(
    ("path", "status", "kind"),
    [
        ("/v1/id", 400, "invalid_user_agent"),
        ("/v1/id?agent=1bad", 400, "invalid_user_agent"),
        ("/v1/id?agent=a&agent=b", 400, "invalid_user_agent"),
        ("/v1/ids?agent=web", 400, "invalid_count"),
        ("/v1/ids?agent=web&count=0", 400, "invalid_count"),
        ("/v1/ids?agent=web&count=4097", 400, "invalid_count"),
        ("/v1/ids?agent=web&count=ten", 400, "invalid_count"),
        ("/v1/decode/abc", 400, "invalid_id"),
        ("/v1/decode/99999999999999999999", 400, "invalid_id"),
        ("/v1/nope", 404, "not_found"),
    ],
)
def test_bad_requests_get_json_errors(http: Http, path: str, status: int, kind: str) -> None:
    got, _, body = http.get(path)
    assert (got, body["error"]) == (status, kind) and body["message"]


def test_a_clock_behind_is_a_503_with_retry_after(http: Http, clock: FakeClock) -> None:
    assert http.get("/v1/id?agent=web")[0] == 200
    clock.now -= 10_000
    status, headers, body = http.get("/v1/id?agent=web")
    assert (status, body["error"], headers["Retry-After"]) == (503, "invalid_system_clock", "1")
    counts = parse_metrics(http.server.metrics())
    assert (
        counts[
            'snowflake_requests_total{method="get_id",outcome="invalid_system_clock",protocol="http"}'
        ]
        == 1
    )
    assert failures(counts, "invalid_system_clock") == 1


def test_http_calls_share_the_thrift_sides_counters(http: Http) -> None:
    http.get("/v1/ids?agent=web&count=7")
    http.server.raw_client().get_id("web")
    counts = parse_metrics(http.server.metrics())
    assert counts['snowflake_ids_by_agent_total{agent="web"}'] == 8
    assert counts['snowflake_requests_total{method="get_ids",outcome="ok",protocol="http"}'] == 1


def test_calls_are_counted_under_the_protocol_that_served_them(http: Http) -> None:
    http.get("/v1/ids?agent=web&count=7")
    http.get("/v1/decode/1")
    http.server.raw_client().get_id("web")
    counts = parse_metrics(http.server.metrics())
    ok = 'snowflake_requests_total{{method="{}",outcome="ok",protocol="{}"}}'
    assert [counts[ok.format(m, p)] for m, p in [("get_ids", "http"), ("get_ids", "thrift"),
                                                ("get_id", "thrift"), ("get_id", "http"),
                                                ("decode", "http")]] == [1, 0, 1, 0, 1]  # fmt: skip
    latency = 'snowflake_request_duration_seconds_count{{method="{}",protocol="{}"}}'
    assert counts[latency.format("decode", "http")] == 1
    assert counts[latency.format("get_id", "thrift")] == 1
    # Every HTTP method has its series from the start, and only HTTP's are under http.
    served = {k.split('"')[1] for k in counts if k.startswith("snowflake_requests_total{")
              and k.endswith('protocol="http"}')}  # fmt: skip
    assert served == set(HTTP_METHODS)


def test_keep_alive_serves_pipelined_requests_in_order(http: Http) -> None:
    requests = (
        b"GET /v1/layout HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /v1/id?agent=pipe HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /v1/decode/0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        b"GET /v1/id?agent=never HTTP/1.1\r\n\r\n"  # after the close: not served
    )
    answer = http.raw(requests)
    assert answer.count(b"HTTP/1.1 200 OK") == 3
    assert answer.index(b'"epoch_ms"') < answer.index(b'{"id": "') < answer.index(b'"sequence"')
    assert b"Connection: close" in answer


@pytest.mark.parametrize(
    ("request_", "status"),
    [
        (b"POST /v1/id?agent=a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"405"),
        (b"GET /v1/id HTTP/2.0\r\n\r\n", b"505"),
        (b"NOT A REQUEST\r\n\r\n", b"400"),
        (b"GET /v1/id HTTP/1.1\r\nbad header\r\n\r\n", b"400"),
        (b"GET /v1/id HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"501"),
        (b"GET /v1/id HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n", b"413"),
        (b"GET /v1/id HTTP/1.1\r\nContent-Length: x\r\n\r\n", b"400"),
        (b"GET /v1/id HTTP/1.1\r\n" + b"X: y\r\n" * 70 + b"\r\n", b"431"),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", b"431"),
        (b"GET /\xff HTTP/1.1\r\n\r\n", b"400"),
    ],
)
def test_requests_it_cannot_serve_get_an_error(http: Http, request_: bytes, status: bytes) -> None:
    answer = http.raw(request_)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"] and body["message"]
    assert http.get("/v1/id?agent=after")[0] == 200, "and serves everyone else"


def test_head_answers_without_a_body(http: Http) -> None:
    answer = http.raw(b"HEAD /v1/layout HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and body == b""
    assert int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]) > 0


def test_https_with_the_servers_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    pem = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    settings_ = ServerSettings(http_port=0, tls_cert=str(pem))
    with InProcessServer(settings_, tmp_path) as server:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        status, _, body = Http(server).get("/v1/id?agent=tls", context)
        assert status == 200 and int(body["id"]) > 0


SCHEMA = schemathesis.openapi.from_dict(json.loads(openapi_document()))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings_ = ServerSettings(http_port=0)
    with InProcessServer(settings_, tmp_path_factory.mktemp("live")) as server:
        yield "http://{}:{}".format(*Http(server).server.node.http_address or ("", 0))


@SCHEMA.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_server_keeps_to_its_openapi_document(case: Any, live: str) -> None:
    case.call_and_validate(base_url=live)


def exchange(sock: socket.socket, request: bytes) -> tuple[bytes, dict[str, Any]]:
    """Send one request on a kept-alive connection; its status line and JSON body."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0], json.loads(body)


def test_a_request_repeated_on_one_connection_is_served_alike(http: Http, clock: FakeClock) -> None:
    request = b"GET /v1/id?agent=again HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((http.host, http.port), timeout=5) as sock:
        answers = [exchange(sock, request) for _ in range(3)]
        clock.now -= 10_000  # the same request, now refused: the error, counted once
        refused = exchange(sock, request)
    assert [status for status, _ in answers] == [b"HTTP/1.1 200 OK"] * 3
    ids = [int(body["id"]) for _, body in answers]
    assert ids == sorted(set(ids))
    assert refused == (
        b"HTTP/1.1 503 Service Unavailable",
        {"error": "invalid_system_clock", "message": refused[1]["message"]},
    )
    counts = parse_metrics(http.server.metrics())
    assert counts['snowflake_ids_by_agent_total{agent="again"}'] == 3
    assert counts['snowflake_requests_total{method="get_id",outcome="ok",protocol="http"}'] == 3
    assert counts['snowflake_clock_backwards_total{action="refused"}'] == 1
    assert failures(counts, "invalid_system_clock") == 1


_ID_PATTERN = re.compile(
    json.loads(openapi_document())["paths"]["/v1/decode/{id}"]["get"]["parameters"][0]["schema"][
        "pattern"
    ]
)
_LARGEST_ID = 2**63 - 1


@given(st.integers(min_value=0, max_value=10**19 - 1), st.booleans())
def test_the_documented_id_is_exactly_a_63_bit_id(n: int, padded: bool) -> None:
    """A schema of "up to 19 digits" let clients (schemathesis among them) send ids past
    2^63 - 1, which the server refuses with 400: the document now says what it accepts."""
    text = str(n).zfill(19) if padded else str(n)
    assert bool(_ID_PATTERN.match(text)) == (n <= _LARGEST_ID)


@pytest.mark.parametrize("n", [0, 9, _LARGEST_ID, _LARGEST_ID - 1, _LARGEST_ID + 1, 10**19 - 1])
def test_the_documented_id_at_its_edges(n: int) -> None:
    assert bool(_ID_PATTERN.match(str(n))) == (n <= _LARGEST_ID)
