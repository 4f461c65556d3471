"""The Thrift transports a server and its clients can speak (always binary protocol),
and bare Thrift clients over them."""

from __future__ import annotations

import socket
from typing import Any

from thriftpy2.protocol import TCyBinaryProtocol
from thriftpy2.thrift import TClient
from thriftpy2.transport import TCyBufferedTransport, TCyFramedTransport, TSocket

from ._idl import snowflake_thrift

__all__ = [
    "TRANSPORTS",
    "Transport",
    "address_family",
    "binary_protocol",
    "client_socket",
    "open_client",
    "server_socket",
]

Transport = str
"""``"framed"``: what Twitter's clients speak (the original ran a THsHaServer);
``"buffered"``: plain. The keys of :data:`TRANSPORTS`."""

TRANSPORTS: dict[str, type[TCyFramedTransport] | type[TCyBufferedTransport]] = {
    "framed": TCyFramedTransport,
    "buffered": TCyBufferedTransport,
}


def address_family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal such as ``::1``, else AF_INET."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def binary_protocol(sock: TSocket, transport: Transport) -> TCyBinaryProtocol:
    """The binary protocol over ``transport`` over ``sock``: how both sides talk."""
    return TCyBinaryProtocol(TRANSPORTS[transport](sock))  # type: ignore[no-untyped-call]


def client_socket(host: str, port: int, timeout_s: float) -> TSocket:
    """An unopened client socket whose connect and reads time out after ``timeout_s``."""
    return TSocket(host, port, socket_timeout=int(timeout_s * 1000))  # type: ignore[no-untyped-call]


def server_socket(conn: socket.socket) -> TSocket:
    """A Thrift socket around a connected socket (a server's accepted connection, or a
    client's own connection opened with its own options)."""
    return TSocket(sock=conn)  # type: ignore[no-untyped-call]


def open_client(
    host: str, port: int, transport: Transport, timeout_s: float, service: Any = None
) -> Any:
    """A bare, connected thriftpy2 client of ``service`` (the Snowflake service by
    default) that never reconnects: for peer checks, tests and load generators."""
    protocol = binary_protocol(client_socket(host, port, timeout_s), transport)
    protocol.trans.open()
    return TClient(service or snowflake_thrift().Snowflake, protocol)
