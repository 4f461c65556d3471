"""The Thrift transports a server and its clients can speak (always binary protocol)."""

from __future__ import annotations

import socket
from typing import Literal

from thriftpy2.protocol import TCyBinaryProtocol
from thriftpy2.transport import TCyBufferedTransport, TCyFramedTransport, TSocket

__all__ = ["TRANSPORTS", "Transport", "binary_protocol", "client_socket", "server_socket"]

Transport = Literal["framed", "buffered"]
"""framed: what Twitter's clients speak (the original ran a THsHaServer); buffered: plain."""

TRANSPORTS: dict[str, type[TCyFramedTransport] | type[TCyBufferedTransport]] = {
    "framed": TCyFramedTransport,
    "buffered": TCyBufferedTransport,
}


def binary_protocol(sock: TSocket, transport: Transport) -> TCyBinaryProtocol:
    """The binary protocol over ``transport`` over ``sock``: how both sides talk."""
    return TCyBinaryProtocol(TRANSPORTS[transport](sock))  # type: ignore[no-untyped-call]


def client_socket(host: str, port: int, timeout_s: float) -> TSocket:
    """An unopened client socket whose connect and reads time out after ``timeout_s``."""
    return TSocket(host, port, socket_timeout=int(timeout_s * 1000))  # type: ignore[no-untyped-call]


def server_socket(conn: socket.socket) -> TSocket:
    """A Thrift socket around a connection a server accepted."""
    return TSocket(sock=conn)  # type: ignore[no-untyped-call]
