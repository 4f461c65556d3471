"""``snowflake-server``: one server process, from settings to exit code.

Start-up order: validate settings, build the generator (which checks the
clock against the epoch), bind the Thrift and metrics ports, print the ready
line, serve. SIGTERM or SIGINT: stop accepting, let calls in flight finish,
exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

from . import __version__
from .admin import AdminServer
from .config import ServerSettings, load_settings
from .errors import ConfigurationError
from .generator import IdGenerator, wall_clock_ms
from .handler import Processor, SnowflakeHandler, service_methods
from .metrics import ConnectionStats, ServiceMetrics
from .server import ThriftServer

__all__ = ["main", "serve"]

log = logging.getLogger("snowflake_server")

READY_PREFIX = "snowflake-server ready"
"""Start of the line printed on stdout once both ports accept connections."""


def serve(settings: ServerSettings) -> int:
    """Run a server with ``settings`` until SIGTERM/SIGINT; return the exit code."""
    generator = IdGenerator(settings.generator_settings(), clock=wall_clock_ms)
    metrics = ServiceMetrics(generator, service_methods(), max_agents=settings.max_agents)

    def make_processor(stats: ConnectionStats) -> Processor:
        return Processor(SnowflakeHandler(generator, metrics, stats, wall_clock_ms), stats)

    def health() -> tuple[bool, dict[str, object]]:
        return True, {
            "worker_id": settings.worker_id,
            "datacenter_id": settings.datacenter_id,
            "version": __version__,
        }

    server = ThriftServer(
        make_processor,
        metrics,
        host=settings.host,
        port=settings.port,
        transport="buffered" if settings.transport == "buffered" else "framed",
        idle_timeout_s=settings.idle_timeout,
    )
    try:
        thrift_host, thrift_port = server.bind()
        admin = AdminServer(
            metrics.registry(), health, host=settings.metrics_host, port=settings.metrics_port
        )
    except OSError as e:
        raise ConfigurationError(f"cannot listen: {e.strerror or e}") from None
    admin.start()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s: finishing calls in flight", signal.Signals(signum).name)
        server.request_shutdown()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    metrics_host, metrics_port = admin.address
    log.info(
        "serving %s/binary on %s:%d (datacenter %d, worker %d); metrics on http://%s:%d/metrics",
        settings.transport, thrift_host, thrift_port, settings.datacenter_id,
        settings.worker_id, metrics_host, metrics_port,
    )  # fmt: skip
    # Scripts and tests wait for this line instead of polling the ports.
    print(
        f"{READY_PREFIX} thrift={thrift_host}:{thrift_port} metrics={metrics_host}:{metrics_port}",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        admin.stop()
    log.info("stopped")
    return 0


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
        return serve(settings)
    except ConfigurationError as e:
        print(f"snowflake-server: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
