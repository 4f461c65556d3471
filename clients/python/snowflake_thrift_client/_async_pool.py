"""The client for asyncio applications: :class:`AsyncSnowflakePool`.

It is :class:`SnowflakePool` on an event loop: the same arguments, failover, back-off,
prefetch and errors, from the same code (:class:`PoolCore`: which server to try, when a
server counts as failed, what a failure means, the prefetch buffer). Only the waiting
differs: connections are asyncio streams (:class:`AsyncConnection`), the locks are
asyncio's, and a discovery callable that may block (``ZooKeeperDiscovery``) runs in a
thread, so that nothing blocks the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence
from types import TracebackType
from typing import Any, Callable, TypeVar, Union

from ._address import Server, ServerAddress
from ._async_client import AsyncConnection
from ._idl import count_arg
from ._pool import Attempts, Discovery, PoolCore, is_coroutine_function

__all__ = ["AnyDiscovery", "AsyncDiscovery", "AsyncSnowflakePool"]

AsyncDiscovery = Callable[[], Awaitable[Iterable[ServerAddress]]]
"""A coroutine function that returns the servers to use now."""

AnyDiscovery = Union[Discovery, AsyncDiscovery]
"""What :class:`AsyncSnowflakePool` takes to find its servers: a :data:`Discovery`, run
in a thread (it may block: ``ZooKeeperDiscovery`` does), or an :data:`AsyncDiscovery`,
awaited on the loop."""

_Pool = TypeVar("_Pool", bound="AsyncSnowflakePool")


class _Waits:
    """What an :class:`AsyncSnowflakePool` waits with, made on the loop it serves: before
    Python 3.10, an ``asyncio.Lock`` made outside a running loop belongs to another one."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.refresh = asyncio.Lock()
        self.buffer = asyncio.Lock()


class AsyncSnowflakePool(PoolCore[AsyncConnection, AnyDiscovery]):
    """An asyncio client for one or more snowflake servers: :class:`SnowflakePool`, awaited.

    ::

        async with AsyncSnowflakePool(["10.0.0.1:7609", "10.0.0.2:7609"]) as ids:
            one = await ids.next_id()
            batch = await ids.next_ids(100)

    It takes the arguments of :class:`SnowflakePool` and behaves as it does: failover
    across servers, a failed server tried last for ``retry_failed_after`` seconds, a
    connection discarded after any error (a timeout, a cancellation), prefetch with
    ``prefetch_max_age``, the same errors. Tasks share it: each call borrows a
    connection of its own, so many tasks at once open more connections, and at most
    ``pool_size`` stay open idle. ``timeout`` bounds each call to one server (request
    and reply), ``connect_timeout`` the connect with its TLS handshake.

    ``servers`` may be a :data:`Discovery` callable, which is called in a thread
    (``asyncio.to_thread``) since it may block, or an :data:`AsyncDiscovery`
    coroutine function. :attr:`servers` is the list found last, without asking again.

    A pool serves the event loop it is first used on. :meth:`close` (or leaving
    ``async with``) closes its idle connections and waits until their sockets are.
    """

    def _setup(self) -> None:
        self._waits: _Waits | None = None

    def _connect_to(self, server: Server) -> AsyncConnection:
        return AsyncConnection(server.host, server.port, **self._options)

    def _on_loop(self) -> _Waits:
        waits = self._waits
        if waits is None:
            waits = self._waits = _Waits()
        elif waits.loop is not asyncio.get_running_loop():
            # Its connections and locks belong to that loop, which may be gone.
            raise RuntimeError(f"this {type(self).__name__} serves another event loop")
        return waits

    # -- the public calls ------------------------------------------------------

    async def next_id(self, agent: str | None = None) -> int:
        """One new id: from the prefetch buffer if there is one, else ``get_id``."""
        waits = self._on_loop()
        if not self._prefetching(agent):
            return int(await self._call("get_id", agent or self.agent))
        # Refilled under the lock so that ids leave the buffer in increasing order; the
        # tasks waiting meanwhile would have had to ask a server themselves anyway.
        async with waits.buffer:
            taken = self._take_prefetched()
            if taken is None:
                taken = self._refill(await self._call("get_ids", self.agent, self.prefetch))
            return taken

    async def next_ids(self, count: int, agent: str | None = None) -> list[int]:
        """``count`` new ids (1..4,096 by default), increasing, in one ``get_ids`` round trip."""
        self._on_loop()
        return [int(i) for i in await self._call("get_ids", agent or self.agent, count_arg(count))]

    async def close(self) -> None:
        """Close every idle connection, and wait until their sockets are; drop prefetched
        ids. Later calls raise ``RuntimeError``; connections lent to calls in flight
        are closed when those end."""
        idle = self._close_idle()
        await asyncio.gather(*(client.wait_closed() for client in idle))

    aclose = close  # for contextlib.aclosing

    async def __aenter__(self: _Pool) -> _Pool:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- the machinery ---------------------------------------------------------

    def _servers_if_fresh(self) -> tuple[Server, ...] | None:
        """The servers to call, unless discovery is due: without a coroutine, as a rule."""
        return None if self._refresh_due() else self._known_servers()

    async def _refreshed_servers(self) -> tuple[Server, ...]:
        # One task asks; the others go on with the list they have, if any.
        waits = self._on_loop()
        if not (waits.refresh.locked() and self._servers):
            async with waits.refresh:
                if self._refresh_due():
                    try:
                        found: Sequence[ServerAddress] | Exception = await self._ask()
                    except Exception as e:  # noqa: BLE001 - kept, and reported by _discovered
                        found = e
                    self._discovered(found)
        return self._known_servers()

    async def _ask(self) -> list[ServerAddress]:
        discover: Any = self._discover
        if is_coroutine_function(discover):
            return list(await discover())
        # In a thread, iterating the answer too: a generator's code may block as well.
        return await asyncio.to_thread(lambda: list(discover()))

    async def _call(self, method: str, *args: object) -> Any:
        servers = self._servers_if_fresh() or await self._refreshed_servers()
        attempts = Attempts(self.attempts, servers)
        while attempts.left > 0:
            with self._try(servers, attempts) as client:
                return await client.call(method, *args)
            servers = self._servers_if_fresh() or await self._refreshed_servers()
        raise attempts.exhausted(method)
