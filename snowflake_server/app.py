"""``snowflake-server``: one server process, from settings to exit code.

Start-up order: validate settings; lock this worker's state file and read its
high-water mark; build the generator (which checks the clock against the
epoch); wait for the clock to pass the mark (or refuse); reserve ahead; bind
the Thrift and metrics ports; print the ready line; serve. SIGTERM or SIGINT:
stop accepting, let calls in flight finish, write the exact final mark, exit 0.

Exit codes: 0 after a signal, 2 for bad settings or a port in use, 3 when
starting could repeat ids (clock far behind the mark, unusable state file,
worker held by another process).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .admin import AdminServer
from .config import ServerSettings, load_settings
from .errors import ConfigurationError, StartupRefused
from .generator import IdGenerator, pause, wall_clock_ms
from .handler import Processor, SnowflakeHandler, service_methods
from .metrics import ConnectionStats, ServiceMetrics
from .reservation import Reservation, wait_for_clock
from .server import ThriftServer
from .state import StateFile

__all__ = ["main", "serve"]

log = logging.getLogger("snowflake_server")

READY_PREFIX = "snowflake-server ready"
"""Start of the line printed on stdout once both ports accept connections."""


def serve(settings: ServerSettings) -> int:
    """Run a server with ``settings`` until SIGTERM/SIGINT; return the exit code."""
    state = StateFile.open(Path(settings.state_dir), settings.datacenter_id, settings.worker_id)
    try:
        return _serve(settings, state)
    finally:
        state.close()


def _serve(settings: ServerSettings, state: StateFile) -> int:
    clock = wall_clock_ms
    mark = state.load(discard_corrupt=settings.discard_corrupt_state)
    resume_after = -1 if mark is None else mark
    reservation = Reservation(state, clock)
    # Until the first reservation is on disk the ceiling is the resume point:
    # no id can be stamped with a time that is not reserved.
    generator = IdGenerator(
        settings.generator_settings(),
        clock=clock,
        sleep=pause,
        resume_after_ms=resume_after,
        ceiling_ms=resume_after,
        reserve=reservation.reserve,
    )
    if mark is None:
        log.info("no high-water mark in %s: first start of this worker here", state.path)
    else:
        reservation.startup_wait_s = wait_for_clock(
            mark, clock, pause, settings.max_startup_wait, str(state.path)
        )
    generator.raise_ceiling(reservation.reserve(clock()))
    reservation.start(generator)
    try:
        return _serve_ids(settings, generator, reservation)
    finally:
        reservation.finish(generator, floor_ms=resume_after)


def _serve_ids(settings: ServerSettings, generator: IdGenerator, reservation: Reservation) -> int:
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
            metrics.registry(reservation),
            health,
            host=settings.metrics_host,
            port=settings.metrics_port,
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
    except StartupRefused as e:
        print(f"snowflake-server: refusing to start: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
