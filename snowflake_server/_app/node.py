"""The composition root: one server process's parts, built from its settings.

:class:`Node` reads as its life: :meth:`~Node.start` (open the id source for
the mode, bind the Thrift port, register in the cluster, open the admin
endpoint), :meth:`~Node.run` (serve until asked to stop), :meth:`~Node.close`
(everything in reverse: stop serving, final marks, deregister). One builder
per mode, :func:`standalone` and :func:`clustered`, returns the id source,
its metrics collectors and its health. :func:`serve` adds the signals and the
ready line; tests run a ``Node`` in a thread instead.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError
from prometheus_client.registry import Collector

from .._cluster.membership import Cluster, advertised_address
from .._config.settings import ServerSettings
from .._errors import StartupRefused
from .._ids.clocks import wall_clock_ms
from .._ids.generator import IdSource
from .._observability.admin import AdminServer, Health
from .._observability.audit import AuditLog
from .._observability.metrics import ConnectionStats, ServiceMetrics
from .._state.reservation import MarkStore
from .._state.worker import CurrentReservation, Worker, WorkerSlot
from .._thrift.handler import Processor, SnowflakeHandler, service_methods
from .._thrift.server import ThriftServer
from .._thrift.tls import server_context
from .._version import __version__
from .ready import ready_line

__all__ = ["Mode", "Node", "clustered", "serve", "standalone"]

log = logging.getLogger("snowflake_server")


Defer = Callable[[Callable[[], None]], object]
"""Registers a close to run at shutdown (in reverse order of registration)."""


@dataclass
class Mode:
    """What a mode gives the rest of the node."""

    source: IdSource
    collectors: list[Collector]
    health: Health
    join: Callable[[int, Defer], None] = lambda _port, _defer: None
    """Called once the Thrift port is bound (peers must be able to dial us), with the
    port and a way to defer a close to shutdown, before the Thrift server's close."""


def standalone(settings: ServerSettings, clock: Callable[[], int], defer: Defer) -> Mode:
    """One worker, its id configured: lock its state, honour its mark, serve."""
    worker = Worker.open(settings.worker, settings.worker_id, clock=clock)
    defer(worker.close)  # the first close registered: it runs last
    return Mode(source=worker.generator, collectors=[worker.reservation], health=lambda: (True, {}))


def clustered(
    settings: ServerSettings, clock: Callable[[], int], client_factory: Callable[..., Any]
) -> Mode:
    """A worker id leased from ZooKeeper once the port is bound, served while the
    session is proven (see ``Cluster``)."""
    slot = WorkerSlot(settings.ids)
    mode = Mode(source=slot, collectors=[CurrentReservation(slot)], health=lambda: (False, {}))

    def open_worker(worker_id: int, remote: tuple[MarkStore, int]) -> Worker:
        return Worker.open(settings.worker, worker_id, clock=clock, remote=remote)

    def join(port: int, defer: Defer) -> None:
        cluster = Cluster(
            settings.cluster,
            slot,
            clock,
            advertised_address(settings.cluster, port),
            open_worker=open_worker,
            client_factory=client_factory,
        )
        cluster.connect()
        # Closed before the Thrift server and the audit trail, as the worker is: calls
        # still in flight then meet a sealed generator, not an id nobody audits.
        defer(cluster.close)
        try:
            cluster.check_peers()
            cluster.register()
        except (KazooException, KazooTimeoutError) as e:
            raise StartupRefused(
                f"ZooKeeper failed during start-up: {type(e).__name__}: {e}; start again"
            ) from None
        mode.collectors.append(cluster)
        mode.health = cluster.health

    mode.join = join
    return mode


