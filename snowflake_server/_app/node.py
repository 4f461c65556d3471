"""The composition root: one server process's parts, built from its settings.

:class:`Node` reads as its life: :meth:`~Node.start` (bind every port without
listening, so that a port in use fails before any wait; open the id source for
the mode, open the admin endpoint, register in the cluster, then listen: a
connection attempt is refused until the node can serve; a stop asked meanwhile
ends every start-up wait at once), :meth:`~Node.run` (serve until asked to stop),
:meth:`~Node.drain` (not ready at once, stop after ``--drain-seconds``),
:meth:`~Node.close` (everything in reverse: stop serving, final marks,
deregister). One builder per mode, :func:`standalone` and :func:`clustered`,
returns the id source, its metrics collectors and why it cannot serve.
:func:`serve` adds the signals (from its first line: a SIGTERM while starting
stops cleanly), the ready line and systemd's notifications; tests run a
``Node`` in a thread instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoAuthError
from kazoo.handlers.threading import KazooTimeoutError
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from .._cluster.gate import SessionGate
from .._cluster.membership import Cluster, advertised_address
from .._cluster.slot import CurrentReservation, WorkerSlot
from .._cluster.zk import check_tls_files, describe_zk_error
from .._config.settings import PEER_CHECK_SLOTS, ServerSettings
from .._errors import ConfigurationError, StartupDeferred, StartupInterrupted
from .._http.admin import AdminServer
from .._http.protocol import HttpProtocol
from .._http.webconfig import WebConfig, load_web_config
from .._ids.clocks import wall_clock_ms
from .._ids.generator import IdSource
from .._native import native_core
from .._observability.audit import AuditLog
from .._observability.lifecycle import Lifecycle
from .._observability.logs import LogFile
from .._observability.metrics import ConnectionStats, ServiceMetrics
from .._observability.probes import Check, LoopWatch, Readiness
from .._service import SnowflakeHandler
from .._serving.listeners import check_open_files, listen_socket
from .._serving.server import Endpoint, Native, Server
from .._serving.tls import server_context
from .._state.reservation import MarkStore
from .._state.worker import Worker
from .._thrift.processor import Processor, service_methods
from .._thrift.protocol import thrift_protocols
from .._version import __version__
from .node_id import WorkerIdOrigin, configured_origin
from .notify import Notifier
from .ready import ready_line
from .signals import on_signal

if TYPE_CHECKING:
    from .._native._core import GeneratorState

__all__ = ["Mode", "Node", "clustered", "serve", "standalone"]

log = logging.getLogger("snowflake_server")


Defer = Callable[[Callable[[], None]], object]
"""Registers a close to run at shutdown (in reverse order of registration)."""
Wait = Callable[[float], object]
"""A start-up wait: sleeps, or raises ``StartupInterrupted`` when a stop is asked."""


def waits_until(stopping: threading.Event) -> Wait:
    """A start-up wait that a stop (``stopping`` set) ends at once."""

    def wait(seconds: float) -> None:
        if stopping.wait(seconds):
            raise StartupInterrupted("asked to stop while waiting to start; nothing was served")

    return wait


@dataclass
class Mode:
    """What a mode gives the rest of the node."""

    source: IdSource
    collectors: list[Collector]
    unavailable: Check
    """Why a call would fail now (None: it would succeed)."""
    details: Callable[[], dict[str, object]] = dict
    """What the probes add about the mode (the ZooKeeper session, the registration)."""
    join: Callable[[int, Defer], None] = lambda _port, _defer: None
    """Called once the Thrift port is bound (peers must be able to dial us), with the
    port and a way to defer a close to shutdown, before the Thrift server's close."""
    interrupt: Callable[[], None] = lambda: None
    """Ends the mode's start-up waits at once (a stop was asked); from any thread."""
    watch_native: Callable[[Callable[[GeneratorState | None], None]], None] = lambda watcher: (
        watcher(None)
    )
    """Tells a watcher the native generator state ids come from now, and each time that
    changes (None: none; native threads then hand every call to Python)."""


def standalone(
    settings: ServerSettings, clock: Callable[[], int], defer: Defer, stopping: threading.Event
) -> Mode:
    """One worker, its id configured: lock its state, honour its mark, serve. Its
    start-up waits end when ``stopping`` is set."""
    worker = Worker.open(
        settings.worker, settings.worker_number, clock=clock, wait=waits_until(stopping)
    )
    defer(worker.close)  # the first close registered: it runs last
    state = worker.native_state
    if state is not None:
        state.set_gate(math.inf)  # no session to prove: open until the worker is sealed
    return Mode(
        source=worker.generator,
        collectors=[worker.reservation],
        unavailable=worker.unavailable_reason,
        watch_native=lambda watcher: watcher(state),
    )


