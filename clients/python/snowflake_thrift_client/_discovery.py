"""Finding servers through ZooKeeper: the registrations of cluster mode.

A :class:`ZooKeeperDiscovery` is a :data:`Discovery` for :class:`SnowflakePool`:
called, it returns the ``host:port`` of every node registered under ``<zk-path>/nodes``. The pool
asks again every ``refresh_interval`` seconds and keeps the last list if
ZooKeeper cannot be reached.

    with ZooKeeperDiscovery("zk1:2181,zk2:2181") as servers:
        with SnowflakePool(servers, agent="my-service") as ids:
            ids.next_id()

It needs kazoo, which this package does not install by default:
``pip install 'snowflake-thrift-client[zookeeper]'``. A ZooKeeper whose znodes only
the service may read (``--zk-read-acl service``) needs a reader identity the servers'
credentials file names (``reader = sasl:USER``), never the service's own (it may
write): ``auth="sasl"`` or ``"digest"`` and ``credentials_file`` (the servers' format).
"""

from __future__ import annotations

import threading
from typing import Any

from ._client import Closing
from ._errors import ConfigurationError
from ._zkauth import kazoo_auth, load_credentials

__all__ = ["ZooKeeperDiscovery"]


class ZooKeeperDiscovery(Closing):
    """The nodes registered in ZooKeeper (all datacenters, or only ``datacenter``).

    ``tls_ca``: reach ZooKeeper over TLS, trusting servers signed by this CA (PEM) and
    no other (not the system's CAs), whose certificates must name the host dialled;
    ``tls_cert`` and ``tls_key``: the client certificate to present, for servers that
    require one (as the server's ``--zk-tls-*``). kazoo's log never shows the
    credentials."""

    def __init__(
        self,
        hosts: str,
        zk_path: str = "/snowflake-servers",
        *,
        datacenter: int | None = None,
        timeout: float = 5.0,
        auth: str = "none",
        credentials_file: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
    ) -> None:
        try:
            import kazoo  # noqa: F401 - an optional dependency: say so at once, not at first use
        except ImportError:
            raise ConfigurationError(
                "ZooKeeperDiscovery needs kazoo: pip install 'snowflake-thrift-client[zookeeper]'"
            ) from None
        from ._zkkazoo import hide_credentials_in_logs

        hide_credentials_in_logs()  # kazoo logs the digest password at DEBUG otherwise
        # Read now: a credentials file that cannot be used is said at once.
        credentials = load_credentials(credentials_file) if credentials_file else None
        self._auth = kazoo_auth(auth, credentials)
        self._hosts = hosts
        self._root = f"{zk_path}/nodes"
        self._datacenter = datacenter
        self._timeout = timeout
        if bool(tls_cert) != bool(tls_key) or (tls_cert and not tls_ca):
            raise ConfigurationError(
                "tls_cert and tls_key go together, and need tls_ca (TLS is on when it is given)"
            )
        self._tls = (tls_ca, tls_cert, tls_key)
        self._client: Any = None
        self._lock = threading.Lock()

    def __call__(self) -> list[str]:
        """``host:port`` of each registered node, in worker order. Raises (within
        ``timeout``) when ZooKeeper cannot be reached."""
        with self._lock:
            if self._client is None:
                from kazoo.client import KazooClient

                from ._zkkazoo import kazoo_tls

                client = KazooClient(
                    hosts=self._hosts,
                    timeout=self._timeout,
                    read_only=True,
                    **self._auth,
                    **kazoo_tls(*self._tls),
                )
                try:
                    client.start(timeout=self._timeout)
                except BaseException:
                    client.stop()  # else it keeps retrying in the background
                    client.close()
                    raise
                self._client = client
            client = self._client
        from kazoo.exceptions import NoAuthError

        try:
            return self._registered(client)
        except NoAuthError:
            # kazoo's NoAuthError says nothing in words: this is the one cause.
            raise ConfigurationError(
                f"ZooKeeper refused to let this client read the registrations under "
                f"{self._root}: their ACL lets only the service read (--zk-read-acl "
                "service); give ZooKeeperDiscovery the credentials of a reader the "
                "servers' credentials file names (reader = ...; auth=, credentials_file=)"
            ) from None

    def _registered(self, client: Any) -> list[str]:
        from kazoo.exceptions import NoNodeError

        found = []
        datacenters = (
            [str(self._datacenter)]
            if self._datacenter is not None
            else self._children(client, self._root)
        )
        for dc in datacenters:
            for worker in self._children(client, f"{self._root}/{dc}"):
                try:
                    data, _ = client.get_async(f"{self._root}/{dc}/{worker}").get(
                        timeout=self._timeout
                    )
                except NoNodeError:
                    continue  # went away meanwhile
                found.append(data.decode())
        return found

    def _children(self, client: Any, path: str) -> list[str]:
        from kazoo.exceptions import NoNodeError

        # Bounded: kazoo queues requests while ZooKeeper is away instead of failing them.
        try:
            names = client.get_children_async(path).get(timeout=self._timeout)
        except NoNodeError:
            return []
        return sorted(names, key=lambda name: (len(name), name))

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.stop()
            client.close()
