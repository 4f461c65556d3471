"""SnowflakePool: threads, failover, back-off and prefetch, against real servers in this
process; time passes only when the test moves the pool's clock."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from snowflake_thrift_client import (
    AsyncSnowflakePool,
    CallFailedError,
    ClockMovedBackwardsError,
    ConfigurationError,
    InvalidCountError,
    InvalidUserAgentError,
    NoServerAvailableError,
    SnowflakePool,
    decompose,
)

from tests.client.helpers import (
    FakeServer,
    MakeServer,
    ShiftedWallClock,
    address,
    counts,
    thrift,
)
from tests.support.endpoints import free_port
from tests.support.fakes import SecondsClock
from tests.support.inprocess import InProcessServer
from tests.support.processes import failures
from tests.support.waiting import wait_until

# -- failover -------------------------------------------------------------------------------


def test_pool_fails_over_past_dead_and_silent_servers(
    servers: MakeServer, clock: SecondsClock
) -> None:
    good = servers(worker_id=4)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        # `silent` accepts connections (the kernel does) but never answers.
        dead = f"127.0.0.1:{free_port()}"
        with SnowflakePool(
            [dead, silent.getsockname(), address(good)], timeout=0.3, clock=clock
        ) as pool:
            started = time.monotonic()
            ids = [pool.next_id() for _ in range(20)]
            # The clock stands still: the failed stay last however long the timeout took.
            assert time.monotonic() - started < 2.0, "one timeout, then the failed are tried last"
            assert ids == sorted(set(ids)) and {decompose(i).worker_id for i in ids} == {4}


def test_pool_raises_every_failure_when_no_server_can_serve() -> None:
    dead = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    with SnowflakePool(dead, timeout=0.5) as pool, pytest.raises(NoServerAvailableError) as info:
        pool.next_id()
    failures = info.value.failures
    assert len(failures) == 3, "one attempt per server, plus one"
    assert {a for a, _ in failures} == {f"{h}:{p}" for h, p in dead}
    assert all(isinstance(e, CallFailedError) and not e.connected for _, e in failures)
    assert isinstance(info.value.__cause__, CallFailedError)
    with SnowflakePool(dead, attempts=1) as pool, pytest.raises(NoServerAvailableError) as info:
        pool.next_ids(3)
    assert len(info.value.failures) == 1


def test_callers_errors_are_raised_at_once_not_retried(servers: MakeServer) -> None:
    one, two = servers(worker_id=1), servers(worker_id=2)
    with SnowflakePool([address(one), address(two)]) as pool:
        with pytest.raises(InvalidUserAgentError):
            pool.next_id("not valid")
        with pytest.raises(InvalidCountError):
            pool.next_ids(5000)
        refused = [
            failures(counts(s), kind)
            for s in (one, two)
            for kind in ("invalid_user_agent", "invalid_count")
        ]
        assert sum(refused) == 2, "each error came from one server only"
        # A count the IDL's i32 cannot carry is the caller's too: refused before it is sent
        # (the encoder's error was taken for every server failing: NoServerAvailableError).
        for count in (2**31, 2**32 + 3, -(2**31) - 1, 2.0, True):
            with pytest.raises(ConfigurationError, match="count must be an integer"):
                pool.next_ids(count)  # type: ignore[arg-type]
        assert pool.next_id() > 0


def clock_refusals(server: InProcessServer) -> float:
    return failures(counts(server), "invalid_system_clock")


def step_back(server: InProcessServer, wall: ShiftedWallClock) -> None:
    """Move ``server``'s clock a minute behind the newest id it has issued."""
    assert server.client().next_id() > 0
    wall.offset_ms = -60_000


def test_a_server_whose_clock_went_back_fails_over_to_one_with_a_good_clock(
    servers: MakeServer,
) -> None:
    wall = ShiftedWallClock()
    behind, good = servers(worker_id=1, clock=wall), servers(worker_id=2)
    step_back(behind, wall)
    with SnowflakePool([address(behind), address(good)]) as pool:
        ids = [pool.next_id() for _ in range(10)] + pool.next_ids(10)
    assert {decompose(i).worker_id for i in ids} == {2}
    assert clock_refusals(behind) >= 1, "the node behind was asked, and refused"
    with SnowflakePool(address(behind)) as alone, pytest.raises(NoServerAvailableError) as e:
        alone.next_id()
    assert len(e.value.failures) == 2, "one server, plus one"
    assert all(isinstance(err, ClockMovedBackwardsError) for _, err in e.value.failures)


