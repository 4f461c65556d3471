"""A thread-safe client for one or more servers: :class:`SnowflakePool`."""

from __future__ import annotations

import collections
import itertools
import logging
import math
import ssl
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Callable, cast

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
from ._transports import TRANSPORTS, Transport

__all__ = ["Discovery", "SnowflakePool"]

log = logging.getLogger("snowflake_thrift_client")

Discovery = Callable[[], Iterable[ServerAddress]]
"""A callable that returns the servers to use now, e.g. read from a registry."""

_CALLER_ERRORS = (InvalidUserAgentError, InvalidCountError)
"""Declared errors that are the caller's fault: another server would refuse the same call."""


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

        self._discover: Discovery | None = None
        self._discovery_error: Exception | None = None
        self._servers: tuple[Server, ...] = ()
        if callable(servers):
            self._discover = servers
        else:
            if _is_one(servers):
                self._servers = self._parse_servers([cast(ServerAddress, servers)])
            else:
                self._servers = self._parse_servers(cast(Sequence[ServerAddress], servers))
            if not self._servers:
                raise ConfigurationError("no servers given")
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
    def _parse_servers(servers: Iterable[ServerAddress]) -> tuple[Server, ...]:
        parsed: dict[Server, None] = {}  # ordered, without duplicates
        for server in servers:
            parsed[Server(*parse_server(server))] = None
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
                and self._clock() - self._buffer_filled_at > self.prefetch_max_age
            ):
                buffer.clear()
            if not buffer:
                ids = self._call("get_ids", self.agent, self.prefetch)
                if not ids:
                    raise NoServerAvailableError("get_ids returned no ids")
                self._buffer_filled_at = self._clock()
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

    def _current_servers(self) -> tuple[Server, ...]:
        if self._discover is None:
            return self._servers
        # One thread asks; the others go on with the list they have, if any.
        if self._clock() - self._refreshed_at >= self.refresh_interval and (
            self._refresh_lock.acquire(blocking=not self._servers)
        ):
            try:
                if self._clock() - self._refreshed_at >= self.refresh_interval:
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
                raise ConfigurationError("discovery found no servers")
        except Exception as e:
            self._refreshed_at = self._clock()  # ask again after refresh_interval
            self._discovery_error = e
            if not self._servers:
                raise NoServerAvailableError(f"server discovery failed: {e}") from e
            kept = [server.address for server in self._servers]
            log.warning("server discovery failed, keeping %s: %s", kept, e)
            return
        with self._lock:
            self._servers = found
            self._refreshed_at = self._clock()
            known = {server.address for server in found}
            # Servers that left are forgotten, so that churn cannot grow this without end.
            self._down_until = {a: t for a, t in self._down_until.items() if a in known}
            gone = [client for client in self._idle if client.address not in known]
            self._idle = [client for client in self._idle if client.address in known]
        for client in gone:
            client.close()

    def _acquire(
        self, servers: tuple[Server, ...], tried: set[str]
    ) -> tuple[SnowflakeClient, bool]:
        """A connection (and whether it was idle in the pool) to the best server to try next."""
        now = self._clock()
        with self._lock:
            if self._closed:
                raise RuntimeError("this SnowflakePool is closed")
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
            self._down_until[address] = self._clock() + self.retry_failed_after
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
