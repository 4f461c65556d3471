"""The admin HTTP endpoint: ``/metrics`` for Prometheus, ``/livez`` and ``/readyz``
(``/health``: an alias of ``/readyz``) for probes.

``/metrics`` is prometheus_client's own WSGI app, so content negotiation
(OpenMetrics for a scraper that asks for it), gzip and ``name[]`` filters are
the library's; this module only routes the probes beside it. It runs on its
own port (9990 by default, like the original's admin port) and its own thread,
so a slow scrape never delays an id.

That one thread runs an event loop serving every admin connection; no thread
is started per request. A thread per request (socketserver's) failed every
request with "can't start new thread" once the host's thread limit was
reached, and a slow-loris of open connections reached it. Each connection
gets one request, answered and closed within ``request_timeout`` seconds; at
most ``max_connections`` are open, the oldest still sending its request making
room for a new one (a flood of silent connections cannot starve a probe).
Connections closed unanswered are counted. Requests are parsed by the API's
strict parser (:mod:`.parser`) and answered by its response builder
(:mod:`.responses`): a request it cannot trust gets its status and a close; HEAD
gets the headers a GET would (``/metrics`` too).

With ``--web-config-file`` (:mod:`.webconfig`, the Prometheus exporters' format) it
serves HTTPS, optionally asks for client certificates, and asks for basic-auth
credentials; the probes (``/livez``, ``/readyz``, ``/health``) need neither a
certificate nor a password, because a kubelet probe or a container health check
presents neither, and they tell nothing secret. TLS runs over memory buffers in the
connection (``TlsSession``, as on the client ports), so the request deadline and the
connection limit hold from the first byte of the handshake. A bcrypt check (about
50 ms) runs on a thread of its own, never on the loop that answers the probes; each
client address has its own budget of checks, one running or waiting at most (beyond it
the answer is 429); when all of them together spend the global budget, checks wait their
turn, the address whose last check is oldest first (:class:`~.webconfig.BasicAuth`).
SIGHUP reads the file again (:meth:`AdminServer.reload`).

It accepts on its own loop rather than asyncio's ``create_server``: out of file
descriptors (EMFILE, ENFILE), asyncio's accept logged a traceback for each of up
to 128 pending connections and retried every second, thousands of lines in
seconds. Here it pauses accepting, 100 ms doubling up to 2 s, counts the pause
and says so in one (rate-limited) line.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import json
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, cast
from urllib.parse import unquote

from prometheus_client.core import Metric
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry

from .._config.settings import AdminSettings
from .._observability.metrics import counter_by
from .._serving.listeners import listen_socket, started_threads
from .._serving.tls import TlsSession
from .parser import HttpError, Request, RequestParser
from .responses import error_response, response
from .webconfig import PROBE_PATHS, BasicAuth, WebConfig, client_key

__all__ = ["AdminConnection", "AdminServer", "Live", "Ready"]

log = logging.getLogger(__name__)

Ready = Callable[[], tuple[str | None, dict[str, object]]]
"""Why ids cannot be had now (None: they can), and details for the probe's body."""
Live = Callable[[], str | None]
"""Why the process is wedged, or None while it works."""

_JSON = "application/json"
_ROUTES = "/metrics, /livez, /readyz, /health"
_MAX_CONNECTIONS = 64
_REQUEST_TIMEOUT_S = 10.0
_MAX_HEAD = 8192  # a request line and headers; a scrape's are a few hundred bytes
_MAX_HEADERS = 64
# What the WSGI app (prometheus_client's) reads of a request's headers: its format
# (OpenMetrics or text) and its compression.
_WSGI_HEADERS = frozenset({"accept", "accept-encoding"})
_STOP_WAIT_S = 5.0
_BACKLOG = 128
_PAUSE_FIRST_S = 0.1
_PAUSE_MAX_S = 2.0
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_REALM = 'Basic realm="snowflake admin", charset="UTF-8"'
_NO_WEB_CONFIG = WebConfig("")
_DISPATCH_FLOOR_S = 0.005