def clustered(
    settings: ServerSettings,
    clock: Callable[[], int],
    client_factory: Callable[..., Any],
    stopping: threading.Event,
) -> Mode:
    """A worker id leased from ZooKeeper once the port is bound, served while the
    session is proven (see ``Cluster``). Its start-up waits end when ``stopping`` is
    set (or :attr:`Mode.interrupt` is called)."""
    slot = WorkerSlot(settings.ids, SessionGate())
    mode = Mode(
        source=slot,
        collectors=[CurrentReservation(slot)],
        unavailable=slot.unavailable_reason,
        watch_native=slot.watch,
    )

    def open_worker(
        worker_id: int,
        remote: tuple[MarkStore, int],
        waited: float | None,
        *,
        before_first_write: Callable[[], None] | None = None,
    ) -> Worker:
        return Worker.open(
            settings.worker,
            worker_id,
            clock=clock,
            wait=waits_until(stopping),
            remote=remote,
            first_start_waited=waited,
            before_first_write=before_first_write,
        )

    def join(port: int, defer: Defer) -> None:
        cluster = Cluster(
            settings.cluster,
            slot,
            clock,
            advertised_address(settings.cluster, port),
            open_worker=open_worker,
            client_factory=client_factory,
        )
        mode.details = cluster.details
        # Closed before the Thrift server and the audit trail, as the worker is: calls
        # still in flight then meet a sealed generator, not an id nobody audits. Deferred
        # before connecting: a start that fails or is stopped from here on deregisters.
        defer(cluster.close)
        # Set before the check: a stop asked from now on reaches the cluster's waits.
        mode.interrupt = cluster.interrupt
        if stopping.is_set():
            raise StartupInterrupted("asked to stop before joining the cluster")
        try:
            cluster.connect()
            cluster.check_peers()
            cluster.register()
        except NoAuthError as e:
            # Never passes by itself: not "try again" (75).
            raise ConfigurationError(
                f"ZooKeeper refused this node during start-up: {describe_zk_error(e)}; give "
                f"the znodes under --zk-path {settings.cluster.zk_path} an ACL that lets it in"
            ) from None
        except (KazooException, KazooTimeoutError) as e:
            raise StartupDeferred(
                f"ZooKeeper failed during start-up: {describe_zk_error(e)}; start again"
            ) from None
        mode.collectors.append(cluster)

    mode.join = join
    return mode


