"""A thread-safe client for one or more servers: :class:`SnowflakePool`, and the part of
it that :class:`AsyncSnowflakePool` shares: :class:`PoolCore`."""

from __future__ import annotations

import collections
import inspect
import itertools
import logging
import math
import ssl
import threading
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, Callable, Generic, Protocol, TypedDict, TypeVar, cast

from ._address import DEFAULT_PORT, Server, ServerAddress, parse_server
from ._client import DEFAULT_AGENT, Closing, SnowflakeClient, positive_seconds
from ._errors import (
    CallFailedError,
    ConfigurationError,
    InvalidCountError,
    InvalidUserAgentError,
    NoServerAvailableError,
    RequestError,
    SnowflakeError,
)
from ._idl import count_arg
from ._transports import TRANSPORTS, Transport

__all__ = [
    "CALLER_ERRORS",
    "Attempts",
    "Discovery",
    "PoolCore",
    "SnowflakePool",
    "Try",
    "is_coroutine_function",
]

log = logging.getLogger("snowflake_thrift_client")

Discovery = Callable[[], Iterable[ServerAddress]]
"""A callable that returns the servers to use now, e.g. read from a registry."""

CALLER_ERRORS = (InvalidUserAgentError, InvalidCountError)
"""Declared errors that are the caller's fault: another server would refuse the same call."""


class Connection(Protocol):
    """What a pool needs of a connection to one server, whatever its I/O."""

    address: str

    @property
    def is_open(self) -> bool: ...

    def close(self) -> None:
        """Close now, without waiting for the server: an asyncio pool calls it on its loop."""


class ConnectionOptions(TypedDict):
    """The keyword arguments of a connection, the same for every server of a pool."""

    agent: str
    transport: Transport
    timeout: float
    connect_timeout: float
    ssl_context: ssl.SSLContext | None


C = TypeVar("C", bound=Connection)
D = TypeVar("D")


class Attempts:
    """One call's tries: how many are left, which servers failed, and how."""

    def __init__(self, attempts: int | None, servers: Sequence[Server]) -> None:
        self.left = attempts or len(servers) + 1
        self.free_retries = len(servers)  # for connections that went stale while idle
        self.failures: list[tuple[str, SnowflakeError]] = []
        self.tried: set[str] = set()

    def exhausted(self, method: str) -> NoServerAvailableError:
        """The error to raise once no try is left, chained to the last failure."""
        error = NoServerAvailableError(
            f"no snowflake server could serve {method} ({len(self.failures)} attempts)",
            self.failures,
        )
        error.__cause__ = self.failures[-1][1]
        return error


class Try(Generic[C]):
    """One try of a call, as the ``with`` block around it, which counts its outcome.

    On success, or on the caller's own error, the connection goes back to the pool. A
    failure that another server may not have (a :class:`CallFailedError`, a
    :class:`RequestError` such as :class:`UnavailableError`) is counted and swallowed:
    the block is left, and the caller's loop tries again. Anything else (a cancellation,
    ``KeyboardInterrupt``) closes the connection, whose reply may still come, and
    propagates.
    """

    def __init__(self, pool: PoolCore[C, Any], attempts: Attempts, client: C, reused: bool):
        self._pool = pool
        self._attempts = attempts
        self._client = client
        self._reused = reused

    def __enter__(self) -> C:
        return self._client

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if error is None or isinstance(error, CALLER_ERRORS):
            self._pool._release(self._client, healthy=True)
            return False
        if isinstance(error, (RequestError, CallFailedError)):
            self._pool._tried(self._attempts, self._client, error, self._reused)
            return True
        self._client.close()
        return False