class Node:
    """One server process: ``start()``, ``run()`` until ``request_stop()``, ``close()``.

    ``clock`` is the wall clock ids are stamped with; ``zk_client_factory``
    makes ZooKeeper clients in cluster mode.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        zk_client_factory: Callable[..., Any] = KazooClient,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._zk_client_factory = zk_client_factory
        self._cleanup = contextlib.ExitStack()
        self._server: ThriftServer | None = None
        self.mode: Mode | None = None
        self.thrift_address = ("", 0)
        self.admin_address = ("", 0)

    def start(self) -> None:
        """Build and open everything; on failure close what was opened and raise
        (``ConfigurationError``: bad settings or a port in use; ``StartupRefused``:
        starting could repeat ids)."""
        try:
            self._start()
        except BaseException:
            self._cleanup.close()
            raise

    def _start(self) -> None:
        mode = self._open_mode()
        metrics = ServiceMetrics(
            mode.source, service_methods(), max_agents=self.settings.admin.max_agents
        )
        audit = self._open_audit(mode)
        self._server = self._open_thrift(mode, metrics, audit)
        self.thrift_address = self._server.bind()
        mode.join(self.thrift_address[1], self._cleanup.callback)  # peers can dial us now
        self.admin_address = self._open_admin(mode, metrics)

    def _open_mode(self) -> Mode:
        settings = self.settings
        if settings.zookeeper:
            mode = clustered(settings, self._clock, self._zk_client_factory)
        else:
            mode = standalone(settings, self._clock, self._cleanup.callback)
        self.mode = mode
        return mode

    def _open_audit(self, mode: Mode) -> AuditLog | None:
        audit_settings = self.settings.audit
        if not audit_settings.path:
            return None
        audit = AuditLog(audit_settings.path, audit_settings.queue)
        audit.start()
        self._cleanup.callback(audit.close)  # after the server: every id issued is written
        mode.collectors.append(audit)
        return audit

    def _open_thrift(
        self, mode: Mode, metrics: ServiceMetrics, audit: AuditLog | None
    ) -> ThriftServer:
        thrift = self.settings.thrift
        tls = (
            server_context(thrift.tls_cert, thrift.tls_key, thrift.tls_client_ca)
            if thrift.tls_cert
            else None
        )
        source, clock = mode.source, self._clock

        def make_processor(stats: ConnectionStats) -> Processor:
            return Processor(SnowflakeHandler(source, metrics, stats, clock, audit), stats)

        server = ThriftServer(make_processor, metrics, thrift, tls=tls)
        self._cleanup.callback(server.close)
        return server

    def _open_admin(self, mode: Mode, metrics: ServiceMetrics) -> tuple[str, int]:
        source = mode.source

        def report() -> tuple[bool, dict[str, object]]:
            healthy, details = mode.health()
            ids = source.settings
            return healthy, {
                "worker_id": ids.worker_id,
                "datacenter_id": ids.datacenter_id,
                "version": __version__,
                **details,
            }

        admin = AdminServer(metrics.registry(*mode.collectors), report, self.settings.admin)
        admin.start()
        self._cleanup.callback(admin.stop)
        return admin.address

    def run(self) -> None:
        """Serve until :meth:`request_stop`; calls in flight finish first."""
        assert self._server is not None, "start() first"
        self._server.serve_forever()

    def request_stop(self) -> None:
        """Ask :meth:`run` to return. Safe from a signal handler or any thread."""
        if self._server is not None:
            self._server.request_shutdown()

    def close(self) -> None:
        """Stop everything started, in reverse: the exact final marks are written."""
        self._cleanup.close()


def serve(settings: ServerSettings) -> int:
    """Run a server with ``settings`` until SIGTERM/SIGINT; return the exit code."""
    node = Node(settings)
    node.start()
    try:

        def on_signal(signum: int, _frame: object) -> None:
            log.info("received %s: finishing calls in flight", signal.Signals(signum).name)
            node.request_stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        ids = node.mode.source.settings if node.mode is not None else settings.ids
        log.info(
            "serving %s/binary on %s:%d (datacenter %d, worker %d); metrics on "
            "http://%s:%d/metrics",
            settings.transport, *node.thrift_address, ids.datacenter_id, ids.worker_id,
            *node.admin_address,
        )  # fmt: skip
        print(ready_line(node.thrift_address, node.admin_address), flush=True)
        node.run()
    finally:
        node.close()
    log.info("stopped")
    return 0