class Node:
    """One server process: ``start()``, ``run()`` until ``drain()`` or ``request_stop()``,
    ``close()``.

    ``clock`` is the wall clock ids are stamped with; ``zk_client_factory``
    makes ZooKeeper clients in cluster mode. ``origin`` says where the worker id came
    from (``resolve_worker_id`` read it from the machine); by default the settings.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        zk_client_factory: Callable[..., Any] = KazooClient,
        origin: WorkerIdOrigin | None = None,
    ) -> None:
        self.settings = settings
        self.origin = configured_origin(settings) if origin is None else origin
        self._clock = clock
        self._zk_client_factory = zk_client_factory
        self._cleanup = contextlib.ExitStack()
        self._stopping = threading.Event()
        self._server: Server | None = None
        self._audit: AuditLog | None = None
        self._admin: AdminServer | None = None
        self.mode: Mode | None = None
        self.lifecycle = Lifecycle()
        self.readiness = Readiness(self.lifecycle)
        probes = settings.probes
        self.loop_watch = LoopWatch(max_lag_s=probes.max_lag_s, max_stall_s=probes.max_stall_s)
        self.thrift_address = ("", 0)
        self.admin_address = ("", 0)
        self.http_address: tuple[str, int] | None = None
        self._native_watches: tuple[LoopWatch, ...] = ()  # one per native thread serving
        self._native_counts: Callable[[], None] = lambda: None

    @property
    def native_threads(self) -> int:
        """Native threads answering the Thrift port's get_id beside Python (0: none)."""
        return len(self._native_watches)

    @property
    def server(self) -> Server | None:
        """The server of the node's listeners once :meth:`start` built it, else None."""
        return self._server

    def start(self) -> None:
        """Build and open everything; on failure close what was opened and raise
        (``ConfigurationError``: bad settings or a port in use; ``StartupRefused``:
        starting could repeat ids; ``StartupDeferred``: try again later;
        ``StartupInterrupted``: :meth:`request_stop` was called meanwhile). On return
        the node serves: its port listens."""
        try:
            self._start()
        except BaseException:
            self._cleanup.close()
            raise

    def _start(self) -> None:
        # Read before any wait: a bad file is a setting, refused at once (exit 2).
        web = self._web_config()
        ports = self._bind_ports()
        mode = self._open_mode()
        self.readiness.add_check(mode.unavailable)
        self.readiness.add_check(self.loop_watch.unready)
        metrics = ServiceMetrics(
            mode.source,
            service_methods(),
            max_agents=self.settings.admin.max_agents,
            worker_id_source=self.origin.source,
        )
        self._audit = self._open_audit(mode)
        self._server = self._open_server(mode, metrics, self._audit, ports)
        self.admin_address = self._open_admin(mode, metrics, ports.admin, web)
        mode.join(self.thrift_address[1], self._cleanup.callback)
        if self._stopping.is_set():  # asked after the last wait: serve nobody
            raise StartupInterrupted("asked to stop while starting; nothing was served")
        self._server.listen()
        if "thrift" in self._server.native_endpoints:
            self._native_counts()  # counted once they serve (snowflake_native_threads)
            for watch in self._native_watches:
                self.readiness.add_check(watch.unready)
        else:
            self._native_watches = ()  # none started: Python serves alone
        self.lifecycle.serving()

    def _bind_ports(self) -> _Ports:
        """Every port, bound before any wait (a port in use fails at once) and not
        listening (a connection attempt is refused until the node can serve; the
        Thrift port is bound so that peers can dial us once we are registered)."""
        serving, admin = self.settings.serving, self.settings.admin
        native_threads = serving.native_threads if serving.native and native_core() else 0
        check_open_files(serving.connection_slots, native_threads)  # a limit too low: refuse now
        ports = _Ports()
        self._cleanup.callback(ports.close)  # the servers close them too, once given
        ports.thrift = listen_socket(serving.host, serving.port, reuse_port=serving.reuse_port)
        self.thrift_address = _address(ports.thrift)
        if serving.http:
            ports.http = listen_socket(
                serving.http_host, serving.http_port, reuse_port=serving.reuse_port
            )
            self.http_address = _address(ports.http)
        ports.admin = listen_socket(admin.host, admin.port, reuse_port=False)
        return ports

    def _open_mode(self) -> Mode:
        settings = self.settings
        if settings.zookeeper:
            mode = clustered(settings, self._clock, self._zk_client_factory, self._stopping)
        else:
            mode = standalone(settings, self._clock, self._cleanup.callback, self._stopping)
        self.mode = mode
        return mode

    def _open_audit(self, mode: Mode) -> AuditLog | None:
        audit_settings = self.settings.audit
        if not audit_settings.path:
            return None
        # With the native core the bound lives in C, where native threads can share it.
        core = native_core()
        budget = None if core is None else core.AuditBudget(audit_settings.queue)
        audit = AuditLog(audit_settings.path, audit_settings.queue, budget=budget)
        audit.start()
        self._cleanup.callback(audit.close)  # after the server: every id issued is written
        mode.collectors.append(audit)
        return audit

    def _open_server(
        self, mode: Mode, metrics: ServiceMetrics, audit: AuditLog | None, ports: _Ports
    ) -> Server:
        """The serving core with every client port: Thrift, and HTTP with ``--http-port``."""
        source, clock, serving = mode.source, self._clock, self.settings.serving

        def handler(stats: ConnectionStats) -> SnowflakeHandler:
            return SnowflakeHandler(source, metrics, stats, clock, audit)

        def processor(stats: ConnectionStats) -> Processor:
            return Processor(handler(stats), stats)

        assert ports.thrift is not None
        endpoints = [
            Endpoint(
                "thrift",
                ports.thrift,
                thrift_protocols(
                    processor, framed=serving.transport == "framed", limit=serving.max_frame_size
                ),
                serving.max_connections,
                idle_timeout=serving.idle_timeout,
                request_timeout=serving.request_timeout,
                reserve=PEER_CHECK_SLOTS,
                native=self._native(mode, metrics, audit),
            )
        ]
        if ports.http is not None:
            endpoints.append(
                Endpoint(
                    "http",
                    ports.http,
                    lambda stats, _peer_check_only: HttpProtocol(handler(stats), stats),
                    serving.http_max_connections,
                    idle_timeout=serving.idle_timeout,
                    request_timeout=serving.request_timeout,
                )
            )
        ports.thrift = ports.http = None  # the server closes them from now on
        server = Server(endpoints, metrics, tls=self._tls_context(), ticks=self.loop_watch)
        self._cleanup.callback(server.close)
        return server

    def _native(self, mode: Mode, metrics: ServiceMetrics, audit: AuditLog | None) -> Native | None:
        """The Thrift port's native threads (not yet started), if it is served natively
        and the native core is built (``native_core`` logs why not)."""
        serving = self.settings.serving
        core = native_core() if serving.native else None
        if core is None:
            return None
        if self._clock is not wall_clock_ms:
            # Native threads read the system's clock themselves: ids stamped by another
            # clock (a test's) are Python's alone.
            log.info("native threads off: ids are stamped by a clock other than the system's")
            return None
        threads = serving.native_threads
        registry = core.AgentRegistry()
        stats = core.NativeStats(threads)
        machine = core.Listener(
            threads,
            registry,
            stats,
            serving.max_frame_size,
            budget=None if audit is None else audit.budget,
        )
        probes = self.settings.probes
        watches = tuple(
            LoopWatch(
                max_lag_s=probes.max_lag_s,
                max_stall_s=probes.max_stall_s,
                name=f"native thread {i}",
            )
            for i in range(threads)
        )
        # Ids natively issued come from the worker's own state, whichever is installed.
        mode.watch_native(machine.set_state)
        if audit is not None:
            audit.add_source(
                machine.take_audit, lambda index: registry.agent(index).decode("utf-8", "replace")
            )
        self._native_watches = watches
        self._native_counts = lambda: metrics.add_native(stats, registry)
        return Native(machine, core, registry, metrics.agent_index, watches)

    def _tls_context(self) -> ssl.SSLContext | None:
        serving = self.settings.serving
        if not serving.tls_cert:
            return None
        return server_context(serving.tls_cert, serving.tls_key, serving.tls_client_ca)

    def _web_config(self) -> WebConfig | None:
        path = self.settings.admin.web_config_file
        return load_web_config(path) if path else None

    @property
    def admin(self) -> AdminServer | None:
        """The admin endpoint once :meth:`start` opened it, else None."""
        return self._admin

    @property
    def admin_scheme(self) -> str:
        """How the admin endpoint is spoken to: ``https`` or ``http``."""
        return self._admin.scheme if self._admin is not None else "http"

    def _open_admin(
        self,
        mode: Mode,
        metrics: ServiceMetrics,
        bound: socket.socket | None,
        web: WebConfig | None,
    ) -> tuple[str, int]:
        def ready() -> tuple[str | None, dict[str, object]]:
            ids = mode.source.settings
            return self.readiness.reason(), {
                "phase": self.readiness.phase.value,
                "worker_id": ids.worker_id,
                "datacenter_id": ids.datacenter_id,
                "worker_id_source": self.origin.source,
                "worker_id_from": self.origin.detail,
                "version": __version__,
                **mode.details(),
            }

        # The collectors list is read at each scrape: the cluster's joins it later.
        registry = metrics.registry(_Each(mode.collectors), self.readiness, self.loop_watch)
        admin = AdminServer(
            registry,
            self.settings.admin,
            ready=ready,
            live=self._wedged,
            bound=bound,
            web=web,
        )
        self._admin = admin
        registry.register(admin)
        admin.start()
        self._cleanup.callback(admin.stop)
        return admin.address

    def _wedged(self) -> str | None:
        """Liveness: why the loop or a native thread has stopped turning, or None."""
        for watch in (self.loop_watch, *self._native_watches):
            reason = watch.wedged()
            if reason is not None:
                return reason
        return None

    def run(self) -> None:
        """Serve until :meth:`drain` or :meth:`request_stop`; calls in flight finish first."""
        assert self._server is not None, "start() first"
        self._server.serve_forever()

    def drain(self) -> None:
        """Stop gracefully (SIGTERM): not ready at once, serving on for
        ``--drain-seconds``, then as :meth:`request_stop`. Safe from any thread."""
        self.lifecycle.draining()
        if self._server is not None:
            self._server.request_shutdown(after_s=self.settings.drain_seconds)

    def request_stop(self) -> None:
        """Ask :meth:`run` to return now, or :meth:`start` to end its waits and raise
        ``StartupInterrupted``. Safe from a signal handler or any thread."""
        self.lifecycle.draining()
        self._stopping.set()  # before the interrupt: see clustered()'s join
        if self.mode is not None:
            self.mode.interrupt()
        if self._server is not None:
            self._server.request_shutdown()

    def reload(self, log_file: LogFile | None = None) -> None:
        """SIGHUP: ``log_file`` (if any) is opened afresh; new connections get the TLS
        certificate, key and client CA as the files now hold them, on the Thrift and HTTP
        ports alike, and the admin endpoint's web configuration as its file now says (a
        file that does not load keeps the old settings, and the log says why); the audit
        trail goes to a fresh open of its file. The ZooKeeper session and its connection
        are kept (a new session would lose the worker id's lease): its TLS files are only
        checked, and said to be used from the next reconnection on (kazoo reads them at
        each connection). One line first says what this SIGHUP reloads, or that there is
        nothing to reload: the operator sees it was received either way. Each step runs
        whatever the others did: one that fails is logged, never raised."""
        if log_file is not None:
            # First, so that the line below lands in the new file the operator looks at.
            reload_step("the log file", log_file.reopen)
        steps = self._reload_steps()
        announce_reload((["the log file"] if log_file is not None else []) + list(steps))
        for step in steps.values():
            step()

    def reloadable(self) -> list[str]:
        """What :meth:`reload` reloads now (besides a log file), in its order: only what
        is configured and started."""
        return list(self._reload_steps())

    def _reload_steps(self) -> dict[str, Callable[[], object]]:
        """The steps of :meth:`reload` that apply now, in order, by what its line calls
        them: the one place that says which apply."""
        settings, server, admin = self.settings, self._server, self._admin
        steps: dict[str, Callable[[], object]] = {}
        if server is not None and settings.serving.tls_cert:
            steps["the API's TLS certificate"] = lambda: reload_step(
                "the TLS certificate", lambda: self._reload_tls(server)
            )
        if admin is not None and settings.admin.web_config_file:
            steps["the admin endpoint's web configuration"] = lambda: reload_admin(
                admin, settings.admin.web_config_file
            )
        if settings.zookeeper and settings.zk_access.tls:
            steps["the ZooKeeper TLS files (checked; the session is kept)"] = lambda: reload_step(
                "the ZooKeeper TLS check", self._check_zk_tls
            )
        if self._audit is not None:
            steps["the audit log"] = lambda: reload_step("the audit log", self._reopen_audit)
        return steps

    def _reload_tls(self, server: Server) -> None:
        try:
            context = self._tls_context()
        except ConfigurationError as e:
            log.error("SIGHUP: keeping the TLS certificate in use: %s", e)
        else:
            assert context is not None
            server.set_tls(context)
            log.info("SIGHUP: new connections use the reloaded TLS certificate")

    def _check_zk_tls(self) -> None:
        try:
            check_tls_files(self.settings.zk_access)
        except ConfigurationError as e:
            log.error(
                "SIGHUP: the ZooKeeper TLS files do not load, so a reconnection would fail "
                "until they do (the session and its connection are kept): %s", e,
            )  # fmt: skip
        else:
            log.info(
                "SIGHUP: the ZooKeeper TLS files load; the next reconnection uses them "
                "(the session and its connection are kept)"
            )

    def _reopen_audit(self) -> None:
        assert self._audit is not None
        if self._audit.reopen():
            log.info("SIGHUP: reopened the audit log %s", self._audit.path)

    def close(self) -> None:
        """Stop everything started, in reverse: the exact final marks are written."""
        self.lifecycle.stopped()
        self._cleanup.close()


