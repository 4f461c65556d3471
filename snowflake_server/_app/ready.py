"""The ready line: what a server prints on stdout once its ports accept connections.

Scripts, the supervisor and the tests wait for this line instead of polling
the ports; this module is the one place that writes and reads it.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["READY_PREFIX", "ReadyLine", "parse_ready_line", "ready_line"]

READY_PREFIX = "snowflake-server ready"


class ReadyLine(NamedTuple):
    """The addresses a ready line announces, as ``(host, port)``; ``http`` only with
    ``--http-port``."""

    thrift: tuple[str, int]
    metrics: tuple[str, int]
    http: tuple[str, int] | None = None


def ready_line(
    thrift: tuple[str, int], metrics: tuple[str, int], http: tuple[str, int] | None = None
) -> str:
    """``snowflake-server ready thrift=HOST:PORT metrics=HOST:PORT[ http=HOST:PORT]``."""
    line = f"{READY_PREFIX} thrift={thrift[0]}:{thrift[1]} metrics={metrics[0]}:{metrics[1]}"
    return line + (f" http={http[0]}:{http[1]}" if http is not None else "")


def parse_ready_line(line: str) -> ReadyLine | None:
    """The addresses in ``line`` if it is a ready line, else None."""
    if not line.startswith(READY_PREFIX):
        return None
    fields = dict(part.split("=", 1) for part in line[len(READY_PREFIX) :].split())

    def address(text: str) -> tuple[str, int]:
        host, _, port = text.rpartition(":")
        return host, int(port)

    http = address(fields["http"]) if "http" in fields else None
    return ReadyLine(address(fields["thrift"]), address(fields["metrics"]), http)
