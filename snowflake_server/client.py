"""Python clients for snowflake servers.

:class:`SnowflakePool` is the client to use in an application: it is
thread-safe, keeps a few connections open, fails over across servers and can
prefetch ids::

    from snowflake_server import SnowflakePool

    with SnowflakePool(["10.0.0.1:7609", "10.0.0.2:7609"], agent="my-service") as ids:
        one = ids.next_id()
        batch = ids.next_ids(100)

:class:`SnowflakeClient` is one connection to one server, the building block
of the pool. It is not thread-safe.

Errors, all under :class:`~snowflake_server.SnowflakeError`:

* the errors the IDL declares arrive as this package's
  :class:`~snowflake_server.RequestError` of the same name:
  :class:`~snowflake_server.InvalidUserAgentError`,
  :class:`~snowflake_server.InvalidCountError`, and
  :class:`~snowflake_server.ClockMovedBackwardsError` for the server's
  ``InvalidSystemClock``. The connection stays open;
* :class:`CallFailedError`: a call to one server failed any other way (no
  connection, a timeout, a dropped connection, a reply that is not Thrift, a
  Thrift application error). The connection is discarded: thriftpy2 does not
  check sequence ids, so a connection that timed out would hand the late reply
  of one call to the next;
* :class:`NoServerAvailableError`: a pool ran out of servers or attempts.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, NamedTuple, Self, TypeAlias, TypeGuard, cast

from thriftpy2.thrift import TApplicationException, TClient, TType
from thriftpy2.transport import TTransportException

from . import errors
from .errors import (
    ClockMovedBackwardsError,
    InvalidCountError,
    InvalidUserAgentError,
    RequestError,
    SnowflakeError,
)
from .generator import Layout
from .idl_loader import snowflake_thrift
from .transports import TRANSPORTS, Transport, binary_protocol, server_socket

__all__ = [
    "DEFAULT_AGENT",
    "DEFAULT_PORT",
    "CallFailedError",
    "Discovery",
    "NoServerAvailableError",
    "ServerAddress",
    "SnowflakeClient",
    "SnowflakePool",
    "parse_server",
]

log = logging.getLogger(__name__)

DEFAULT_AGENT = "snowflake-python"
DEFAULT_PORT = 7609

ServerAddress: TypeAlias = tuple[str, int] | str
"""A server: ``("host", port)``, ``"host:port"``, ``"[::1]:port"`` or ``"host"`` (port 7609)."""

Discovery: TypeAlias = Callable[[], Iterable[ServerAddress]]
"""A callable that returns the servers to use now, e.g. read from a registry."""


class CallFailedError(SnowflakeError):
    """A call to one server failed for a reason the IDL does not declare.

    The cause (a timeout, a refused or dropped connection, a Thrift application
    error...) is ``__cause__``. The connection was discarded.
    """

    def __init__(self, address: str, cause: BaseException, *, connected: bool) -> None:
        self.address = address
        #: False if no connection could be opened at all.
        self.connected = connected
        #: True if the server did not answer within the timeout.
        self.timed_out = isinstance(cause, TimeoutError) or (
            isinstance(cause, TTransportException) and cause.type == TTransportException.TIMED_OUT
        )
        #: What went wrong, in a few words.
        self.reason = _describe(cause, connected)
        super().__init__(f"{address}: {self.reason}")


class NoServerAvailableError(SnowflakeError):
    """No server could serve the call: every attempt failed.

    ``failures`` lists ``(address, error)`` for each attempt, in order; each
    error is a :class:`CallFailedError`, or the declared error with which that
    node refused (:class:`~snowflake_server.ClockMovedBackwardsError`, say).
    """

    def __init__(self, message: str, failures: Sequence[tuple[str, SnowflakeError]] = ()) -> None:
        self.failures = tuple(failures)
        details = "; ".join(f"{error}" for _, error in self.failures)
        super().__init__(f"{message}: {details}" if details else message)


def _describe(cause: BaseException, connected: bool) -> str:
    if isinstance(cause, TimeoutError):
        return "timed out" if connected else "connect timed out"
    if isinstance(cause, TApplicationException):
        return f"application error ({cause.type}): {cause.message}"
    if isinstance(cause, TTransportException):
        return f"{cause.message or 'transport error'} (the connection was closed)"
    text = str(cause) or type(cause).__name__
    return text if connected else f"cannot connect: {text}"


class _Server(NamedTuple):
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
            raise ValueError(f"not a server address: {server!r} (expected HOST:PORT)")
        host = match["v6"] or match["host"]
        port_text = match["v6port"] or match["port"]
        port = int(port_text) if port_text else DEFAULT_PORT
    elif isinstance(server, tuple) and len(server) == 2:
        host, port = server
        if not isinstance(host, str) or not host or not isinstance(port, int):
            raise ValueError(f"not a server address: {server!r} (expected (host, port))")
    else:
        raise ValueError(f"not a server address: {server!r}")
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {server!r}")
    return host, port


def _positive_seconds(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


_CALLER_ERRORS = (InvalidUserAgentError, InvalidCountError)
"""Declared errors that are the caller's fault: another server would refuse the same call."""


