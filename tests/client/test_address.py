"""Server addresses: every spelling a caller may use, and the ones refused."""

from __future__ import annotations

import pytest
from snowflake_thrift_client import (
    DEFAULT_PORT,
    ConfigurationError,
    ServerAddress,
    SnowflakePool,
    parse_server,
)


@pytest.mark.parametrize(
    ("given", "parsed"),
    [
        ("10.0.0.1:7000", ("10.0.0.1", 7000)),
        ("id-host", ("id-host", DEFAULT_PORT)),
        (" id-host:1 ", ("id-host", 1)),
        ("[::1]:7610", ("::1", 7610)),
        ("[::1]", ("::1", DEFAULT_PORT)),
        (("localhost", 1), ("localhost", 1)),
        (("::1", 65535), ("::1", 65535)),
    ],
)
def test_server_addresses(given: ServerAddress, parsed: tuple[str, int]) -> None:
    assert parse_server(given) == parsed
    assert DEFAULT_PORT == 7609


@pytest.mark.parametrize(
    "bad", ["", "a:b:c", "host:0", "host:65536", "host:x", "::1", ("host", "7609"), ("", 1), 7609]
)
def test_bad_addresses_are_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"address|port") as info:
        parse_server(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_a_pool_takes_one_address_or_many_and_drops_duplicates() -> None:
    assert SnowflakePool("h:1").servers == ["h:1"]
    assert SnowflakePool(("h", 2)).servers == ["h:2"]
    assert SnowflakePool(["h:1", ("h", 1), "[::1]:3"]).servers == ["h:1", "[::1]:3"]
    assert SnowflakePool([("h", 1), ("h", 2)]).servers == ["h:1", "h:2"], "two servers"
