"""A small Python client for a snowflake server.

>>> with SnowflakeClient("127.0.0.1", 7609) as client:   # doctest: +SKIP
...     client.next_id()
1541815603606036480

A client is not thread-safe: give each thread its own. After any transport
error or timeout its connection is discarded and the next call opens a new
one, so a late reply can never be read as the answer to a later call.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from thriftpy2.thrift import TClient

from .generator import Layout
from .idl_loader import snowflake_thrift
from .transports import Transport, binary_protocol, client_socket

__all__ = ["DEFAULT_AGENT", "SnowflakeClient"]

DEFAULT_AGENT = "snowflake-python"


class SnowflakeClient:
    """One connection to one server, opened on first use.

    Declared errors arrive as the IDL's exceptions (``InvalidSystemClock``,
    ``InvalidUserAgentError``, ``InvalidCountError``) and leave the connection
    usable; anything else closes it and is raised.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 7609,
        *,
        agent: str = DEFAULT_AGENT,
        transport: Transport = "framed",
        timeout: float = 5.0,
    ) -> None:
        self.host = host
        self.port = port
        self.agent = agent
        self._transport: Transport = transport
        self._timeout = timeout
        self._client: Any = None
        thrift = snowflake_thrift()
        self._declared = (
            thrift.InvalidSystemClock,
            thrift.InvalidUserAgentError,
            thrift.InvalidCountError,
        )

    def _call(self, method: str, *args: object) -> Any:
        if self._client is None:
            protocol = binary_protocol(
                client_socket(self.host, self.port, self._timeout), self._transport
            )
            protocol.trans.open()
            self._client = TClient(snowflake_thrift().Snowflake, protocol)
        try:
            return getattr(self._client, method)(*args)
        except self._declared:
            raise
        except BaseException:
            self.close()
            raise

    def next_id(self, agent: str | None = None) -> int:
        """One new id."""
        return int(self._call("get_id", agent or self.agent))

    def next_ids(self, count: int, agent: str | None = None) -> list[int]:
        """``count`` new ids (1..4,096) in one round trip, increasing."""
        return list(self._call("get_ids", agent or self.agent, count))

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
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> SnowflakeClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
