"""What a test does with a running server, in a process or in this one: call it, scrape it."""

from __future__ import annotations

import socket
import ssl
import struct
import urllib.error
import urllib.request
import uuid
from typing import Any, TypeVar

from snowflake_thrift_client import SnowflakeClient
from snowflake_thrift_client._idl import snowflake_thrift
from snowflake_thrift_client._transports import (
    Transport,
    binary_protocol,
    open_client,
    server_socket,
)
from thriftpy2.protocol import TBinaryProtocol
from thriftpy2.thrift import TClient, TMessageType
from thriftpy2.transport import TMemoryBuffer

_Client = TypeVar("_Client")


class Endpoints:
    """Clients of a server on ``host:port`` (Thrift) and ``host:metrics_port`` (admin).

    Subclasses set the attributes; clients made here are closed by :meth:`close_clients`.
    """

    host = "127.0.0.1"
    port: int
    metrics_port: int
    transport: Transport
    _clients: list[Any]

    def client(self, **kwargs: Any) -> SnowflakeClient:
        return self.keep(SnowflakeClient(self.host, self.port, transport=self.transport, **kwargs))

    def keep(self, client: _Client) -> _Client:
        """``client``, closed by :meth:`close_clients` with those made here."""
        self._clients.append(client)
        return client

    def raw_client(self, service: Any = None, timeout_s: float = 5.0) -> Any:
        """A bare thriftpy2 client on one connection that never reconnects."""
        return self.keep(open_client(self.host, self.port, self.transport, timeout_s, service))

    def http_get(self, path: str) -> tuple[int, str]:
        url = f"http://{self.host}:{self.metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read().decode()

    def metrics(self) -> str:
        status, body = self.http_get("/metrics")
        assert status == 200
        return body

    def close_clients(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()


def free_port() -> int:
    """A loopback port nothing listens on (for a peer or ZooKeeper that is not there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def unique_scope() -> str:
    """A host lock scope of its own: servers of tests running at once never share a lock."""
    return f"test-{uuid.uuid4().hex[:12]}"


def encode_call(method: str, *, framed: bool = True, **args: object) -> bytes:
    """The bytes a client sends for a well-formed call of ``method`` (framed: with the
    4-byte length in front)."""
    buffer: Any = TMemoryBuffer()  # type: ignore[no-untyped-call]  # thriftpy2 is untyped
    protocol: Any = TBinaryProtocol(buffer)  # type: ignore[no-untyped-call]
    protocol.write_message_begin(method, TMessageType.CALL, 0)
    protocol.write_struct(getattr(snowflake_thrift().Snowflake, f"{method}_args")(**args))
    protocol.write_message_end()
    body = bytes(buffer.getvalue())
    return struct.pack("!i", len(body)) + body if framed else body


def take_ids(server: Endpoints, rounds: int, batch: int = 100, agent: str = "test") -> list[int]:
    """``rounds`` get_ids calls of ``batch`` ids on one new connection, in order."""
    client = server.raw_client()
    ids: list[int] = []
    for _ in range(rounds):
        ids.extend(client.get_ids(agent, batch))
    return ids


def tls_client(server: Endpoints, context: ssl.SSLContext) -> Any:
    """A bare thriftpy2 client over TLS with ``context``, closed with the server's clients."""
    raw = socket.create_connection((server.host, server.port), timeout=5)
    try:
        sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
    except BaseException:
        raw.close()
        raise
    client = TClient(snowflake_thrift().Snowflake, binary_protocol(server_socket(sock), "framed"))
    return server.keep(client)  # closed when the server is stopped


def read_to_close(sock: socket.socket) -> bytes:
    """All ``sock`` receives until the peer closes it (a reset after its answer ends it
    too: a server closing with a request still unread resets the connection)."""
    answer = bytearray()
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass
    return bytes(answer)


class BytesReader:
    """A transport over fixed bytes for thriftpy2's pure-Python protocol: ``position``
    is how far it was read; a read past the end raises rather than returning less."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.position = 0

    def read(self, n: int) -> bytes:
        chunk = self._data[self.position : self.position + n]
        if len(chunk) < n:
            raise EOFError(f"{n} bytes asked, {len(chunk)} left")
        self.position += n
        return chunk
