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
    "ForeignReply",
    "ReplySocket",
    "Transport",
    "address_family",
    "binary_protocol",
    "client_socket",
    "foreign_reply",
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


class ForeignReply(Exception):
    """The first bytes of a reply are another protocol's (see :func:`foreign_reply`)."""

    def __init__(self, protocol: str, description: str) -> None:
        self.protocol = protocol
        super().__init__(description)


_TLS_RECORDS = {0x15: "alert", 0x16: "handshake"}


def foreign_reply(head: bytes) -> ForeignReply | None:
    """What the first bytes of a reply show, if they cannot start a Thrift reply;
    ``None`` while they can (or too few have come to tell).

    A framed reply starts with its length, a buffered one with 0x80 0x01 (strict) or
    a name's length: as a length, four printable characters are over 538 MB, an
    HTTP reply's ``HTTP`` 1.2 GB, a TLS record's 0x15 0x03 or 0x16 0x03 over 352 MB,
    when the largest reply (a full batch of ids) is a few dozen kB. So these bytes
    are recognised as soon as they come, with no false alarm on a Thrift reply.
    """
    if len(head) >= 2 and head[0] in _TLS_RECORDS and head[1] == 0x03:
        return ForeignReply("TLS", f"a TLS server answered (a TLS {_TLS_RECORDS[head[0]]})")
    if len(head) < 4:
        return None
    line = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0][:80].decode("ascii", "replace")
    if head.startswith(b"HTTP"):
        return ForeignReply("HTTP", f"an HTTP server answered ({line})")
    if head.startswith(b"SSH-"):
        return ForeignReply("SSH", f"an SSH server answered ({line})")
    if all(0x20 <= byte < 0x7F for byte in head[:4]):
        return ForeignReply("text", f"a server of another protocol answered ({line!r})")
    return None


class ReplySocket(TSocket):
    """A client's Thrift socket that raises :class:`ForeignReply` as soon as a reply's
    first bytes show another protocol, rather than waiting (maybe until the timeout)
    for the gigabyte those bytes announce as a frame length."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock=sock)  # type: ignore[no-untyped-call]
        self._head: bytes | None = None  # the start of the reply being read, until told

    def write(self, buf: bytes) -> None:
        super().write(buf)  # type: ignore[no-untyped-call]
        self._head = b""  # one call in flight: what comes next starts its reply

    def read(self, sz: int) -> bytes:
        data: bytes = super().read(sz)  # type: ignore[no-untyped-call]
        if self._head is not None:
            head = self._head + data
            foreign = foreign_reply(head)
            if foreign is not None:
                raise foreign
            self._head = head if len(head) < 4 else None
        return data
