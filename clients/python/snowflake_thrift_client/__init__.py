"""Python client of the snowflake id service: unique, time-ordered 64-bit ids over Thrift.

:class:`SnowflakePool` is the client to use in an application: it is
thread-safe, keeps a few connections open, fails over across servers and can
prefetch ids::

    from snowflake_thrift_client import SnowflakePool

    with SnowflakePool(["10.0.0.1:7609", "10.0.0.2:7609"], agent="my-service") as ids:
        one = ids.next_id()
        batch = ids.next_ids(100)

:class:`AsyncSnowflakePool` is the same for asyncio::

    async with AsyncSnowflakePool(["10.0.0.1:7609", "10.0.0.2:7609"]) as ids:
        one = await ids.next_id()

:class:`SnowflakeClient` is one connection to one server (not thread-safe);
:func:`decompose` takes an id apart under a :class:`Layout`;
:class:`ZooKeeperDiscovery` finds the servers of a cluster (with the
``zookeeper`` extra). Every error is a :class:`SnowflakeError`; timeouts are also
``TimeoutError`` s, and failures to reach a server ``ConnectionError`` s.

Names not in ``__all__`` and modules whose names start with an underscore are
private and may change without notice.
"""

from __future__ import annotations

import logging
from importlib import resources
from typing import TYPE_CHECKING, Any

from . import _errors
from ._address import DEFAULT_PORT, ServerAddress, parse_server
from ._client import DEFAULT_AGENT, SnowflakeClient
from ._discovery import ZooKeeperDiscovery
from ._errors import *  # noqa: F403 - the whole error tree is public
from ._layout import DEFAULT_LAYOUT, TWITTER_EPOCH_MS, DecodedId, Layout, compose, decompose
from ._pool import Discovery, SnowflakePool
from ._tls import client_context

if TYPE_CHECKING:
    from ._async_pool import AsyncDiscovery, AsyncSnowflakePool

# A library's logs are its application's to show: with logging unconfigured, Python's
# last-resort handler would print every failed attempt of a pool to standard error.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = resources.files(__name__).joinpath("VERSION").read_text(encoding="utf-8").strip()
"""The version of the client and of the server, read from the one ``VERSION`` file."""

__all__ = [
    *_errors.__all__,
    "DEFAULT_AGENT",
    "DEFAULT_LAYOUT",
    "DEFAULT_PORT",
    "TWITTER_EPOCH_MS",
    "AsyncDiscovery",
    "AsyncSnowflakePool",
    "DecodedId",
    "Discovery",
    "Layout",
    "ServerAddress",
    "SnowflakeClient",
    "SnowflakePool",
    "ZooKeeperDiscovery",
    "__version__",
    "client_context",
    "compose",
    "decompose",
    "parse_server",
]


def __getattr__(name: str) -> Any:
    # The asyncio pool is imported on first use: asyncio alone takes about as long to
    # import as the rest of the package, a cost for the command line and threaded users.
    if name in ("AsyncDiscovery", "AsyncSnowflakePool"):
        from . import _async_pool

        return getattr(_async_pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