@functools.cache
def _declared_errors() -> tuple[type[Exception], ...]:
    """The IDL's exception classes that some method declares in its ``throws``."""
    service = snowflake_thrift().Snowflake
    declared: dict[type[Exception], None] = {}
    for name in service.thrift_services:
        result = getattr(service, f"{name}_result")
        for field_id, spec in result.thrift_spec.items():
            if field_id != 0 and spec[0] == TType.STRUCT:
                declared[spec[2]] = None
    return tuple(declared)


def _request_error(error: Exception) -> RequestError:
    """This package's error for an exception the IDL declares (same name, or
    ``ClockMovedBackwardsError`` for ``InvalidSystemClock``)."""
    message = str(getattr(error, "message", "") or "")
    name = type(error).__name__
    if name == "InvalidSystemClock":
        found = re.search(r"(\d+) milli", message)
        clock_error = ClockMovedBackwardsError(int(found[1]) if found else 0)
        clock_error.args = (message,)  # the server's own wording
        return clock_error
    ours = getattr(errors, name, None)
    if isinstance(ours, type) and issubclass(ours, RequestError) and ours is not RequestError:
        return ours(message)
    return RequestError(f"{name}: {message}")


class Closing:
    """``with`` support for things with a ``close()``: entering gives the thing itself."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
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
    :func:`snowflake_server.tls.client_context`) it speaks TLS. Declared errors are raised as
    :class:`~snowflake_server.RequestError` and leave the connection open; any
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
            raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, got {transport!r}")
        self.host, self.port = parse_server((host, port))
        self.ssl_context = ssl_context
        self.agent = agent
        self.transport: Transport = transport
        self.timeout = _positive_seconds("timeout", timeout)
        self.connect_timeout = _positive_seconds(
            "connect_timeout", self.timeout if connect_timeout is None else connect_timeout
        )
        self.address = _Server(self.host, self.port).address
        self._client: Any = None
        self._service = snowflake_thrift().Snowflake
        self._declared = _declared_errors()

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
            raise CallFailedError(self.address, e, connected=False) from e
        if self.ssl_context is not None:
            try:  # the handshake is bounded by the connect timeout too
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
            except OSError as e:  # ssl.SSLError included
                sock.close()
                raise CallFailedError(self.address, e, connected=False) from e
        try:
            sock.settimeout(self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            protocol = binary_protocol(server_socket(sock), self.transport)
            self._client = TClient(self._service, protocol)
        except BaseException:
            sock.close()
            raise

    def _call(self, method: str, *args: object) -> Any:
        self.open()
        try:
            return getattr(self._client, method)(*args)
        except self._declared as e:
            raise _request_error(e) from e
        except Exception as e:  # whatever it was, this connection is done
            self.close()
            raise CallFailedError(self.address, e, connected=True) from e
        except BaseException:  # KeyboardInterrupt mid-call: the reply may still come
            self.close()
            raise

    def next_id(self, agent: str | None = None) -> int:
        """One new id (``get_id``)."""
        return int(self._call("get_id", agent or self.agent))

    def next_ids(self, count: int, agent: str | None = None) -> list[int]:
        """``count`` new ids (1..4,096 by default) in one round trip, increasing (``get_ids``)."""
        return [int(i) for i in self._call("get_ids", agent or self.agent, count)]

    def layout(self) -> tuple[Layout, int, int]:
        """The server's layout, datacenter id and worker id, to decode its ids locally."""
        raw = self._call("get_layout")
        layout = Layout(
            epoch_ms=raw.epoch_ms,
            timestamp_bits=raw.timestamp_bits,
            datacenter_id_bits=raw.datacenter_id_bits,
            worker_id_bits=raw.worker_id_bits,
            sequence_bits=raw.sequence_bits,
        )
        return layout, raw.datacenter_id, raw.worker_id

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


