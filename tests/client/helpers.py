"""What the client tests share: a clock that moves on demand, a Thrift server whose
handler a test writes, and small accessors for real servers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from snowflake_thrift_client._idl import snowflake_thrift
from snowflake_thrift_client._transports import Transport, binary_protocol, server_socket
from thriftpy2.thrift import TProcessor

from tests.support.endpoints import Endpoints
from tests.support.inprocess import InProcessServer
from tests.support.processes import parse_metrics

thrift = snowflake_thrift()

MakeServer = Callable[..., InProcessServer]
"""The ``servers`` fixture: ``make(clock=..., **settings)`` starts a real server in this
process with these :class:`ServerSettings` (and that wall clock, in ms)."""


class ShiftedWallClock:
    """A server's wall clock in ms, moved back or forward by :attr:`offset_ms`: a host
    whose clock an operator (or NTP) stepped."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def __call__(self) -> int:
        return time.time_ns() // 1_000_000 + self.offset_ms


class Listening(Protocol):
    host: str
    port: int


def address(server: Listening) -> str:
    return f"{server.host}:{server.port}"


def counts(server: Endpoints) -> dict[str, float]:
    return parse_metrics(server.metrics())


class FakeServer:
    """A Thrift server in this process whose handler the test writes: for servers that
    misbehave in ways the real one never does on purpose (a reply that comes too late)."""

    host = "127.0.0.1"

    def __init__(self, handler: object, transport: Transport = "framed") -> None:
        self._handler = handler
        self._transport = transport
        self._listener = socket.create_server((self.host, 0))
        self._listener.settimeout(0.05)
        self.port: int = self._listener.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._connections: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._connections.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        protocol = binary_protocol(server_socket(conn), self._transport)
        processor = TProcessor(thrift.Snowflake, self._handler)
        try:
            while not self._stop.is_set():
                processor.process(protocol, protocol)
        except Exception:  # noqa: BLE001 - the client went away: this connection is done
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        for conn in self._connections:
            with contextlib.suppress(OSError):  # unless already closed
                conn.shutdown(socket.SHUT_RDWR)  # wakes up the threads blocked reading
            conn.close()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()
