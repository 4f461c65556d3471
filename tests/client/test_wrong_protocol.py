"""A client pointed at another protocol's port is told at the reply's first bytes
(``WrongProtocolError``), and a library with logging unconfigured prints nothing."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from snowflake_thrift_client import (
    ConnectionFailedError,
    SnowflakeClient,
    WrongProtocolError,
)
from snowflake_thrift_client._async_client import AsyncConnection
from snowflake_thrift_client._transports import foreign_reply

from tests.support.endpoints import free_port
from tests.support.foreign import HTTP_400, SSH_BANNER, TLS_ALERT, foreign_server

_LARGEST_REPLY = 16 * 2**20  # far above a full batch of ids (a few dozen kB)


@given(st.integers(min_value=1, max_value=_LARGEST_REPLY), st.binary(max_size=8))
def test_no_framed_reply_start_is_taken_for_another_protocol(length: int, rest: bytes) -> None:
    assert foreign_reply(struct.pack("!i", length) + rest) is None


@given(st.sampled_from([1, 2, 3]), st.binary(max_size=8))
def test_no_buffered_reply_start_is_taken_for_another_protocol(kind: int, rest: bytes) -> None:
    assert foreign_reply(bytes([0x80, 0x01, 0x00, kind]) + rest) is None  # strict header


@pytest.mark.parametrize(
    ("answer", "banner", "protocol"),
    [(HTTP_400, b"", "HTTP"), (TLS_ALERT, b"", "TLS"), (b"", SSH_BANNER, "SSH")],
)
def test_the_client_raises_wrong_protocol_at_the_first_bytes(
    answer: bytes, banner: bytes, protocol: str
) -> None:
    with foreign_server(answer=answer, banner=banner) as port:
        client = SnowflakeClient("127.0.0.1", port, timeout=5)
        started = time.monotonic()
        with pytest.raises(WrongProtocolError) as raised, client:
            client.next_id()
        assert time.monotonic() - started < 1.0
    assert raised.value.protocol == protocol and raised.value.connected
    assert isinstance(raised.value, (ConnectionFailedError, ConnectionError))
    assert str(raised.value).endswith("not a Thrift server")


def test_the_asyncio_client_raises_wrong_protocol_too() -> None:
    async def call(port: int) -> None:
        client = AsyncConnection(
            "127.0.0.1", port, agent="test", transport="framed", timeout=5,
            connect_timeout=5, ssl_context=None,
        )  # fmt: skip
        try:
            await client.call("get_id", "test")
        finally:
            client.close()

    with foreign_server(answer=HTTP_400) as port:
        started = time.monotonic()
        with pytest.raises(WrongProtocolError) as raised:
            asyncio.run(call(port))
        assert time.monotonic() - started < 1.0
    assert "an HTTP server answered (HTTP/1.1 400 Bad Request)" in str(raised.value)


def test_a_library_with_logging_unconfigured_prints_nothing() -> None:
    """Without the client's NullHandler, Python's last-resort handler printed each
    failed attempt of the pool to standard error."""
    script = (
        "from snowflake_thrift_client import SnowflakePool, NoServerAvailableError\n"
        f"pool = SnowflakePool(['127.0.0.1:{free_port()}'], timeout=2)\n"
        "try:\n    pool.next_id()\nexcept NoServerAvailableError:\n    print('refused')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "refused\n", "")
