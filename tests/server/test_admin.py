"""The admin endpoint: the probes' answers, and prometheus_client's own exposition."""

from __future__ import annotations

import gzip
import http.client
import json
from collections.abc import Iterator

import pytest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from snowflake_server._config.settings import AdminSettings
from snowflake_server._errors import ConfigurationError
from snowflake_server._observability.admin import AdminServer


class _Calls(Collector):
    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("snowflake_calls", "Calls.", value=3)


class _State:
    def __init__(self) -> None:
        self.ready: str | None = None
        self.live: str | None = None


@pytest.fixture
def admin() -> Iterator[tuple[AdminServer, _State]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Calls())
    state = _State()
    server = AdminServer(
        registry,
        AdminSettings("127.0.0.1", 0, 10),
        ready=lambda: (state.ready, {"worker_id": 4}),
        live=lambda: state.live,
    )
    server.start()
    yield server, state
    server.stop()


def request(
    server: AdminServer, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(*server.address, timeout=5)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_readyz_and_health_say_why_ids_cannot_be_had(admin: tuple[AdminServer, _State]) -> None:
    server, state = admin
    for path in ("/readyz", "/health"):
        status, headers, body = request(server, path)
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert json.loads(body) == {"status": "ok", "worker_id": 4}
    state.ready = "draining: the node is stopping; clients should move to other nodes"
    for path in ("/readyz", "/health"):
        status, _, body = request(server, path)
        assert status == 503
        assert json.loads(body) == {"status": "unavailable", "reason": state.ready, "worker_id": 4}


def test_livez_ignores_readiness(admin: tuple[AdminServer, _State]) -> None:
    server, state = admin
    state.ready = "the ZooKeeper session is lost"
    assert request(server, "/livez")[0] == 200
    state.live = "the serving loop has not turned for 31.0 s"
    status, _, body = request(server, "/livez")
    assert status == 503 and json.loads(body)["reason"] == state.live


def test_probes_answer_head_and_refuse_other_methods(admin: tuple[AdminServer, _State]) -> None:
    server, _ = admin
    status, headers, body = request(server, "/readyz", "HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
    assert request(server, "/readyz", "POST")[0] == 405


def test_unknown_paths_name_the_routes(admin: tuple[AdminServer, _State]) -> None:
    status, _, body = request(admin[0], "/nope")
    assert status == 404 and b"/metrics, /livez, /readyz, /health" in body


def test_metrics_negotiate_openmetrics_and_gzip(admin: tuple[AdminServer, _State]) -> None:
    server, _ = admin
    status, headers, body = request(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b"snowflake_calls_total 3.0" in body
    status, headers, body = request(
        server, "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    status, headers, body = request(server, "/metrics", headers={"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip"
    assert b"snowflake_calls_total 3.0" in gzip.decompress(body)
    status, _, body = request(server, "/metrics?name[]=nothing_here")
    assert status == 200 and b"snowflake_calls" not in body


def test_a_port_in_use_is_a_configuration_error(admin: tuple[AdminServer, _State]) -> None:
    host, port = admin[0].address
    with pytest.raises(ConfigurationError, match=f"cannot listen on {host}:{port}"):
        AdminServer(
            CollectorRegistry(), AdminSettings(host, port, 10), ready=lambda: (None, {}),
            live=lambda: None,
        )  # fmt: skip