NOTHING_TO_RELOAD = (
    "SIGHUP: nothing to reload (no TLS certificate, ZooKeeper TLS, web configuration, "
    "audit log or log file configured)"
)


def announce_reload(what: list[str], then: str = "", nothing: str = NOTHING_TO_RELOAD) -> None:
    """Log the one line that says a SIGHUP was received and what it reloads (``what``,
    in order), or ``nothing`` when there is nothing to reload; ``then``: what else it
    does, added after a semicolon (the supervisor passing it on)."""
    line = f"SIGHUP: reloading {_listed(what)}" if what else nothing
    log.info("%s%s", line, f"; {then}" if then else "", extra={"reloading": what})


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def reload_step(what: str, step: Callable[[], object]) -> bool:
    """Run one step of a SIGHUP reload; whatever it raises is logged (with the
    traceback: each step handles what it expects), so that the next steps still run.
    Whether it ended without raising."""
    try:
        step()
    except Exception:
        log.exception("SIGHUP: reloading %s failed; the other reload steps still run", what)
        return False
    return True


def reload_admin(admin: AdminServer, path: str) -> None:
    """SIGHUP for an admin endpoint: its web configuration read again from ``path``
    (if any); one that does not load keeps the one in use, and the log says why.
    Never raises: the other reload steps must run whatever this one met."""
    if not path:
        return

    def reload() -> None:
        try:
            admin.reload(load_web_config(path))
        except (ConfigurationError, RuntimeError) as e:
            log.error("SIGHUP: keeping the admin endpoint's web configuration in use: %s", e)
        else:
            log.info("SIGHUP: new admin connections use the reloaded web configuration %s",
                     path)  # fmt: skip

    reload_step("the admin endpoint's web configuration", reload)