class PoolCore(Generic[C, D]):
    """The bookkeeping of a pool, without I/O: its settings, the servers and their
    discovery, idle connections, which servers failed, and the prefetch buffer.

    Every method returns at once and is thread-safe; none waits for a server.
    :class:`SnowflakePool` calls servers from threads, :class:`AsyncSnowflakePool` from
    an event loop, around these. ``C`` is their connection, ``D`` the discovery callables
    they take.
    """

    def __init__(
        self,
        servers: ServerAddress | Sequence[ServerAddress] | D = ("127.0.0.1", DEFAULT_PORT),
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ConfigurationError(
                f"transport must be one of {sorted(TRANSPORTS)}, got {transport!r}"
            )
        if attempts is not None and not (isinstance(attempts, int) and attempts >= 1):
            raise ConfigurationError(f"attempts must be at least 1, got {attempts!r}")
        if not (isinstance(pool_size, int) and pool_size >= 0):
            raise ConfigurationError(f"pool_size must be 0 or more, got {pool_size!r}")
        if not (isinstance(prefetch, int) and prefetch >= 0):
            raise ConfigurationError(f"prefetch must be 0 (off) or a batch size, got {prefetch!r}")
        if not callable(clock):
            raise ConfigurationError(
                f"clock must be a callable that returns seconds, got {clock!r}"
            )
        self.agent = agent
        self.transport: Transport = transport
        self.timeout = positive_seconds("timeout", timeout)
        self.connect_timeout = positive_seconds(
            "connect_timeout", self.timeout if connect_timeout is None else connect_timeout
        )
        self.attempts = attempts
        self.pool_size = pool_size
        self.retry_failed_after = max(0.0, float(retry_failed_after))
        self.refresh_interval = positive_seconds("refresh_interval", refresh_interval)
        self.prefetch = prefetch
        self.ssl_context = ssl_context
        self._clock = clock
        self.prefetch_max_age = (
            None
            if prefetch_max_age is None
            else positive_seconds("prefetch_max_age", prefetch_max_age)
        )
        self._options = ConnectionOptions(
            agent=agent,
            transport=transport,
            timeout=self.timeout,
            connect_timeout=self.connect_timeout,
            ssl_context=ssl_context,
        )

        self._discover: D | None = None
        self._discovery_error: Exception | None = None
        self._servers: tuple[Server, ...] = ()
        if callable(servers):
            self._discover = cast(D, servers)
        else:
            if _is_one(servers):
                self._servers = _parse_servers([cast(ServerAddress, servers)])
            else:
                self._servers = _parse_servers(cast(Sequence[ServerAddress], servers))
            if not self._servers:
                raise ConfigurationError("no servers given")
        self._refreshed_at = -math.inf

        self._lock = threading.Lock()  # guards everything below
        self._idle: list[C] = []  # a stack: the most recently used last
        self._down_until: dict[str, float] = {}
        self._turn = itertools.count()
        self._closed = False
        # Taken from by one caller at a time: each pool holds its own kind of lock
        # around the refill, so that ids leave the buffer in increasing order.
        self._buffer: collections.deque[int] = collections.deque()
        self._buffer_filled_at = 0.0
        self._setup()

    def _setup(self) -> None:
        """Make what this kind of pool waits with (its locks), at the end of ``__init__``."""

    def _connect_to(self, server: Server) -> C:
        """A new connection to ``server``, not opened yet."""
        raise NotImplementedError

    @property
    def servers(self) -> list[str]:
        """The servers in use now, as ``host:port``."""
        return [server.address for server in self._servers]

    def __repr__(self) -> str:
        servers = ",".join(s.address for s in self._servers) or "(discovered)"
        return f"<{type(self).__name__} {servers} {self.transport} idle={len(self._idle)}>"

    # -- servers and their discovery ------------------------------------------------

    def _refresh_due(self) -> bool:
        return self._discover is not None and (
            self._clock() - self._refreshed_at >= self.refresh_interval
        )

    def _discovered(self, found: Sequence[ServerAddress] | Exception) -> None:
        """Take what discovery found, or how it failed (the last list is kept then)."""
        if not isinstance(found, Exception):
            try:
                parsed = _parse_servers(found)
            except ConfigurationError as e:
                found = e
            else:
                if not parsed:
                    found = ConfigurationError("discovery found no servers")
        if isinstance(found, Exception):
            self._refreshed_at = self._clock()  # ask again after refresh_interval
            self._discovery_error = found
            if self._servers:
                kept = [server.address for server in self._servers]
                log.warning("server discovery failed, keeping %s: %s", kept, found)
            return
        with self._lock:
            self._servers = parsed
            self._refreshed_at = self._clock()
            known = {server.address for server in parsed}
            # Servers that left are forgotten, so that churn cannot grow this without end.
            self._down_until = {a: t for a, t in self._down_until.items() if a in known}
            gone = [client for client in self._idle if client.address not in known]
            self._idle = [client for client in self._idle if client.address in known]
        for client in gone:
            client.close()

    def _known_servers(self) -> tuple[Server, ...]:
        """The servers to call; NoServerAvailableError if discovery never found any."""
        if not self._servers:
            error = self._discovery_error
            raise NoServerAvailableError(f"server discovery failed: {error}") from error
        return self._servers

    # -- connections ----------------------------------------------------------------

    def _try(self, servers: tuple[Server, ...], attempts: Attempts) -> Try[C]:
        """The next try: a connection to the best server to try next, in a :class:`Try`."""
        client, reused = self._acquire(servers, attempts.tried)
        return Try(self, attempts, client, reused)

    def _acquire(self, servers: tuple[Server, ...], tried: set[str]) -> tuple[C, bool]:
        """A connection (and whether it was idle in the pool) to the best server to try next."""
        now = self._clock()
        with self._lock:
            self._check_open()
            turn = next(self._turn) % len(servers)
            in_turn = servers[turn:] + servers[:turn]

            def rank(server: Server) -> tuple[bool, float]:
                down_until = self._down_until.get(server.address, 0.0)
                return server.address in tried, down_until if down_until > now else 0.0

            ranked = sorted(in_turn, key=rank)  # stable: untried and up first, in turn
            best = rank(ranked[0])
            good = {s.address for s in ranked if rank(s) == best}
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i].address in good:
                    return self._idle.pop(i), True
            target = ranked[0]
        return self._connect_to(target), False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")

    def _release(self, client: C, *, healthy: bool) -> None:
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

    def _tried(self, attempts: Attempts, client: C, error: SnowflakeError, reused: bool) -> None:
        """Count a try that failed with ``error`` (a :class:`RequestError`: this node cannot
        serve now, or a :class:`CallFailedError`, which closed ``client``)."""
        self._release(client, healthy=False)
        attempts.failures.append((client.address, error))
        if isinstance(error, RequestError):
            log.warning("snowflake server %s refused: %s", client.address, error)
        elif (
            reused
            and isinstance(error, CallFailedError)
            and not error.timed_out
            and attempts.free_retries > 0
        ):
            # The server may have closed this idle connection (idle timeout, restart):
            # drop its other idle connections too, and retry without counting a try.
            attempts.free_retries -= 1
            self._drop_idle(client.address)
            return
        else:
            log.warning("snowflake server failed: %s", error)
        attempts.tried.add(client.address)
        # A server that failed is tried last for a while; its idle connections go too,
        # unless it answered (it refused: the connections work).
        with self._lock:
            self._down_until[client.address] = self._clock() + self.retry_failed_after
        if not isinstance(error, RequestError):
            self._drop_idle(client.address)
        attempts.left -= 1

    def _drop_idle(self, address: str) -> None:
        with self._lock:
            stale = [c for c in self._idle if c.address == address]
            self._idle = [c for c in self._idle if c.address != address]
        for client in stale:
            client.close()

    def _close_idle(self) -> list[C]:
        """Refuse further calls and drop prefetched ids; the idle connections, closed."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        self._buffer.clear()
        for client in idle:
            client.close()
        return idle

    # -- prefetch -------------------------------------------------------------------

    def _prefetching(self, agent: str | None) -> bool:
        """Whether ``next_id(agent)`` is served from the buffer."""
        return self.prefetch > 0 and (agent is None or agent == self.agent)

    def _take_prefetched(self) -> int | None:
        """The next prefetched id, or None if the buffer must be refilled (empty, or
        older than ``prefetch_max_age``). The caller holds the pool's buffer lock."""
        self._check_open()
        buffer = self._buffer
        if (
            buffer
            and self.prefetch_max_age is not None
            and self._clock() - self._buffer_filled_at > self.prefetch_max_age
        ):
            buffer.clear()
        return buffer.popleft() if buffer else None

    def _refill(self, ids: Sequence[int]) -> int:
        """Fill the buffer with ``ids`` from ``get_ids``; the first of them."""
        if not ids:
            raise NoServerAvailableError("get_ids returned no ids")
        self._check_open()  # closed meanwhile: these ids are lost, as on close
        self._buffer_filled_at = self._clock()
        self._buffer.extend(int(i) for i in ids)
        return self._buffer.popleft()


