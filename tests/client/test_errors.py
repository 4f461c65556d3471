"""The one error tree: what a caller catches, and what each error tells; and that a caller
who knows only the builtins catches the client's network failures by habit."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest
import snowflake_thrift_client
from snowflake_thrift_client import (
    AsyncSnowflakePool,
    CallFailedError,
    CallTimedOutError,
    ClockMovedBackwardsError,
    ConnectionFailedError,
    InvalidCountError,
    NoServerAnsweredError,
    NoServerAvailableError,
    RequestError,
    SnowflakeClient,
    SnowflakeError,
    SnowflakePool,
    UnavailableError,
    _errors,
)

from tests.support.endpoints import free_port


def test_the_tree() -> None:
    parents = {
        snowflake_thrift_client.ConfigurationError: (SnowflakeError, ValueError),
        RequestError: (SnowflakeError,),
        ClockMovedBackwardsError: (RequestError,),
        snowflake_thrift_client.InvalidUserAgentError: (RequestError,),
        InvalidCountError: (RequestError,),
        UnavailableError: (RequestError,),
        CallFailedError: (SnowflakeError,),
        ConnectionFailedError: (CallFailedError, ConnectionError),
        CallTimedOutError: (CallFailedError, TimeoutError),
        snowflake_thrift_client.WrongProtocolError: (ConnectionFailedError,),
        NoServerAvailableError: (SnowflakeError, ConnectionError),
        NoServerAnsweredError: (NoServerAvailableError, TimeoutError),
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


def test_every_error_is_importable_from_the_top_level() -> None:
    for name in _errors.__all__:
        assert name in snowflake_thrift_client.__all__
        assert getattr(snowflake_thrift_client, name) is getattr(_errors, name)


def test_the_builtins_each_error_is_caught_as() -> None:
    """What ``except ConnectionError`` and ``except TimeoutError`` catch, in MRO order:
    our classes first, so that ``super()`` and attribute lookups stay ours."""
    assert [c.__name__ for c in CallTimedOutError.__mro__] == [
        "CallTimedOutError", "CallFailedError", "SnowflakeError",
        "TimeoutError", "OSError", "Exception", "BaseException", "object",
    ]  # fmt: skip
    assert [c.__name__ for c in NoServerAnsweredError.__mro__] == [
        "NoServerAnsweredError", "NoServerAvailableError", "SnowflakeError",
        "ConnectionError", "TimeoutError", "OSError", "Exception", "BaseException", "object",
    ]  # fmt: skip
    caught_as: dict[type[Exception], set[type[Exception]]] = {
        CallFailedError: set(),
        ConnectionFailedError: {ConnectionError},
        CallTimedOutError: {TimeoutError},
        NoServerAvailableError: {ConnectionError},
        NoServerAnsweredError: {ConnectionError, TimeoutError},
        RequestError: set(),
    }
    for error, builtins in caught_as.items():
        found = {b for b in (ConnectionError, TimeoutError, OSError) if issubclass(error, b)}
        assert found == (builtins | {OSError} if builtins else set()), error


def test_clock_moved_backwards_says_how_far_in_twitters_words() -> None:
    error = ClockMovedBackwardsError(42)
    assert error.behind_ms == 42
    assert str(error) == "Clock moved backwards.  Refusing to generate id for 42 milliseconds"
    assert str(ClockMovedBackwardsError(7, "the server's own words")) == "the server's own words"


def test_call_failed_names_the_server_and_the_reason() -> None:
    error = CallFailedError("h:1", "timed out", connected=True, timed_out=True)
    assert str(error) == "h:1: timed out" and error.args == ("h:1: timed out",)
    assert (error.address, error.reason, error.connected, error.timed_out) == (
        "h:1", "timed out", True, True,
    )  # fmt: skip
    assert not CallFailedError("h:1", "refused", connected=False).timed_out


def test_a_call_failed_error_is_made_as_the_subclass_its_flags_call_for() -> None:
    # As OSError(errno.ECONNREFUSED, ...) gives a ConnectionRefusedError: every place that
    # makes a CallFailedError gives the caller the builtin base it expects.
    made = {
        (True, False): CallFailedError,  # an application error, a bad reply...
        (False, False): ConnectionFailedError,
        (True, True): CallTimedOutError,
        (False, True): CallTimedOutError,  # the connect timed out
    }
    for (connected, timed_out), kind in made.items():
        error = CallFailedError("h:1", "why", connected=connected, timed_out=timed_out)
        assert type(error) is kind
        assert (str(error), error.connected, error.timed_out) == ("h:1: why", connected, timed_out)
    direct = ConnectionFailedError("h:1", "the connection was closed", connected=True)
    assert type(direct) is ConnectionFailedError and direct.connected
    assert CallTimedOutError("h:1", "t", connected=True, timed_out=True).errno is None


def test_no_server_available_lists_every_failure_in_order() -> None:
    failures = [
        ("h:1", CallFailedError("h:1", "cannot connect: refused", connected=False)),
        ("h:2", ClockMovedBackwardsError(5)),
    ]
    error = NoServerAvailableError("no snowflake server could serve get_id", failures)
    assert type(error) is NoServerAvailableError and error.failures == tuple(failures)
    assert str(error) == (
        "no snowflake server could serve get_id: h:1: cannot connect: refused; "
        "Clock moved backwards.  Refusing to generate id for 5 milliseconds"
    )
    assert str(NoServerAvailableError("discovery failed")) == "discovery failed"
    with pytest.raises(SnowflakeError):
        raise error


def test_no_server_answered_when_every_attempt_timed_out() -> None:
    timed_out = [
        (f"h:{n}", CallFailedError(f"h:{n}", "timed out", connected=True, timed_out=True))
        for n in (1, 2)
    ]
    error = NoServerAvailableError("no snowflake server could serve get_id", timed_out)
    assert type(error) is NoServerAnsweredError
    assert error.failures == tuple(timed_out) and str(error).endswith("h:2: timed out")
    refused = ("h:3", CallFailedError("h:3", "refused", connected=False))
    assert type(NoServerAvailableError("m", [*timed_out, refused])) is NoServerAvailableError
    assert type(NoServerAvailableError("m")) is NoServerAvailableError, "no attempt at all"


# -- real failures, caught by habit -----------------------------------------------------------


@pytest.fixture
def silent() -> Iterator[str]:
    """A server that never answers: the kernel accepts connections, nobody reads them."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        host, port = listener.getsockname()
        yield f"{host}:{port}"


