"""``snowflake-server``: one server process, from settings to exit code.

Start-up, standalone: validate settings; open the worker (lock its state
file, honour its high-water mark, reserve ahead); bind the Thrift and metrics
ports; print the ready line; serve. In cluster mode the Thrift port is bound
first (peers must be able to dial us), then ZooKeeper is reached, the peers
are checked and a worker id is registered (see ``cluster``). SIGTERM or
SIGINT: stop accepting, let calls in flight finish, write the exact final
marks, delete the registration, exit 0.

Exit codes: 0 after a signal, 2 for bad settings or a port in use, 3 when
starting could repeat ids (clock far behind the mark, unusable state file,
worker held by another process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError
from prometheus_client.registry import Collector

from . import __version__
from .admin import AdminServer
from .audit import AuditLog
from .cluster import Cluster, advertised_address
from .config import ServerSettings, load_settings
from .errors import ConfigurationError, StartupRefused
from .generator import IdSource, wall_clock_ms
from .handler import Processor, SnowflakeHandler, service_methods
from .metrics import ConnectionStats, ServiceMetrics
from .server import ThriftServer
from .supervisor import READY_PREFIX, Supervisor
from .tls import server_context
from .worker import CurrentReservation, Worker, WorkerSlot

__all__ = ["main", "serve"]

log = logging.getLogger("snowflake_server")


def serve(settings: ServerSettings) -> int:
    """Run a server with ``settings`` until SIGTERM/SIGINT; return the exit code."""
    clock = wall_clock_ms
    with contextlib.ExitStack() as cleanup:
        slot: WorkerSlot | None = None
        if settings.zookeeper:
            placeholder = settings.generator_settings(0 if settings.auto_worker_id else None)
            slot = WorkerSlot(placeholder)
            source: IdSource = slot
            collectors: list[Collector] = [CurrentReservation(slot)]
        else:
            worker = Worker.open(settings, settings.worker_id, clock=clock)
            cleanup.callback(worker.close)
            source = worker.generator
            collectors = [worker.reservation]
        metrics = ServiceMetrics(source, service_methods(), max_agents=settings.max_agents)

        audit = AuditLog(settings.audit_log, settings.audit_queue) if settings.audit_log else None
        if audit is not None:
            audit.start()
            cleanup.callback(audit.close)  # after the server: every id issued is written
            collectors.append(audit)
        tls = (
            server_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
            if settings.tls_cert
            else None
        )

        def make_processor(stats: ConnectionStats) -> Processor:
            return Processor(SnowflakeHandler(source, metrics, stats, clock, audit), stats)

        server = ThriftServer(
            make_processor,
            metrics,
            host=settings.host,
            port=settings.port,
            transport="buffered" if settings.transport == "buffered" else "framed",
            idle_timeout_s=settings.idle_timeout,
            max_connections=settings.max_connections,
            max_frame_size=settings.max_frame_size,
            tls=tls,
            reuse_port=settings.reuse_port,
        )
        cleanup.callback(server.close)
        try:
            thrift_host, thrift_port = server.bind()
        except OSError as e:
            raise ConfigurationError(
                f"cannot listen on {settings.host}:{settings.port}: {e}"
            ) from None

        def health() -> tuple[bool, dict[str, object]]:
            return True, {}

        if slot is not None:
            # Peers and clients must be able to dial us before we register.
            cluster = Cluster(settings, slot, clock, advertised_address(settings, thrift_port))
            cluster.connect()
            cleanup.callback(cluster.close)
            try:
                cluster.check_peers()
                cluster.register()
            except (KazooException, KazooTimeoutError) as e:
                raise StartupRefused(
                    f"ZooKeeper failed during start-up: {type(e).__name__}: {e}; start again"
                ) from None
            collectors.append(cluster)
            health = cluster.health

        def report() -> tuple[bool, dict[str, object]]:
            healthy, details = health()
            ids = source.settings
            return healthy, {
                "worker_id": ids.worker_id,
                "datacenter_id": ids.datacenter_id,
                "version": __version__,
                **details,
            }

        try:
            admin = AdminServer(
                metrics.registry(*collectors),
                report,
                host=settings.metrics_host,
                port=settings.metrics_port,
            )
        except OSError as e:
            raise ConfigurationError(
                f"cannot listen on {settings.metrics_host}:{settings.metrics_port}: {e}"
            ) from None
        admin.start()
        cleanup.callback(admin.stop)
        _run(settings, server, source, (thrift_host, thrift_port), admin.address)
    log.info("stopped")
    return 0


def _run(
    settings: ServerSettings,
    server: ThriftServer,
    source: IdSource,
    thrift: tuple[str, int],
    metrics: tuple[str, int],
) -> None:
    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s: finishing calls in flight", signal.Signals(signum).name)
        server.request_shutdown()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ids = source.settings
    log.info(
        "serving %s/binary on %s:%d (datacenter %d, worker %d); metrics on http://%s:%d/metrics",
        settings.transport, *thrift, ids.datacenter_id, ids.worker_id, *metrics,
    )  # fmt: skip
    # Scripts and tests wait for this line instead of polling the ports.
    print(
        f"{READY_PREFIX} thrift={thrift[0]}:{thrift[1]} metrics={metrics[0]}:{metrics[1]}",
        flush=True,
    )
    server.serve_forever()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``snowflake-server``."""
    try:
        settings = load_settings(argv, os.environ)
    except ConfigurationError as e:
        print(f"snowflake-server: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if settings.processes > 1:
            return Supervisor(settings).run()
        return serve(settings)
    except ConfigurationError as e:
        print(f"snowflake-server: error: {e}", file=sys.stderr)
        return 2
    except StartupRefused as e:
        print(f"snowflake-server: refusing to start: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
