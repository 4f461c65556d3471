"""One asyncio connection to one server: what :class:`AsyncSnowflakePool` borrows.

Its own asyncio I/O over ``asyncio.open_connection``, around the same Cython transports
and binary protocol as :class:`SnowflakeClient`, used on bytes in memory: a request is
encoded into bytes and written; the reply is read until it decodes whole. The wire is
thus made by the same code for both clients, and the errors mean the same
(``call_failed``, ``request_error``).

thriftpy2's own asyncio support (``thriftpy2.contrib.aio``, as of 0.7) falls short here:

- its socket, ``TAsyncSocket``, connects a blocking socket in the loop's default
  executor and leaves it open (a ResourceWarning) when the connect fails; it turns every
  failure to connect, a timeout too, into one "Could not connect" error, so that a
  silent server, a refused port and a refused certificate look alike; it bounds each
  read by the *connect* timeout; its ``close()`` closes the socket under the asyncio
  transport that owns it;
- its protocol is pure Python, awaiting each value: decoding a ``get_id`` reply costs
  about 5 times the CPU of the Cython protocol, a ``get_ids(100)`` reply 15 times.

Here the connect and the TLS handshake are bounded together by ``connect_timeout``, each
call (request and reply) by ``timeout``, and a connection is discarded by aborting its
transport. A reply must answer the call just made (its method and sequence id), a check
thriftpy2's clients leave out; the connection is discarded after any failure anyway, so
that a late reply is never read as the answer to a later call.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

from thriftpy2.thrift import TApplicationException, TMessageType
from thriftpy2.transport import TTransportException

from ._address import Server
from ._client import _declared_classes, call_failed
from ._idl import request_error, snowflake_thrift
from ._transports import Transport, binary_protocol, foreign_reply

__all__ = ["AsyncConnection", "NeedMore", "decode_reply"]

_T = TypeVar("_T")

_CHUNK = 65536
"""Bytes asked for at once: a whole reply of ``get_ids(4096)`` is 32 KiB and a little."""

if sys.version_info >= (3, 11):

    async def _within(seconds: float, awaitable: Awaitable[_T]) -> _T:
        # A timer on this task; wait_for would run the awaitable as a task of its own.
        async with asyncio.timeout(seconds):
            return await awaitable

else:

    async def _within(seconds: float, awaitable: Awaitable[_T]) -> _T:
        return await asyncio.wait_for(awaitable, seconds)


class NeedMore(Exception):
    """The bytes received so far end before the reply does."""


class _Memory:
    """What thriftpy2's Cython transports take for a socket: bytes in memory, those
    written to it and those of a reply received so far."""

    def __init__(self, received: bytes = b"") -> None:
        self.written: list[bytes] = []
        self._received = received
        self._at = 0

    def read(self, size: int) -> bytes:
        if self._at >= len(self._received):
            raise NeedMore
        chunk = self._received[self._at : self._at + size]
        self._at += len(chunk)
        return chunk

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def flush(self) -> None:
        pass


def decode_reply(method: str, seqid: int, received: bytes, transport: Transport) -> Any:
    """What the reply to call #``seqid`` of ``method`` in ``received`` returns. Raises
    :class:`NeedMore` while ``received`` ends before the reply does, the declared error
    the reply carries, or ``TApplicationException`` (a server's, or a reply to another
    call: ``BAD_SEQUENCE_ID``)."""
    protocol: Any = binary_protocol(cast(Any, _Memory(received)), transport)
    name, kind, got = protocol.read_message_begin()
    if (name, got) != (method, seqid):
        raise TApplicationException(
            TApplicationException.BAD_SEQUENCE_ID,
            f"a reply to {name} #{got}, not to {method} #{seqid}",
        )
    if kind == TMessageType.EXCEPTION:
        error = TApplicationException()
        protocol.read_struct(error)
        raise error
    result = getattr(snowflake_thrift().Snowflake, f"{method}_result")()
    protocol.read_struct(result)
    if result.success is not None:
        return result.success
    for declared in vars(result).values():
        if declared is not None:
            raise declared
    raise TApplicationException(TApplicationException.MISSING_RESULT, f"{method} returned nothing")


class AsyncConnection:
    """One connection to one server over asyncio, opened on first use; lent by the pool
    to one call at a time.

    A declared error is raised as its :class:`RequestError` and leaves the connection
    open. Any other failure, a cancellation included, closes it (and raises
    :class:`CallFailedError`, but for the cancellation); the next call opens a new one.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        agent: str,
        transport: Transport,
        timeout: float,
        connect_timeout: float,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.host, self.port = host, port
        self.address = Server(host, port).address
        self.agent = agent
        self.transport: Transport = transport
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.ssl_context = ssl_context
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._closed: asyncio.StreamWriter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expired = False
        self._seqid = 0
        self._service = snowflake_thrift().Snowflake
        self._declared = _declared_classes()

    @property
    def is_open(self) -> bool:
        return self._writer is not None

    async def open(self) -> None:
        """Connect now; raises :class:`CallFailedError` (not ``connected``)."""
        if self._writer is not None:
            return
        tls = self.ssl_context
        try:
            connecting = asyncio.open_connection(
                self.host, self.port, ssl=tls, server_hostname=self.host if tls else None
            )
            reader, writer = await _within(self.connect_timeout, connecting)
        except asyncio.TimeoutError as e:  # not a TimeoutError before Python 3.11
            raise call_failed(self.address, TimeoutError(), connected=False) from e
        except OSError as e:  # ssl.SSLError included
            raise call_failed(self.address, e, connected=False) from e
        # asyncio sets TCP_NODELAY itself; keepalive finds a peer that vanished while idle.
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._reader, self._writer = reader, writer
        self._loop = asyncio.get_running_loop()
        self._expired = False

    async def call(self, method: str, *args: object) -> Any:
        """Call ``method`` of the Snowflake service, opening the connection if need be."""
        if self._writer is None:
            await self.open()
        assert self._loop is not None
        # At the deadline the connection is aborted, which ends the wait for the reply:
        # cheaper than a timeout around the call, and the connection is done for anyway.
        deadline = self._loop.call_later(self.timeout, self._expire)
        try:
            return await self._exchange(method, args)
        except self._declared as e:
            raise request_error(e) from e
        except Exception as e:  # whatever it was, this connection is done
            self.close()
            cause = TimeoutError() if self._expired else e
            raise call_failed(self.address, cause, connected=True) from e
        except BaseException:  # cancelled mid-call: the reply may still come
            self.close()
            raise
        finally:
            deadline.cancel()

    def _expire(self) -> None:
        self._expired = True
        self.close()

    async def _exchange(self, method: str, args: tuple[object, ...]) -> Any:
        reader, writer = self._reader, self._writer
        assert reader is not None and writer is not None
        writer.write(self._request(method, args))
        await writer.drain()
        received = b""
        while True:
            chunk = await reader.read(_CHUNK)
            if not chunk:
                if self._expired:
                    raise TimeoutError(f"no reply within {self.timeout:g} s")
                raise TTransportException(TTransportException.END_OF_FILE, "read 0 bytes")
            received += chunk
            if (foreign := foreign_reply(received[:128])) is not None:
                raise foreign
            try:
                return self._reply(method, received)
            except NeedMore:  # decoded again from the start once more has come
                continue

    def _request(self, method: str, args: tuple[object, ...]) -> bytes:
        memory = _Memory()
        protocol: Any = binary_protocol(cast(Any, memory), self.transport)
        self._seqid = (self._seqid + 1) & 0x7FFFFFFF
        protocol.write_message_begin(method, TMessageType.CALL, self._seqid)
        protocol.write_struct(getattr(self._service, f"{method}_args")(*args))
        protocol.write_message_end()
        protocol.trans.flush()
        return b"".join(memory.written)

    def _reply(self, method: str, received: bytes) -> Any:
        return decode_reply(method, self._seqid, received, self.transport)

    def close(self) -> None:
        """Abort the connection, if open: the loop closes its socket at its next turn
        (:meth:`wait_closed` waits for that)."""
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.transport.abort()
            self._closed = writer

    async def wait_closed(self) -> None:
        """Return once the socket of the connection closed last is closed."""
        writer, self._closed = self._closed, None
        if writer is not None:
            with contextlib.suppress(Exception):  # how the connection ended does not matter
                await writer.wait_closed()

    def __repr__(self) -> str:
        state = "open" if self.is_open else "closed"
        return f"<AsyncConnection {self.address} {self.transport} {state}>"