def test_a_failed_server_is_tried_last_until_retry_failed_after_has_passed(
    servers: MakeServer, clock: SecondsClock
) -> None:
    wall = ShiftedWallClock()
    behind, good = servers(worker_id=1, clock=wall), servers(worker_id=2)
    step_back(behind, wall)
    # No idle connections: each call opens a new one, to each server in turn, so without
    # the back-off every other call would go to the server behind first.
    with SnowflakePool(
        [address(behind), address(good)], pool_size=0, retry_failed_after=60, clock=clock
    ) as pool:
        assert {decompose(pool.next_id()).worker_id for _ in range(10)} == {2}
        assert clock_refusals(behind) == 1, "asked once, then last"
        clock.advance(59)
        assert {decompose(pool.next_id()).worker_id for _ in range(10)} == {2}
        assert clock_refusals(behind) == 1, "still last within retry_failed_after"
        clock.advance(1)
        assert {decompose(pool.next_id()).worker_id for _ in range(2)} == {2}
        assert clock_refusals(behind) == 2, "in turn again once it has passed, and last again"
        wall.offset_ms = 0
        clock.advance(60)
        assert {decompose(pool.next_id()).worker_id for _ in range(4)} == {1, 2}, "recovered"


def test_a_node_that_says_it_is_unavailable_is_skipped(
    fake: Callable[[object], FakeServer], clock: SecondsClock
) -> None:
    class Unavailable:
        def get_id(self, useragent: str) -> int:
            raise thrift.UnavailableError(message="shutting down")

    class Fine:
        def get_id(self, useragent: str) -> int:
            return 42

    down, up = fake(Unavailable()), fake(Fine())
    with SnowflakePool([address(down), address(up)], pool_size=0, clock=clock) as pool:
        assert [pool.next_id() for _ in range(4)] == [42] * 4
        assert down.accepted == 1, "tried once, then last while it was marked failed"
        clock.advance(pool.retry_failed_after)
        assert [pool.next_id() for _ in range(2)] == [42] * 2
        assert down.accepted == 2, "tried again once retry_failed_after had passed"


def test_new_connections_are_spread_over_the_servers(servers: MakeServer) -> None:
    one, two = servers(worker_id=1), servers(worker_id=2)
    with SnowflakePool([address(one), address(two)], pool_size=0) as pool:
        assert {decompose(pool.next_id()).worker_id for _ in range(6)} == {1, 2}
    assert counts(one)["snowflake_connections_accepted_total"] == 3
    assert counts(two)["snowflake_connections_accepted_total"] == 3


def test_a_server_stopping_mid_use_fails_over_without_an_error(servers: MakeServer) -> None:
    one, two = servers(worker_id=1), servers(worker_id=2)
    with SnowflakePool([address(one), address(two)]) as pool:
        in_use, other = (one, two) if decompose(pool.next_id()).worker_id == 1 else (two, one)
        in_use.stop()  # the pool keeps an idle connection to it
        after = [pool.next_id() for _ in range(20)]
        assert {decompose(i).worker_id for i in after} == {2 if in_use is one else 1}
        assert counts(other)["snowflake_connections_accepted_total"] == 1


def test_idle_connections_the_server_closed_are_reopened_transparently(
    servers: MakeServer,
) -> None:
    server = servers(idle_timeout=0.3)
    with SnowflakePool(address(server)) as pool:
        first = pool.next_id()
        wait_until(
            lambda: counts(server)['snowflake_connections_open{protocol="thrift"}'] == 0,
            "the server to close the pool's idle connection",
            timeout_s=10,
        )
        assert pool.next_id() > first
    assert counts(server)["snowflake_connections_accepted_total"] == 2


