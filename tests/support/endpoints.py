"""What a test does with a running server, in a process or in this one: call it, scrape it."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from typing import Any

from snowflake_thrift_client import SnowflakeClient
from snowflake_thrift_client._transports import Transport, open_client


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
        client = SnowflakeClient(self.host, self.port, transport=self.transport, **kwargs)
        self._clients.append(client)
        return client

    def raw_client(self, service: Any = None, timeout_s: float = 5.0) -> Any:
        """A bare thriftpy2 client on one connection that never reconnects."""
        client = open_client(self.host, self.port, self.transport, timeout_s, service)
        self._clients.append(client)
        return client

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