def ids_from_both_pools(server: str, **kwargs: object) -> list[BaseException]:
    """What ``next_id`` raises from a SnowflakePool, then from an AsyncSnowflakePool."""
    raised: list[BaseException] = []
    with SnowflakePool(server, **kwargs) as pool:  # type: ignore[arg-type]
        try:
            pool.next_id()
        except BaseException as e:  # noqa: BLE001 - looked at by the test
            raised.append(e)

    async def from_async_pool() -> None:
        async with AsyncSnowflakePool(server, **kwargs) as pool:  # type: ignore[arg-type]
            try:
                await pool.next_id()
            except BaseException as e:  # noqa: BLE001 - looked at by the test
                raised.append(e)

    asyncio.run(from_async_pool())
    return raised


def test_a_refused_port_is_a_connection_error_from_both_pools() -> None:
    raised = ids_from_both_pools(f"127.0.0.1:{free_port()}", timeout=2)
    assert len(raised) == 2
    for error in raised:
        assert isinstance(error, ConnectionError) and not isinstance(error, TimeoutError)
        assert all(isinstance(e, ConnectionFailedError) for _, e in error.failures)  # type: ignore[attr-defined]
        assert isinstance(error.__cause__, ConnectionFailedError)
        assert isinstance(error.__cause__.__cause__, ConnectionRefusedError)
    with pytest.raises(ConnectionError) as info:
        SnowflakeClient("127.0.0.1", free_port()).next_id()
    assert isinstance(info.value, ConnectionFailedError) and not info.value.connected


@pytest.mark.slow
def test_a_silent_server_is_a_timeout_error_from_both_pools(silent: str) -> None:
    raised = ids_from_both_pools(silent, timeout=0.2)
    assert len(raised) == 2
    for error in raised:
        assert isinstance(error, TimeoutError), error
        assert isinstance(error, NoServerAnsweredError)
        assert [type(e) for _, e in error.failures] == [CallTimedOutError] * 2
    host, port = silent.rsplit(":", 1)
    with pytest.raises(TimeoutError) as info, SnowflakeClient(host, int(port), timeout=0.2) as one:
        one.next_id()
    assert isinstance(info.value, CallTimedOutError) and info.value.connected


def test_a_connection_dropped_during_the_call_is_a_connection_error() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        host, port = listener.getsockname()

        def hang_up() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)  # the call arrives; the server goes away without a reply

        thread = threading.Thread(target=hang_up)
        thread.start()
        try:
            with pytest.raises(ConnectionError) as info, SnowflakeClient(host, port) as one:
                one.next_id()
        finally:
            thread.join(10)
    assert isinstance(info.value, ConnectionFailedError) and info.value.connected
    assert not isinstance(info.value, TimeoutError)