def test_pool_is_thread_safe_and_reuses_connections(server: InProcessServer) -> None:
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    with SnowflakePool(address(server), pool_size=8) as pool:

        def work(n: int) -> None:
            try:
                mine = []
                for i in range(150):
                    mine.extend(pool.next_ids(3) if i % 10 == 0 else [pool.next_id()])
                results[n] = mine
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert not errors, errors
    every = [i for ids in results.values() for i in ids]
    assert len(every) == 8 * (135 + 15 * 3) == len(set(every))
    assert all(ids == sorted(ids) for ids in results.values()), "each thread's ids increase"
    assert counts(server)["snowflake_connections_accepted_total"] <= 8


# -- prefetch -------------------------------------------------------------------------------


def test_prefetch_serves_a_batch_per_round_trip(server: InProcessServer) -> None:
    # Ids are counted (per agent) before the reply is written: exact as soon as a call returns.
    def handed_out(agent: str = "prefetch") -> float:
        return counts(server).get(f'snowflake_ids_by_agent_total{{agent="{agent}"}}', 0)

    with SnowflakePool(address(server), agent="prefetch", prefetch=100) as pool:
        ids = [pool.next_id() for _ in range(150)]
        assert ids == sorted(set(ids)), "handed out in order"
        lock = threading.Lock()
        more: list[int] = []

        def take() -> None:
            got = [pool.next_id() for _ in range(25)]
            with lock:
                more.extend(got)

        threads = [threading.Thread(target=take) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(more) == 100 and not set(more) & set(ids) and len(set(more)) == 100
        assert handed_out() == 300, "3 batches of 100 served 250 calls"
        assert pool.next_id("another-agent") > 0
        assert handed_out("another-agent") == 1, "another agent goes to the server"
        assert len(pool.next_ids(7)) == 7 and handed_out() == 307, "so does next_ids"


def test_prefetched_ids_older_than_max_age_are_dropped(
    server: InProcessServer, clock: SecondsClock
) -> None:
    def handed_out() -> float:
        return counts(server)['snowflake_ids_by_agent_total{agent="aged"}']

    with SnowflakePool(
        address(server), agent="aged", prefetch=50, prefetch_max_age=1.0, clock=clock
    ) as pool:
        first = pool.next_id()
        assert pool.next_id() > first and handed_out() == 50, "the same batch"
        clock.advance(1.0)
        assert pool.next_id() > first and handed_out() == 50, "as old as the limit: kept"
        clock.advance(0.5)
        fresh = pool.next_id()
        assert handed_out() == 100, "older than the limit: dropped for a new batch"
        assert fresh > first
        clock.advance(0.5)
        assert pool.next_id() > fresh and handed_out() == 100, "the new batch's age counts"


def test_prefetch_without_max_age_keeps_ids_however_old(
    server: InProcessServer, clock: SecondsClock
) -> None:
    with SnowflakePool(address(server), agent="kept", prefetch=5, clock=clock) as pool:
        pool.next_id()
        clock.advance(10**9)
        assert len({pool.next_id() for _ in range(4)}) == 4
        assert counts(server)['snowflake_ids_by_agent_total{agent="kept"}'] == 5


# -- arguments and life cycle ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": 0},
        {"timeout": float("nan")},
        {"connect_timeout": -1},
        {"attempts": 0},
        {"pool_size": -1},
        {"prefetch": -5},
        {"prefetch_max_age": 0},
        {"refresh_interval": 0},
        {"transport": "http"},
        {"servers": []},
        {"clock": 5.0},
    ],
)
@pytest.mark.parametrize("pool", [SnowflakePool, AsyncSnowflakePool])
def test_bad_pool_arguments_are_refused(pool: type[Any], kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"must|no servers"):
        pool(**kwargs)


def test_a_closed_pool_refuses_calls(server: InProcessServer) -> None:
    pool = SnowflakePool(address(server), prefetch=10)
    assert pool.next_id() > 0
    assert "idle=1" in repr(pool)
    pool.close()
    assert "idle=0" in repr(pool)
    with pytest.raises(RuntimeError, match="closed"):
        pool.next_ids(2)
    with pytest.raises(RuntimeError, match="closed"):
        pool.next_id()  # the prefetched ids were dropped too
