"""One connection to one server: :class:`SnowflakeClient`, the building block of the pool."""

from __future__ import annotations

import math
import socket
import ssl
from types import TracebackType
from typing import Any, TypeVar

from thriftpy2.thrift import TApplicationException, TClient
from thriftpy2.transport import TTransportException

from ._address import DEFAULT_PORT, Server, parse_server
from ._errors import (
    CallFailedError,
    ConfigurationError,
    ConnectionFailedError,
    WrongProtocolError,
)
from ._idl import (
    count_arg,
    declared_exceptions,
    layout_from_thrift,
    request_error,
    snowflake_thrift,
)
from ._layout import Layout
from ._transports import TRANSPORTS, ForeignReply, ReplySocket, Transport, binary_protocol

__all__ = ["DEFAULT_AGENT", "Closing", "SnowflakeClient", "positive_seconds"]

DEFAULT_AGENT = "snowflake-python"

_Self = TypeVar("_Self", bound="Closing")


def call_failed(address: str, cause: BaseException, *, connected: bool) -> CallFailedError:
    """The :class:`CallFailedError` for ``cause`` (chain it with ``from cause``)."""
    if isinstance(cause, ForeignReply):
        return WrongProtocolError(address, f"{cause}, not a Thrift server", protocol=cause.protocol)
    timed_out = isinstance(cause, TimeoutError) or (
        isinstance(cause, TTransportException) and cause.type == TTransportException.TIMED_OUT
    )
    reason = _describe(cause, connected)
    if not timed_out and isinstance(cause, (TTransportException, ConnectionError, EOFError)):
        # The connection broke during the call: a ConnectionError to the caller too.
        return ConnectionFailedError(address, reason, connected=connected)
    return CallFailedError(address, reason, connected=connected, timed_out=timed_out)


def _declared_classes() -> tuple[type[Exception], ...]:
    """The IDL's exception classes that some method declares in its ``throws``."""
    service = snowflake_thrift().Snowflake
    found: dict[type[Exception], None] = {}
    for name in service.thrift_services:
        for _, cls in declared_exceptions(name).values():
            found[cls] = None
    return tuple(found)


def _describe(cause: BaseException, connected: bool) -> str:
    if isinstance(cause, TimeoutError):
        return "timed out" if connected else "connect timed out"
    if isinstance(cause, TApplicationException):
        return f"application error ({cause.type}): {cause.message}"
    if isinstance(cause, TTransportException):
        return f"{cause.message or 'transport error'} (the connection was closed)"
    text = str(cause) or type(cause).__name__
    return text if connected else f"cannot connect: {text}"


def positive_seconds(name: str, value: float) -> float:
    """``value`` as a float if it is a finite number of seconds above 0; else
    ``ConfigurationError`` naming ``name``."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


class Closing:
    """``with`` support for things with a ``close()``: entering gives the thing itself."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SnowflakeClient(Closing):
    """One connection to one server, opened on first use (or by :meth:`open`).

    Not thread-safe: share a :class:`SnowflakePool` between threads instead.
    ``timeout`` bounds the wait for each reply and, unless ``connect_timeout``
    is given, for the connection, in seconds. With ``ssl_context`` (see
    :func:`client_context`) it speaks TLS. Declared errors are raised as
    :class:`RequestError` and leave the connection open; any
    other failure closes it and raises :class:`CallFailedError`, and the next
    call opens a new connection.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        agent: str = DEFAULT_AGENT,
        transport: Transport = "framed",
        timeout: float = 5.0,
        connect_timeout: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ConfigurationError(
                f"transport must be one of {sorted(TRANSPORTS)}, got {transport!r}"
            )
        self.host, self.port = parse_server((host, port))
        self.ssl_context = ssl_context
        self.agent = agent
        self.transport: Transport = transport
        self.timeout = positive_seconds("timeout", timeout)
        self.connect_timeout = positive_seconds(
            "connect_timeout", self.timeout if connect_timeout is None else connect_timeout
        )
        self.address = Server(self.host, self.port).address
        self._client: Any = None
        self._service = snowflake_thrift().Snowflake
        self._declared = _declared_classes()

    @property
    def is_open(self) -> bool:
        """Whether a connection is open now."""
        return self._client is not None

    def open(self) -> None:
        """Connect now rather than on the first call; raises :class:`CallFailedError`."""
        if self._client is not None:
            return
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as e:
            raise call_failed(self.address, e, connected=False) from e
        if self.ssl_context is not None:
            try:  # the handshake is bounded by the connect timeout too
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
            except OSError as e:  # ssl.SSLError included
                sock.close()
                raise call_failed(self.address, e, connected=False) from e
        try:
            sock.settimeout(self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            protocol = binary_protocol(ReplySocket(sock), self.transport)
            self._client = TClient(self._service, protocol)
        except BaseException:
            sock.close()
            raise

    def _call(self, method: str, *args: object) -> Any:
        self.open()
        try:
            return getattr(self._client, method)(*args)
        except self._declared as e:
            raise request_error(e) from e
        except Exception as e:  # whatever it was, this connection is done
            self.close()
            raise call_failed(self.address, e, connected=True) from e
        except BaseException:  # KeyboardInterrupt mid-call: the reply may still come
            self.close()
            raise

    def next_id(self, agent: str | None = None) -> int:
        """One new id (``get_id``)."""
        return int(self._call("get_id", agent or self.agent))

    def next_ids(self, count: int, agent: str | None = None) -> list[int]:
        """``count`` new ids (1..4,096 by default) in one round trip, increasing (``get_ids``)."""
        return [int(i) for i in self._call("get_ids", agent or self.agent, count_arg(count))]

    def layout(self) -> tuple[Layout, int, int]:
        """The server's layout, datacenter id and worker id, to decode its ids locally."""
        return layout_from_thrift(self._call("get_layout"))

    def worker_id(self) -> int:
        return int(self._call("get_worker_id"))

    def datacenter_id(self) -> int:
        return int(self._call("get_datacenter_id"))

    def timestamp(self) -> int:
        """The server's clock, in ms since the Unix epoch."""
        return int(self._call("get_timestamp"))

    def close(self) -> None:
        """Close the connection, if open; the client can still be used after."""
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def __repr__(self) -> str:
        state = "open" if self.is_open else "closed"
        return f"<SnowflakeClient {self.address} {self.transport} {state}>"