class AdminServer(Collector):
    """Serves the admin endpoint as ``settings`` say, in a background thread.

    As a collector it reports the connections it closed unanswered (register it
    where they should be exported). Raises ``ConfigurationError`` if the address
    cannot be used. ``bound``: its socket, bound already (not listening); by default
    it binds one. ``web``: its web configuration (TLS, client certificates, users);
    plain HTTP open to all by default. ``checks_per_s``: bcrypt checks allowed per
    second, all clients together; ``client_checks_per_s``: for each client address
    (see :class:`~.webconfig.BasicAuth`); ``clock``: the buckets' time.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        settings: AdminSettings,
        *,
        ready: Ready,
        live: Live,
        max_connections: int = _MAX_CONNECTIONS,
        request_timeout: float = _REQUEST_TIMEOUT_S,
        bound: socket.socket | None = None,
        web: WebConfig | None = None,
        checks_per_s: float = 6.0,
        client_checks_per_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = make_wsgi_app(registry)
        # Taken at each reload:
        self.checks_per_s = checks_per_s
        self.client_checks_per_s = client_checks_per_s
        self.clock = clock
        self._checks: ThreadPoolExecutor | None = None
        self.web = _NO_WEB_CONFIG
        self.auth = BasicAuth({})
        self.denied = {"no_certificate": 0, "no_credentials": 0, "wrong_credentials": 0,
                       "throttled": 0}  # fmt: skip
        self.closed_tls = 0  # failed TLS handshakes, corrupt records
        self._ready = ready
        self._live = live
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.closed_full = 0  # closed to make room, or refused: max_connections were open
        self.closed_slow = 0  # no whole request, or its answer not taken, in time
        self.accept_pauses = 0  # out of file descriptors (or memory): accepting paused
        self.open: dict[AdminConnection, None] = {}  # oldest first; loop thread only
        # Requests whose password check waits its turn, by the auth they were accepted
        # under (a reload keeps the old one's turns) and client key; loop thread only.
        self._waiters: dict[BasicAuth, dict[str, _Waiter]] = {}
        self._dispatch_timer: asyncio.TimerHandle | None = None
        if bound is None:
            bound = listen_socket(settings.host, settings.port, reuse_port=False)
        bound.listen(_BACKLOG)
        self._sock = bound
        self._loop = asyncio.new_event_loop()
        self._stopping = asyncio.Event()  # set on the loop's thread
        self._thread = threading.Thread(target=self._run, name="admin-http", daemon=True)
        self.reload(web or _NO_WEB_CONFIG)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    @property
    def scheme(self) -> str:
        """``https`` with TLS, else ``http``."""
        return self.web.scheme

    def reload(self, web: WebConfig) -> None:
        """Serve connections accepted from now on as ``web`` says (those open keep the
        old settings); credentials checked so far are checked again. Safe from any
        thread. Raises ``RuntimeError`` if the bcrypt thread cannot start."""
        if web.users and self._checks is None:
            self._checks = started_threads(1, "admin-bcrypt")
        # One assignment each, read once per connection on the loop: a connection sees
        # either the old pair or the new one's web config with a fresh (empty) cache.
        self.auth = BasicAuth(
            web.users,
            checks_per_s=self.checks_per_s,
            client_checks_per_s=self.client_checks_per_s,
            clock=self.clock,
        )
        self.web = web

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already stopped
                self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(_STOP_WAIT_S)
        else:
            self._sock.close()
            self._loop.close()
        if self._checks is not None:
            self._checks.shutdown(wait=False, cancel_futures=True)

    def collect(self) -> Iterable[Metric]:
        yield counter_by(
            "snowflake_admin_connections_rejected",
            "Admin endpoint connections closed unanswered: full (the most allowed were "
            "open), slow (no whole request, or its answer not taken, in time), or tls (a "
            "failed TLS handshake or a corrupt record, with --web-config-file).",
            "reason",
            {"full": self.closed_full, "slow": self.closed_slow, "tls": self.closed_tls},
        )
        yield counter_by(
            "snowflake_admin_requests_denied",
            "Admin endpoint requests (probes never) refused by the web configuration: "
            "no client certificate (403), no or wrong basic-auth credentials (401), or "
            "throttled (429): the client's password checks a second spent, its last check "
            "still running or waiting, or its wait for a turn of the global budget ended "
            "(a second).",
            "reason",
            self.denied,
        )
        yield counter_by(
            "snowflake_accept_pauses",
            "Times a listener stopped accepting for a while (100 ms doubling up to 2 s) "
            "because the process was out of file descriptors or memory, by listener.",
            "listener",
            {"admin": self.accept_pauses},
        )

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        accepting = loop.create_task(self._accept(loop))
        try:
            await self._stopping.wait()
        finally:
            accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await accepting
            self._sock.close()
            for connection in list(self.open):
                connection.abort()
            await asyncio.sleep(0)  # their connection_lost, a turn after the abort

    async def _accept(self, loop: asyncio.AbstractEventLoop) -> None:
        pause = _PAUSE_FIRST_S
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as e:
                if e.errno not in _OUT_OF_RESOURCES:
                    log.info("admin: accept failed: %s", e)
                    continue
                self.accept_pauses += 1
                log.warning("admin: cannot accept connections (%s): pausing %g s", e.strerror,
                            pause)  # fmt: skip
                await asyncio.sleep(pause)
                pause = min(2 * pause, _PAUSE_MAX_S)
                continue
            pause = _PAUSE_FIRST_S
            try:
                await loop.connect_accepted_socket(lambda: AdminConnection(self), sock)
            except OSError as e:
                log.info("admin: dropping a connection: %s", e)
                sock.close()

    def admit(self, connection: AdminConnection) -> bool:
        """Whether ``connection`` is served: room is made by closing the oldest one
        still sending its request; with none, it is closed (counted either way)."""
        if len(self.open) >= self.max_connections:
            self.closed_full += 1
            oldest = next((c for c in self.open if c.waiting), None)
            if oldest is None:
                return False
            oldest.abort()
        self.open[connection] = None
        return True

    def answer(self, request: Request, connection: AdminConnection) -> bytes | None:
        """The whole response to ``request``, or None when a password check must run
        first: ``connection.finish`` is then called with it, on the loop's thread."""
        web, auth = connection.web, connection.auth
        head = request.method == "HEAD"
        if unquote(request.path) in PROBE_PATHS:
            return self.respond(request, web)
        if web.require_client_cert and not connection.certified:
            self.denied["no_certificate"] += 1
            return error_response(403, "client_certificate_required",
                                  "this path needs a client certificate (mutual TLS)",
                                  head=head, close=True, headers=web.headers)  # fmt: skip
        if not auth.enabled:
            return self.respond(request, web)
        given = BasicAuth.credentials(_header(request, "authorization"))
        if given is None:
            self.denied["no_credentials"] += 1
            return _unauthorized(web, head)
        if auth.remembered(*given):
            return self.respond(request, web)
        if self._checks is None or not auth.ask(connection.client):
            self.denied["throttled"] += 1
            return _throttled(web, head)
        waiters = self._waiters.setdefault(auth, {})
        waiters[client_key(connection.client)] = _Waiter(request, connection, given)
        self._dispatch()
        return None

    def _dispatch(self) -> None:
        """Start the password checks whose turn has come, turn away those whose wait
        ended (429), and set the timer for the next turn (loop thread only)."""
        if self._dispatch_timer is not None:
            self._dispatch_timer.cancel()
            self._dispatch_timer = None
        next_event: float | None = None
        for auth, waiters in list(self._waiters.items()):
            started, away = auth.dispatch()
            for key in away:
                waiter = waiters.pop(key)
                self.denied["throttled"] += 1
                waiter.connection.finish(_throttled(waiter.connection.web,
                                                    waiter.request.method == "HEAD"))  # fmt: skip
            for key in started:
                self._check(auth, waiters.pop(key))
            if not waiters:
                del self._waiters[auth]
                continue
            event = auth.next_event()
            if event is not None:
                delay = event - self.clock()
                next_event = delay if next_event is None else min(next_event, delay)
        if next_event is not None:
            # A floor: a frozen test clock must not spin the loop.
            delay = max(next_event, _DISPATCH_FLOOR_S)
            self._dispatch_timer = asyncio.get_running_loop().call_later(delay, self._dispatch)

    def _check(self, auth: BasicAuth, waiter: _Waiter) -> None:
        """Run the password check ``auth.dispatch`` started; answer when it ends."""
        request, connection, given = waiter
        web, client, head = connection.web, connection.client, request.method == "HEAD"
        loop = asyncio.get_running_loop()
        assert self._checks is not None  # ask() refused without a bcrypt thread
        try:
            checked = loop.run_in_executor(self._checks, auth.check, *given)
        except RuntimeError:  # the thread pool shut down: the server is stopping
            auth.checked(client)
            connection.abort()
            return

        def checked_done(future: asyncio.Future[bool]) -> None:
            auth.checked(client)
            self._dispatch()  # a check ended: a waiting one may start
            if future.cancelled():
                return
            try:
                ok = future.result()
            except Exception:
                log.exception("admin: checking a password failed")
                connection.finish(error_response(500, "internal_error", "internal error",
                                                 head=head, close=True))  # fmt: skip
                return
            if not ok:
                self.denied["wrong_credentials"] += 1
                connection.finish(_unauthorized(web, head))
                return
            auth.remember(*given)
            connection.finish(self.respond(request, web))

        checked.add_done_callback(checked_done)

    def respond(self, request: Request, web: WebConfig = _NO_WEB_CONFIG) -> bytes:
        """The whole response to ``request`` (the connection closes after it)."""
        environ: dict[str, Any] = {
            "REQUEST_METHOD": request.method,
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote(request.path),
            "QUERY_STRING": request.query,
            "SERVER_NAME": self.address[0],
            "SERVER_PORT": str(self.address[1]),
            "SERVER_PROTOCOL": "HTTP/1.1",
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": web.scheme,
            "wsgi.input": io.BytesIO(),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": False,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for name, value in request.headers:
            if name in _WSGI_HEADERS:
                environ.setdefault("HTTP_" + name.upper().replace("-", "_"), value)
        started: list[tuple[str, list[tuple[str, str]]]] = []

        def start_response(status: str, headers: list[tuple[str, str]], *_: object) -> None:
            started.append((status, headers))

        head = request.method == "HEAD"
        try:
            body = b"".join(self._app(environ, start_response))
            status, headers = started[-1]
            code = int(status[:3])  # the app's own status line, never a client's bytes
            content_type = "text/plain"
            extra: list[tuple[str, str]] = list(web.headers)
            for name, value in headers:
                lower = name.lower()
                if lower == "content-type":
                    content_type = value
                elif lower not in ("content-length", "cache-control", "connection"):
                    extra.append((name, value))
            return response(code, body, content_type=content_type, head=head, close=True,
                            headers=extra)  # fmt: skip
        except Exception:
            log.exception("admin %s %s failed", request.method, request.path)
            return error_response(500, "internal_error", f"internal error in {request.path}",
                                  head=head, close=True, headers=web.headers)  # fmt: skip

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            if environ["REQUEST_METHOD"] == "HEAD":  # the library's app serves GET only
                environ["REQUEST_METHOD"] = "GET"  # respond() drops the body
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
            return _send(start_response, status, _JSON, data)
        return _send(start_response, "404 Not Found", "text/plain; charset=utf-8",
                     f"try {_ROUTES}\n".encode())  # fmt: skip


class AdminConnection(asyncio.Protocol):
    """One admin request: read (within the time limit), answered, closed."""

    def __init__(self, server: AdminServer) -> None:
        self._server = server
        self._parser = RequestParser(
            max_head=_MAX_HEAD, max_headers=_MAX_HEADERS, keep_headers=True
        )
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.waiting = True  # its request is not all here yet
        self.client = ""  # the peer's address: whose password-check budget it spends
        # The settings it was accepted under: a reload meanwhile does not change them.
        self.web = server.web
        self.auth = server.auth
        self._tls = TlsSession(self.web.tls) if self.web.tls is not None else None

    @property
    def certified(self) -> bool:
        """Whether the client presented a (verified) certificate."""
        return self._tls is not None and self._tls.peer_certified

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        peer = self._transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self._server.admit(self):
            self._transport.abort()
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._server.request_timeout, self._expired)

    def data_received(self, data: bytes) -> None:
        if not self.waiting:
            return  # answered (or being answered): what else it sends is not read
        assert self._transport is not None
        if self._tls is not None:
            try:
                data, to_send = self._tls.receive(data)
            except ssl.SSLError as e:
                self._server.closed_tls += 1
                log.debug("admin: TLS failed: %s", e)
                self.abort()
                return
            if to_send:
                self._transport.write(to_send)
            if self._tls.closed_by_peer and not data:
                self.abort()
                return
            if not data:
                return
        try:
            requests = self._parser.feed(data)
        except HttpError as e:
            reply: bytes | None = error_response(
                e.status, e.kind, str(e), close=True, headers=self.web.headers
            )
        else:
            if not requests:
                return
            # One per connection: no more is read.
            reply = self._server.answer(requests[0], self)
        self.waiting = False
        if reply is not None:
            self.finish(reply)

    def finish(self, reply: bytes) -> None:
        """Send ``reply`` and close (once it is sent; the timer still bounds that)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return  # aborted meanwhile (its deadline passed, or room was made)
        if self._tls is not None:
            reply = self._tls.encrypt(reply) + self._tls.close()
        transport.write(reply)
        transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._server.open.pop(self, None)

    def _expired(self) -> None:
        self._server.closed_slow += 1
        log.debug("admin: closing a connection with no answer taken within %g s",
                  self._server.request_timeout)  # fmt: skip
        self.abort()

    def abort(self) -> None:
        self.waiting = False
        self._server.open.pop(self, None)  # now: its connection_lost comes a turn later
        if self._transport is not None:
            self._transport.abort()


def _header(request: Request, name: str) -> str | None:
    """The first value of header ``name`` (lower case), or None."""
    return next((value for key, value in request.headers if key == name), None)


def _throttled(web: WebConfig, head: bool) -> bytes:
    return error_response(429, "too_many_password_checks",
                          "too many password checks: try again in a second",
                          head=head, close=True,
                          headers=(("Retry-After", "1"), *web.headers))  # fmt: skip


class _Waiter(NamedTuple):
    """A request whose password check waits for its turn."""

    request: Request
    connection: AdminConnection
    given: tuple[str, bytes]


def _unauthorized(web: WebConfig, head: bool) -> bytes:
    return error_response(401, "unauthorized", "this path needs a user and password",
                          head=head, close=True,
                          headers=(("WWW-Authenticate", _REALM), *web.headers))  # fmt: skip


def _send(
    start_response: Callable[..., Any], status: str, content_type: str, body: bytes
) -> list[bytes]:
    start_response(status, [("Content-Type", content_type)])
    return [body]
