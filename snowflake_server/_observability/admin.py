"""The admin HTTP endpoint: ``/metrics`` for Prometheus and ``/health`` for probes.

It runs on its own port (9990 by default, like the original's admin port) in
its own threads, so a slow scrape never delays an id.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from snowflake_thrift_client._transports import address_family

from .._config.settings import AdminSettings
from .._errors import ConfigurationError

__all__ = ["AdminServer"]

log = logging.getLogger(__name__)

Health = Callable[[], tuple[bool, dict[str, object]]]
"""Returns (healthy, details); unhealthy answers 503 so load balancers skip the node."""


class AdminServer:
    """Serves ``GET /metrics`` and ``GET /health`` as ``settings`` say, in a background
    thread. Raises ``ConfigurationError`` if the address cannot be used."""

    def __init__(
        self, registry: CollectorRegistry, health: Health, settings: AdminSettings
    ) -> None:
        self._registry = registry
        self._health = health
        admin = self

        class _Handler(BaseHTTPRequestHandler):
            server_version = "snowflake-admin"

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(admin._registry))
                elif path == "/health":
                    healthy, details = admin._health()
                    body = json.dumps({"status": "ok" if healthy else "unavailable", **details})
                    self._send(200 if healthy else 503, "application/json", body.encode())
                else:
                    self._send(404, "text/plain; charset=utf-8", b"try /metrics or /health\n")

            def _send(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                log.debug("admin %s " + format, self.client_address[0], *args)

        host, port = settings.host, settings.port
        server_cls = type(
            "_AdminHTTPServer", (ThreadingHTTPServer,), {"address_family": address_family(host)}
        )
        try:
            self._httpd = server_cls((host, port), _Handler)
        except OSError as e:
            raise ConfigurationError(f"cannot listen on {host}:{port}: {e}") from None
        self._httpd.daemon_threads = True
        # A short poll so that stop() returns quickly at shutdown.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="admin-http", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
