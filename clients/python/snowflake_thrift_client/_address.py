"""Server addresses: ``("host", port)``, ``"host:port"``, ``"[::1]:port"`` or ``"host"``."""

from __future__ import annotations

import re
from typing import NamedTuple, Union

from ._errors import ConfigurationError

__all__ = ["DEFAULT_PORT", "ServerAddress", "parse_server"]

DEFAULT_PORT = 7609

ServerAddress = Union[tuple[str, int], str]
"""A server: ``("host", port)``, ``"host:port"``, ``"[::1]:port"`` or ``"host"`` (port 7609)."""


class Server(NamedTuple):
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


_HOST_PORT = re.compile(
    r"\[(?P<v6>[^\]]+)\](?::(?P<v6port>\d+))?|(?P<host>[^:\[\]]+)(?::(?P<port>\d+))?"
)


def parse_server(server: ServerAddress) -> tuple[str, int]:
    """``(host, port)`` from ``("host", port)``, ``"host:port"``, ``"[::1]:port"`` or ``"host"``."""
    if isinstance(server, str):
        match = _HOST_PORT.fullmatch(server.strip())
        if match is None:
            raise ConfigurationError(f"not a server address: {server!r} (expected HOST:PORT)")
        host = match["v6"] or match["host"]
        port_text = match["v6port"] or match["port"]
        port = int(port_text) if port_text else DEFAULT_PORT
    elif isinstance(server, tuple) and len(server) == 2:
        host, port = server
        if not isinstance(host, str) or not host or not isinstance(port, int):
            raise ConfigurationError(f"not a server address: {server!r} (expected (host, port))")
    else:
        raise ConfigurationError(f"not a server address: {server!r}")
    if not 0 < port < 65536:
        raise ConfigurationError(f"port out of range in {server!r}")
    return host, port
