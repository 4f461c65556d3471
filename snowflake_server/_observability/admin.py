"""The admin HTTP endpoint: ``/metrics`` for Prometheus, ``/livez`` and ``/readyz``
(``/health``: an alias of ``/readyz``) for probes.

``/metrics`` is prometheus_client's own WSGI app, so content negotiation
(OpenMetrics for a scraper that asks for it), gzip and ``name[]`` filters are
the library's; this module only routes the probes beside it. It runs on its
own port (9990 by default, like the original's admin port) in its own threads,
so a slow scrape never delays an id.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import CollectorRegistry
from snowflake_thrift_client._transports import address_family

from .._config.settings import AdminSettings
from .._errors import ConfigurationError

__all__ = ["AdminServer", "Live", "Ready"]

log = logging.getLogger(__name__)

Ready = Callable[[], tuple[str | None, dict[str, object]]]
"""Why ids cannot be had now (None: they can), and details for the probe's body."""
Live = Callable[[], str | None]
"""Why the process is wedged, or None while it works."""

_JSON = "application/json"
_ROUTES = "/metrics, /livez, /readyz, /health"


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("admin %s " + format, self.client_address[0], *args)


class AdminServer:
    """Serves the admin endpoint as ``settings`` say, in a background thread.

    Raises ``ConfigurationError`` if the address cannot be used.
    """

    def __init__(
        self, registry: CollectorRegistry, settings: AdminSettings, *, ready: Ready, live: Live
    ) -> None:
        self._metrics = make_wsgi_app(registry)
        self._ready = ready
        self._live = live
        host, port = settings.host, settings.port
        server_cls = type("_AdminServer", (_Server,), {"address_family": address_family(host)})
        try:
            self._httpd: WSGIServer = make_server(host, port, self._app, server_cls, _Handler)
        except OSError as e:
            raise ConfigurationError(f"cannot listen on {host}:{port}: {e}") from None
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

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics(environ, start_response)  # type: ignore[no-any-return]
        if path in ("/livez", "/readyz", "/health"):
            if environ["REQUEST_METHOD"] not in ("GET", "HEAD"):
                return _send(start_response, "405 Method Not Allowed", "text/plain", b"GET\n")
            details: dict[str, object] = {}
            if path == "/livez":
                why = self._live()
            else:
                why, details = self._ready()
            body: dict[str, object] = {"status": "ok" if why is None else "unavailable"}
            if why is not None:
                body["reason"] = why
            body.update(details)
            status = "200 OK" if why is None else "503 Service Unavailable"
            data = json.dumps(body).encode() + b"\n"
            return _send(
                start_response, status, _JSON, data, head=environ["REQUEST_METHOD"] == "HEAD"
            )
        return _send(start_response, "404 Not Found", "text/plain; charset=utf-8",
                     f"try {_ROUTES}\n".encode())  # fmt: skip


def _send(
    start_response: Callable[..., Any],
    status: str,
    content_type: str,
    body: bytes,
    *,
    head: bool = False,
) -> list[bytes]:
    start_response(
        status,
        [("Content-Type", content_type), ("Content-Length", str(len(body))),
         ("Cache-Control", "no-store")],
    )  # fmt: skip
    return [] if head else [body]