@dataclass
class _Ports:
    """The sockets :meth:`Node._bind_ports` bound, until the servers take them."""

    thrift: socket.socket | None = None
    http: socket.socket | None = None
    admin: socket.socket | None = None

    def close(self) -> None:
        for sock in (self.thrift, self.http, self.admin):
            if sock is not None:
                sock.close()


def _address(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return str(host), int(port)


class _Each(Collector):
    """The metrics of whatever collectors a list holds at scrape time."""

    def __init__(self, collectors: list[Collector]) -> None:
        self._collectors = collectors

    def collect(self) -> Iterable[Metric]:
        for collector in list(self._collectors):
            yield from collector.collect()


def serve(
    settings: ServerSettings,
    log_file: LogFile | None = None,
    *,
    origin: WorkerIdOrigin | None = None,
) -> int:
    """Run a server with ``settings`` until SIGTERM/SIGINT; return the exit code.

    The first SIGTERM or SIGINT drains (see :meth:`Node.drain`), a second one
    stops at once; SIGHUP reloads (:meth:`Node.reload`) and reopens ``log_file``.
    ``origin``: where the worker id came from (see :class:`Node`).
    """
    notifier = Notifier(os.environ)
    node = Node(settings, origin=origin)
    stops = 0
    stops_lock = threading.Lock()
    serving = threading.Event()

    def stop(name: str) -> None:
        nonlocal stops
        with stops_lock:
            stops += 1
            first = stops == 1
        if not serving.is_set():
            # Nothing to drain: end the start-up waits now; start() then closes what it
            # opened (deregisters) and raises StartupInterrupted.
            log.info("received %s while starting: stopping", name, extra={"signal": name})
            node.request_stop()
            return
        if not first:
            log.info("received %s again: stopping now", name)
            node.request_stop()
            return
        log.info(
            "received %s: not ready from now; serving %g s more, then finishing the "
            "calls in flight", name, settings.drain_seconds,
            extra={"signal": name, "drain_seconds": settings.drain_seconds},
        )  # fmt: skip
        notifier.stopping(f"draining for {settings.drain_seconds:g} s")
        node.drain()

    def reload() -> None:
        # systemd takes READY=1 after a reload for "started": tell it nothing before we
        # serve.
        tell = serving.is_set()
        if tell:
            notifier.reloading()
        try:
            node.reload(log_file)
        finally:
            if tell:
                notifier.reloaded("serving")

    # From the first line: a SIGTERM during a start-up wait stops cleanly (exit 0, the
    # registration removed), never by the default action that leaves it behind.
    on_signal(signal.SIGTERM, stop)
    on_signal(signal.SIGINT, stop)
    on_signal(signal.SIGHUP, lambda _name: reload())
    node.start()
    serving.set()
    try:
        ids = node.mode.source.settings if node.mode is not None else settings.ids
        native = node.native_threads
        log.info(
            "serving %s/binary on %s:%d (datacenter %d, worker %d%s); metrics on "
            "%s://%s:%d/metrics",
            settings.transport, *node.thrift_address, ids.datacenter_id, ids.worker_id,
            f"; get_id on {native} native thread{'s' if native > 1 else ''} too" if native else "",
            node.admin_scheme, *node.admin_address,
            extra={
                "thrift": "{}:{}".format(*node.thrift_address),
                "admin": "{}:{}".format(*node.admin_address),
                "datacenter_id": ids.datacenter_id,
                "worker_id": ids.worker_id,
            },
        )  # fmt: skip
        print(ready_line(node.thrift_address, node.admin_address, node.http_address), flush=True)
        notifier.ready(f"serving datacenter {ids.datacenter_id} worker {ids.worker_id}")
        node.run()
    finally:
        node.close()
    log.info("stopped")
    return 0