class SnowflakePool(PoolCore[SnowflakeClient, Discovery], Closing):
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
    node cannot serve now, such as :class:`ClockMovedBackwardsError` (another
    node may have a good clock) or :class:`UnavailableError`, it is retried on
    another server, up to ``attempts`` tries in all (default: one per server,
    plus one). A server that failed is tried last for the next
    ``retry_failed_after`` seconds. A failure on a connection that sat idle in
    the pool (the server may have closed it) is retried on a fresh connection
    without counting as an attempt. When every attempt failed,
    :class:`NoServerAvailableError` is raised. The caller's own errors,
    :class:`InvalidUserAgentError` and :class:`InvalidCountError`, are raised at
    once: every server would refuse them.

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

    **Clock.** ``clock`` returns seconds that only go forward (``time.monotonic``
    by default); every wait above is measured with it: ``retry_failed_after``,
    ``refresh_interval`` and ``prefetch_max_age``. Pass another one to let time
    pass on demand, in tests say. Socket timeouts are real time whatever ``clock``
    says: the operating system applies them.
    """

    def _setup(self) -> None:
        if is_coroutine_function(self._discover):
            raise ConfigurationError(
                "a coroutine function can find servers for an AsyncSnowflakePool only"
            )
        self._refresh_lock = threading.Lock()
        self._buffer_lock = threading.Lock()

    def _connect_to(self, server: Server) -> SnowflakeClient:
        return SnowflakeClient(server.host, server.port, **self._options)

    @property
    def servers(self) -> list[str]:
        """The servers in use now, as ``host:port`` (discovered first if due)."""
        return [server.address for server in self._current_servers()]

    # -- the public calls ------------------------------------------------------

    def next_id(self, agent: str | None = None) -> int:
        """One new id: from the prefetch buffer if there is one, else ``get_id``."""
        if not self._prefetching(agent):
            return int(self._call("get_id", agent or self.agent))
        # Refilled under the lock so that ids leave the buffer in increasing order; the
        # callers waiting meanwhile would have had to ask a server themselves anyway.
        with self._buffer_lock:
            taken = self._take_prefetched()
            if taken is None:
                taken = self._refill(self._call("get_ids", self.agent, self.prefetch))
            return taken

    def next_ids(self, count: int, agent: str | None = None) -> list[int]:
        """``count`` new ids (1..4,096 by default), increasing, in one ``get_ids`` round trip."""
        return [int(i) for i in self._call("get_ids", agent or self.agent, count_arg(count))]

    def close(self) -> None:
        """Close every idle connection and drop prefetched ids; later calls raise."""
        with self._buffer_lock:  # after a refill in flight, whose ids are dropped too
            self._close_idle()

    # -- the machinery ---------------------------------------------------------

    def _current_servers(self) -> tuple[Server, ...]:
        # One thread asks; the others go on with the list they have, if any.
        if self._refresh_due() and self._refresh_lock.acquire(blocking=not self._servers):
            try:
                if self._refresh_due():
                    assert self._discover is not None
                    try:
                        found: Sequence[ServerAddress] | Exception = list(self._discover())
                    except Exception as e:  # noqa: BLE001 - kept, and reported by _discovered
                        found = e
                    self._discovered(found)
            finally:
                self._refresh_lock.release()
        return self._known_servers()

    def _call(self, method: str, *args: object) -> Any:
        servers = self._current_servers()
        attempts = Attempts(self.attempts, servers)
        while attempts.left > 0:
            with self._try(servers, attempts) as client:
                return client._call(method, *args)
            servers = self._current_servers()  # this try failed: the next one
        raise attempts.exhausted(method)


def _parse_servers(servers: Iterable[ServerAddress]) -> tuple[Server, ...]:
    parsed: dict[Server, None] = {}  # ordered, without duplicates
    for server in servers:
        parsed[Server(*parse_server(server))] = None
    return tuple(parsed)


def _is_one(servers: object) -> bool:
    """Whether ``servers`` is a single address rather than a sequence of them."""
    if isinstance(servers, str):
        return True
    return (
        isinstance(servers, tuple)
        and len(servers) == 2
        and isinstance(servers[0], str)
        and isinstance(servers[1], int)
    )


def is_coroutine_function(function: object) -> bool:
    """Whether calling ``function`` gives a coroutine: a coroutine function, or an
    object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004 - the method itself is looked at
    )