class SnowflakePool(Closing):
    """A thread-safe client for one or more snowflake servers.

    ``servers`` is one address, a sequence of them, or a :data:`Discovery`
    callable that returns the current list (called at the first call and then
    at most every ``refresh_interval`` seconds; if it fails, the last list is
    kept). Each call borrows a connection to one server: an idle one if there is
    one, else a new one, with new connections spread over the servers in turn.
    At most ``pool_size`` idle connections are kept; more threads at once simply
    open more connections. Timeouts are in seconds, as for :class:`SnowflakeClient`;
    ``ssl_context`` makes every connection TLS.

    **Failover.** If a call fails with a :class:`CallFailedError` (no connection,
    a timeout, a dropped connection...) or with a declared error that says this
    node cannot serve now, such as :class:`~snowflake_server.ClockMovedBackwardsError`
    (another node may have a good clock), it is retried on another server, up to
    ``attempts`` tries in all (default: one per server, plus one). A server that
    failed is tried last for the next ``retry_failed_after`` seconds. A failure
    on a connection that sat idle in the pool (the server may have closed it) is
    retried on a fresh connection without counting as an attempt. When every
    attempt failed, :class:`NoServerAvailableError` is raised. The caller's own
    errors, :class:`~snowflake_server.InvalidUserAgentError` and
    :class:`~snowflake_server.InvalidCountError`, are raised at once: every
    server would refuse them.

    **Prefetch.** With ``prefetch=N`` (N > 0), :meth:`next_id` hands out ids from
    a local buffer, refilled by one ``get_ids(N)`` call when empty: one round
    trip serves N calls. The trade-off: an id may have been made up to the time
    it took to use the buffer before the call that returns it (bound it with
    ``prefetch_max_age`` seconds: older ids are thrown away), so ids no longer
    tell when ``next_id`` was called; ids unused when the pool closes are lost
    (ids are never reused, so this only leaves gaps). Threads take ids from the
    buffer in turn, so the ids handed out are increasing in the order they are
    handed out, but only while they come from one server: after a failover they
    come from another worker. :meth:`next_ids` and calls with another ``agent``
    always go to the server.
    """

    def __init__(
        self,
        servers: ServerAddress | Sequence[ServerAddress] | Discovery = ("127.0.0.1", DEFAULT_PORT),
        *,
        agent: str = DEFAULT_AGENT,
        transport: Transport = "framed",
        timeout: float = 5.0,
        connect_timeout: float | None = None,
        attempts: int | None = None,
        pool_size: int = 8,
        retry_failed_after: float = 1.0,
        refresh_interval: float = 5.0,
        prefetch: int = 0,
        prefetch_max_age: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, got {transport!r}")
        if attempts is not None and not (isinstance(attempts, int) and attempts >= 1):
            raise ValueError(f"attempts must be at least 1, got {attempts!r}")
        if not (isinstance(pool_size, int) and pool_size >= 0):
            raise ValueError(f"pool_size must be 0 or more, got {pool_size!r}")
        if not (isinstance(prefetch, int) and prefetch >= 0):
            raise ValueError(f"prefetch must be 0 (off) or a batch size, got {prefetch!r}")
        self.agent = agent
        self.transport: Transport = transport
        self.timeout = _positive_seconds("timeout", timeout)
        self.connect_timeout = _positive_seconds(
            "connect_timeout", self.timeout if connect_timeout is None else connect_timeout
        )
        self.attempts = attempts
        self.pool_size = pool_size
        self.retry_failed_after = max(0.0, float(retry_failed_after))
        self.refresh_interval = _positive_seconds("refresh_interval", refresh_interval)
        self.prefetch = prefetch
        self.ssl_context = ssl_context
        self.prefetch_max_age = (
            None
            if prefetch_max_age is None
            else _positive_seconds("prefetch_max_age", prefetch_max_age)
        )

        self._discover: Discovery | None = None
        self._discovery_error: Exception | None = None
        self._servers: tuple[_Server, ...] = ()
        if callable(servers):
            self._discover = servers
        else:
            if _is_one(servers):
                self._servers = self._parse_servers([servers])
            else:
                self._servers = self._parse_servers(cast(Sequence[ServerAddress], servers))
            if not self._servers:
                raise ValueError("no servers given")
        self._refreshed_at = -math.inf
        self._refresh_lock = threading.Lock()

        self._lock = threading.Lock()  # guards everything below
        self._idle: list[SnowflakeClient] = []  # a stack: the most recently used last
        self._down_until: dict[str, float] = {}
        self._turn = itertools.count()
        self._closed = False

        self._buffer_lock = threading.Lock()
        self._buffer: collections.deque[int] = collections.deque()
        self._buffer_filled_at = 0.0

    @staticmethod
    def _parse_servers(servers: Iterable[ServerAddress]) -> tuple[_Server, ...]:
        parsed: dict[_Server, None] = {}  # ordered, without duplicates
        for server in servers:
            parsed[_Server(*parse_server(server))] = None
        return tuple(parsed)

    @property
    def servers(self) -> list[str]:
        """The servers in use now, as ``host:port``."""
        return [server.address for server in self._current_servers()]

    # -- the public calls ------------------------------------------------------

    def next_id(self, agent: str | None = None) -> int:
        """One new id: from the prefetch buffer if there is one, else ``get_id``."""
        if self.prefetch == 0 or (agent is not None and agent != self.agent):
            return int(self._call("get_id", agent or self.agent))
        # Refilled under the lock so that ids leave the buffer in increasing order; the
        # callers waiting meanwhile would have had to ask a server themselves anyway.
        with self._buffer_lock:
            buffer = self._buffer
            if (
                buffer
                and self.prefetch_max_age is not None
                and time.monotonic() - self._buffer_filled_at > self.prefetch_max_age
            ):
                buffer.clear()
            if not buffer:
                ids = self._call("get_ids", self.agent, self.prefetch)
                if not ids:
                    raise NoServerAvailableError("get_ids returned no ids")
                self._buffer_filled_at = time.monotonic()
                buffer.extend(int(i) for i in ids)
            return buffer.popleft()

    def next_ids(self, count: int, agent: str | None = None) -> list[int]:
        """``count`` new ids (1..4,096 by default), increasing, in one ``get_ids`` round trip."""
        return [int(i) for i in self._call("get_ids", agent or self.agent, count)]

    def close(self) -> None:
        """Close every idle connection and drop prefetched ids; later calls raise."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()
        with self._buffer_lock:
            self._buffer.clear()

    def __repr__(self) -> str:
        servers = ",".join(s.address for s in self._servers) or "(discovered)"
        return f"<SnowflakePool {servers} {self.transport} idle={len(self._idle)}>"

    # -- the machinery ---------------------------------------------------------

    def _current_servers(self) -> tuple[_Server, ...]:
        if self._discover is None:
            return self._servers
        # One thread asks; the others go on with the list they have, if any.
        if time.monotonic() - self._refreshed_at >= self.refresh_interval and (
            self._refresh_lock.acquire(blocking=not self._servers)
        ):
            try:
                if time.monotonic() - self._refreshed_at >= self.refresh_interval:
                    self._refresh()
            finally:
                self._refresh_lock.release()
        if not self._servers:  # discovery failed and there is no earlier list to keep
            raise NoServerAvailableError(f"server discovery failed: {self._discovery_error}")
        return self._servers

    def _refresh(self) -> None:
        assert self._discover is not None
        try:
            found = self._parse_servers(self._discover())
            if not found:
                raise ValueError("discovery found no servers")
        except Exception as e:
            self._refreshed_at = time.monotonic()  # ask again after refresh_interval
            self._discovery_error = e
            if not self._servers:
                raise NoServerAvailableError(f"server discovery failed: {e}") from e
            kept = [server.address for server in self._servers]
            log.warning("server discovery failed, keeping %s: %s", kept, e)
            return
        with self._lock:
            self._servers = found
            self._refreshed_at = time.monotonic()
            known = {server.address for server in found}
            # Servers that left are forgotten, so that churn cannot grow this without end.
            self._down_until = {a: t for a, t in self._down_until.items() if a in known}
            gone = [client for client in self._idle if client.address not in known]
            self._idle = [client for client in self._idle if client.address in known]
        for client in gone:
            client.close()

    def _acquire(
        self, servers: tuple[_Server, ...], tried: set[str]
    ) -> tuple[SnowflakeClient, bool]:
        """A connection (and whether it was idle in the pool) to the best server to try next."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError("this SnowflakePool is closed")
            turn = next(self._turn) % len(servers)
            in_turn = servers[turn:] + servers[:turn]

            def rank(server: _Server) -> tuple[bool, float]:
                down_until = self._down_until.get(server.address, 0.0)
                return server.address in tried, down_until if down_until > now else 0.0

            ranked = sorted(in_turn, key=rank)  # stable: untried and up first, in turn
            best = rank(ranked[0])
            good = {s.address for s in ranked if rank(s) == best}
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i].address in good:
                    return self._idle.pop(i), True
            target = ranked[0]
        client = SnowflakeClient(
            target.host,
            target.port,
            agent=self.agent,
            transport=self.transport,
            timeout=self.timeout,
            connect_timeout=self.connect_timeout,
            ssl_context=self.ssl_context,
        )
        return client, False

    def _release(self, client: SnowflakeClient, *, healthy: bool) -> None:
        with self._lock:
            if healthy:
                self._down_until.pop(client.address, None)
            keep = (
                not self._closed
                and client.is_open
                and len(self._idle) < self.pool_size
                and any(s.address == client.address for s in self._servers)
            )
            if keep:
                self._idle.append(client)
        if not keep:
            client.close()

    def _failed(self, address: str, *, drop_idle: bool) -> None:
        """Try ``address`` last for a while; with ``drop_idle``, close its idle connections."""
        with self._lock:
            self._down_until[address] = time.monotonic() + self.retry_failed_after
            stale = [c for c in self._idle if c.address == address] if drop_idle else []
            self._idle = [c for c in self._idle if c not in stale]
        for client in stale:
            client.close()

    def _call(self, method: str, *args: object) -> Any:
        servers = self._current_servers()
        attempts = self.attempts or len(servers) + 1
        free_retries = len(servers)  # for connections that went stale while idle
        failures: list[tuple[str, SnowflakeError]] = []
        tried: set[str] = set()
        while attempts > 0:
            client, reused = self._acquire(servers, tried)
            try:
                result = client._call(method, *args)
            except _CALLER_ERRORS:
                self._release(client, healthy=True)
                raise
            except RequestError as e:  # this node cannot serve now: its clock, say
                self._release(client, healthy=False)
                log.warning("snowflake server %s refused: %s", client.address, e)
                failures.append((client.address, e))
                tried.add(client.address)
                self._failed(client.address, drop_idle=False)
                attempts -= 1
            except CallFailedError as e:
                failures.append((client.address, e))
                if reused and not e.timed_out and free_retries > 0:
                    # The server may have closed this idle connection (idle timeout,
                    # restart): drop its other idle connections too, and retry.
                    free_retries -= 1
                    with self._lock:
                        stale = [c for c in self._idle if c.address == client.address]
                        self._idle = [c for c in self._idle if c.address != client.address]
                    for other in stale:
                        other.close()
                    continue
                log.warning("snowflake server failed: %s", e)
                tried.add(client.address)
                self._failed(client.address, drop_idle=True)
                attempts -= 1
            except BaseException:
                client.close()
                raise
            else:
                self._release(client, healthy=True)
                return result
            servers = self._current_servers()
        raise NoServerAvailableError(
            f"no snowflake server could serve {method} ({len(failures)} attempts)", failures
        ) from failures[-1][1]


def _is_one(servers: object) -> TypeGuard[ServerAddress]:
    """Whether ``servers`` is a single address rather than a sequence of them."""
    if isinstance(servers, str):
        return True
    return (
        isinstance(servers, tuple)
        and len(servers) == 2
        and isinstance(servers[0], str)
        and isinstance(servers[1], int)
    )
