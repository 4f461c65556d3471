"""The one error tree: what a caller catches, and what each error tells."""

from __future__ import annotations

import pytest
import snowflake_thrift_client
from snowflake_thrift_client import (
    CallFailedError,
    ClockMovedBackwardsError,
    InvalidCountError,
    NoServerAvailableError,
    RequestError,
    SnowflakeError,
    UnavailableError,
)


def test_the_tree() -> None:
    parents = {
        snowflake_thrift_client.ConfigurationError: (SnowflakeError, ValueError),
        RequestError: (SnowflakeError,),
        ClockMovedBackwardsError: (RequestError,),
        snowflake_thrift_client.InvalidUserAgentError: (RequestError,),
        InvalidCountError: (RequestError,),
        UnavailableError: (RequestError,),
        CallFailedError: (SnowflakeError,),
        NoServerAvailableError: (SnowflakeError,),
    }
    for error, bases in parents.items():
        assert error.__bases__ == bases, error
    public = {
        value
        for name in snowflake_thrift_client.__all__
        if isinstance(value := getattr(snowflake_thrift_client, name), type)
        and issubclass(value, BaseException)
    }
    assert public == {SnowflakeError, *parents}, "every public error is in the tree above"


def test_clock_moved_backwards_says_how_far_in_twitters_words() -> None:
    error = ClockMovedBackwardsError(42)
    assert error.behind_ms == 42
    assert str(error) == "Clock moved backwards.  Refusing to generate id for 42 milliseconds"
    assert str(ClockMovedBackwardsError(7, "the server's own words")) == "the server's own words"


def test_call_failed_names_the_server_and_the_reason() -> None:
    error = CallFailedError("h:1", "timed out", connected=True, timed_out=True)
    assert str(error) == "h:1: timed out"
    assert (error.address, error.reason, error.connected, error.timed_out) == (
        "h:1", "timed out", True, True,
    )  # fmt: skip
    assert not CallFailedError("h:1", "refused", connected=False).timed_out


def test_no_server_available_lists_every_failure_in_order() -> None:
    failures = [
        ("h:1", CallFailedError("h:1", "cannot connect: refused", connected=False)),
        ("h:2", ClockMovedBackwardsError(5)),
    ]
    error = NoServerAvailableError("no snowflake server could serve get_id", failures)
    assert error.failures == tuple(failures)
    assert str(error) == (
        "no snowflake server could serve get_id: h:1: cannot connect: refused; "
        "Clock moved backwards.  Refusing to generate id for 5 milliseconds"
    )
    assert str(NoServerAvailableError("discovery failed")) == "discovery failed"
    with pytest.raises(SnowflakeError):
        raise error
