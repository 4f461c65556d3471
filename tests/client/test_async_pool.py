"""AsyncSnowflakePool: SnowflakePool's behaviour on an event loop, against real servers
(in this process, or in processes of their own for TLS), each test in an event loop of
its own (``asyncio.run``); time passes only when the test moves the pool's clock, but
for the real timeouts of silent servers."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from snowflake_thrift_client import (
    AsyncSnowflakePool,
    CallFailedError,
    CallTimedOutError,
    ClockMovedBackwardsError,
    ConfigurationError,
    ConnectionFailedError,
    InvalidCountError,
    InvalidUserAgentError,
    NoServerAnsweredError,
    NoServerAvailableError,
    SnowflakePool,
    ZooKeeperDiscovery,
    client_context,
    decompose,
)
from snowflake_thrift_client._async_client import NeedMore, decode_reply
from snowflake_thrift_client._transports import Transport
from thriftpy2.protocol import TBinaryProtocol
from thriftpy2.thrift import TApplicationException, TMessageType
from thriftpy2.transport import TMemoryBuffer

from tests.client.helpers import (
    FakeServer,
    MakeServer,
    ShiftedWallClock,
    address,
    counts,
    thrift,
)
from tests.client.test_client import LateFirstReply
from tests.client.test_pool import clock_refusals, step_back
from tests.client.test_tls import Pki
from tests.support.endpoints import free_port
from tests.support.fakes import SecondsClock
from tests.support.inprocess import InProcessServer
from tests.support.processes import ServerProcess, failures, start_server
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

T = TypeVar("T")


def run(test: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``test()`` in a fresh event loop (pytest-asyncio is not installed)."""
    return asyncio.run(test())


async def off_loop(function: Callable[[], T]) -> T:
    """``function()`` (which blocks: a server stopping, a metrics scrape) in a thread."""
    return await asyncio.to_thread(function)


def open_connections(server: InProcessServer) -> float:
    return counts(server)['snowflake_connections_open{protocol="thrift"}']


def accepted(server: InProcessServer) -> float:
    return counts(server)["snowflake_connections_accepted_total"]


@pytest.fixture
def silent() -> Iterator[str]:
    """A server that never answers: the kernel accepts connections, nobody reads them."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        host, port = listener.getsockname()
        yield f"{host}:{port}"


# -- ids --------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_ids_over_each_transport(servers: MakeServer, transport: Transport) -> None:
    server = servers(worker_id=5, datacenter_id=2, transport=transport)

    async def test() -> None:
        async with AsyncSnowflakePool(address(server), transport=transport, agent="t-1") as pool:
            first = await pool.next_id()
            assert (decompose(first).worker_id, decompose(first).datacenter_id) == (5, 2)
            # 36 KiB: a reply that may come in pieces (see ..._decoded_only_once_it_is_whole).
            batch = await pool.next_ids(4096)
            assert len(batch) == 4096 and batch == sorted(set(batch)) and batch[0] > first
            assert await pool.next_id() > batch[-1]
            assert "idle=1" in repr(pool)

    run(test)
    assert accepted(server) == 1, "one connection, reused"
    assert counts(server)['snowflake_ids_by_agent_total{agent="t-1"}'] == 4098


def test_many_tasks_share_one_pool_and_get_distinct_ids(server: InProcessServer) -> None:
    async def task(pool: AsyncSnowflakePool, n: int) -> list[int]:
        mine = []
        for i in range(40):
            mine.extend(await pool.next_ids(3) if i % 10 == n % 10 else [await pool.next_id()])
        return mine

    async def test() -> list[list[int]]:
        async with AsyncSnowflakePool(address(server), pool_size=32) as pool:
            return await asyncio.gather(*(task(pool, n) for n in range(32)))

    results = run(test)
    every = [i for ids in results for i in ids]
    assert len(every) == 32 * (36 + 4 * 3) == len(set(every))
    assert all(ids == sorted(ids) for ids in results), "each task's ids increase"
    assert accepted(server) == 32, "a connection per task at once, each reused"


def test_at_most_pool_size_connections_stay_open(server: InProcessServer) -> None:
    async def test() -> None:
        async with AsyncSnowflakePool(address(server), pool_size=2) as pool:
            await asyncio.gather(*(pool.next_id() for _ in range(5)))
            assert "idle=2" in repr(pool)
            assert await off_loop(lambda: accepted(server)) == 5
            await off_loop(
                lambda: wait_until(lambda: open_connections(server) == 2, "3 of 5 closed")
            )

    run(test)


def reply_bytes(transport: Transport, seqid: int, ids: list[int]) -> bytes:
    """A ``get_ids`` reply as a server writes it, made by thriftpy2's pure-Python code."""
    body: Any = TMemoryBuffer()  # type: ignore[no-untyped-call]  # thriftpy2 is untyped
    protocol: Any = TBinaryProtocol(body)  # type: ignore[no-untyped-call]
    protocol.write_message_begin("get_ids", TMessageType.REPLY, seqid)
    protocol.write_struct(thrift.Snowflake.get_ids_result(success=ids))
    protocol.write_message_end()
    data = bytes(body.getvalue())
    return struct.pack("!i", len(data)) + data if transport == "framed" else data


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_a_reply_is_decoded_only_once_it_is_whole(transport: Transport) -> None:
    # Every prefix must ask for more: thriftpy2's Cython memory buffer would rather read
    # past its end and decode garbage.
    ids = list(range(2**60, 2**60 + 100))
    whole = reply_bytes(transport, 1, ids)  # a connection's first call is #1
    for end in range(len(whole)):
        with pytest.raises(NeedMore):
            decode_reply("get_ids", 1, whole[:end], transport)
    assert decode_reply("get_ids", 1, whole, transport) == ids
    late = reply_bytes(transport, 0, ids)  # the answer to an earlier call
    with pytest.raises(TApplicationException, match="a reply to get_ids #0, not to get_ids #1"):
        decode_reply("get_ids", 1, late, transport)


# -- failover ---------------------------------------------------------------------------------


def test_failover_past_dead_and_silent_servers(
    servers: MakeServer, clock: SecondsClock, silent: str
) -> None:
    good = servers(worker_id=4)
    dead = f"127.0.0.1:{free_port()}"

    async def test() -> list[int]:
        async with AsyncSnowflakePool([dead, silent, address(good)], timeout=0.3, clock=clock) as p:
            started = time.monotonic()
            ids = [await p.next_id() for _ in range(20)]
            # The clock stands still: the failed stay last however long the timeout took.
            assert time.monotonic() - started < 2.0, "one timeout, then the failed are tried last"
            return ids

    ids = run(test)
    assert ids == sorted(set(ids)) and {decompose(i).worker_id for i in ids} == {4}


def test_a_server_stopping_mid_use_fails_over_without_an_error(servers: MakeServer) -> None:
    one, two = servers(worker_id=1), servers(worker_id=2)

    async def test() -> None:
        async with AsyncSnowflakePool([address(one), address(two)]) as pool:
            first = decompose(await pool.next_id()).worker_id
            in_use, other = (one, two) if first == 1 else (two, one)
            await off_loop(in_use.stop)  # the pool keeps an idle connection to it
            after = [await pool.next_id() for _ in range(20)]
            assert {decompose(i).worker_id for i in after} == {3 - first}
            assert await off_loop(lambda: accepted(other)) == 1

    run(test)


def test_every_failure_is_raised_when_no_server_can_serve() -> None:
    dead = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]

    async def test() -> None:
        async with AsyncSnowflakePool(dead, timeout=0.5) as pool:
            with pytest.raises(NoServerAvailableError) as info:
                await pool.next_id()
        failures = info.value.failures
        assert len(failures) == 3, "one attempt per server, plus one"
        assert {a for a, _ in failures} == {f"{h}:{p}" for h, p in dead}
        assert all(isinstance(e, ConnectionFailedError) and not e.connected for _, e in failures)
        assert isinstance(info.value.__cause__, CallFailedError)
        async with AsyncSnowflakePool(dead, attempts=1) as pool:
            with pytest.raises(NoServerAvailableError) as info:
                await pool.next_ids(3)
        assert len(info.value.failures) == 1

    run(test)


def test_callers_errors_are_raised_at_once_not_retried(servers: MakeServer) -> None:
    one, two = servers(worker_id=1), servers(worker_id=2)

    async def test() -> None:
        async with AsyncSnowflakePool([address(one), address(two)]) as pool:
            with pytest.raises(InvalidUserAgentError):
                await pool.next_id("not valid")
            with pytest.raises(InvalidCountError):
                await pool.next_ids(5000)
            assert await pool.next_id() > 0

    run(test)
    refused = [
        failures(counts(s), kind)
        for s in (one, two)
        for kind in ("invalid_user_agent", "invalid_count")
    ]
    assert sum(refused) == 2, "each error came from one server only"
    assert accepted(one) + accepted(two) == 1, "a declared error keeps the connection"


def test_a_server_whose_clock_went_back_is_tried_last_until_retry_failed_after(
    servers: MakeServer, clock: SecondsClock
) -> None:
    wall = ShiftedWallClock()
    behind, good = servers(worker_id=1, clock=wall), servers(worker_id=2)
    step_back(behind, wall)

    async def test() -> None:
        async with AsyncSnowflakePool(
            [address(behind), address(good)], pool_size=0, retry_failed_after=60, clock=clock
        ) as pool:
            assert {decompose(await pool.next_id()).worker_id for _ in range(10)} == {2}
            assert await off_loop(lambda: clock_refusals(behind)) == 1, "asked once, then last"
            clock.advance(60)
            assert {decompose(await pool.next_id()).worker_id for _ in range(2)} == {2}
            assert await off_loop(lambda: clock_refusals(behind)) == 2, "in turn again"
        async with AsyncSnowflakePool(address(behind)) as alone:
            with pytest.raises(NoServerAvailableError) as e:
                await alone.next_id()
        assert [type(err) for _, err in e.value.failures] == [ClockMovedBackwardsError] * 2

    run(test)


# -- timeouts and discarded connections -------------------------------------------------------


def test_a_silent_server_times_out_within_the_timeout(silent: str) -> None:
    async def test() -> None:
        async with AsyncSnowflakePool(silent, timeout=0.2) as pool:
            started = time.monotonic()
            with pytest.raises(NoServerAnsweredError) as info:
                await pool.next_id()
            assert time.monotonic() - started < 1.5, "two attempts of 0.2 s"
        errors = [e for _, e in info.value.failures]
        assert [type(e) for e in errors] == [CallTimedOutError] * 2
        assert all(isinstance(e, CallTimedOutError) and e.connected for e in errors)
        assert all(str(e).endswith(": timed out") for e in errors)

    run(test)


def test_a_timed_out_connection_is_discarded_so_a_late_reply_is_never_read(
    fake: Callable[[object], FakeServer],
) -> None:
    handler = LateFirstReply()
    server = fake(handler)

    async def test() -> None:
        async with AsyncSnowflakePool(address(server), timeout=0.2) as pool:
            # The first try times out; the retry, on a new connection, is answered at once.
            assert await pool.next_id() == 102
            handler.release.set()
            assert await off_loop(lambda: handler.replied.wait(5))
            # The late reply (111) went to the discarded connection: never read.
            assert [await pool.next_id() for _ in range(2)] == [103, 104]

    run(test)
    assert server.accepted == 2


def test_a_call_cancelled_mid_flight_discards_its_connection(
    fake: Callable[[object], FakeServer],
) -> None:
    handler = LateFirstReply()
    server = fake(handler)

    async def test() -> None:
        async with AsyncSnowflakePool(address(server), timeout=10) as pool:
            with pytest.raises(TimeoutError):  # the caller's own deadline
                await asyncio.wait_for(pool.next_id(), 0.2)
            assert "idle=0" in repr(pool), "not given back to the pool"
            handler.release.set()
            assert await off_loop(lambda: handler.replied.wait(5))
            assert await pool.next_id() == 102, "a new connection, and the answer to this call"

    run(test)
    assert server.accepted == 2


def test_a_connection_is_discarded_after_an_application_error(
    fake: Callable[[object], FakeServer],
) -> None:
    class FailsOnce:
        calls = 0

        def get_id(self, useragent: str) -> int:
            self.calls += 1
            if self.calls == 1:  # sent as an error reply: the server keeps the connection
                raise TApplicationException(TApplicationException.INTERNAL_ERROR, "a bug")
            return 7

    server = fake(FailsOnce())

    async def test() -> None:
        async with AsyncSnowflakePool(address(server), attempts=1) as pool:
            with pytest.raises(NoServerAvailableError, match="a bug") as info:
                await pool.next_id()
            ((_, error),) = info.value.failures
            assert type(error) is CallFailedError and error.connected and not error.timed_out
            assert isinstance(error.__cause__, TApplicationException)
            assert "idle=0" in repr(pool)
            assert await pool.next_id() == 7

    run(test)
    assert server.accepted == 2


def test_idle_connections_the_server_closed_are_reopened_transparently(
    servers: MakeServer,
) -> None:
    server = servers(idle_timeout=0.3)

    async def test() -> None:
        async with AsyncSnowflakePool(address(server), attempts=1) as pool:
            first = await pool.next_id()
            await off_loop(
                lambda: wait_until(
                    lambda: open_connections(server) == 0,
                    "the server to close the pool's idle connection",
                    timeout_s=10,
                )
            )
            assert await pool.next_id() > first, "not counted as an attempt"

    run(test)
    assert accepted(server) == 2


# -- prefetch ---------------------------------------------------------------------------------


def test_prefetch_serves_a_batch_per_round_trip(server: InProcessServer) -> None:
    def handed_out(agent: str = "prefetch") -> float:
        return counts(server).get(f'snowflake_ids_by_agent_total{{agent="{agent}"}}', 0)

    async def test() -> None:
        async with AsyncSnowflakePool(address(server), agent="prefetch", prefetch=100) as pool:
            ids = [await pool.next_id() for _ in range(150)]
            assert ids == sorted(set(ids)), "handed out in order"
            # Tasks at once: one refills, the others wait for it, and all take in turn.
            more = await asyncio.gather(*(pool.next_id() for _ in range(100)))
            assert more == sorted(set(more)) and more[0] > ids[-1]
            assert await off_loop(handed_out) == 300, "3 batches of 100 served 250 calls"
            assert await pool.next_id("another-agent") > 0
            assert await off_loop(lambda: handed_out("another-agent")) == 1
            assert len(await pool.next_ids(7)) == 7
            assert await off_loop(handed_out) == 307, "next_ids goes to the server"

    run(test)


def test_prefetched_ids_older_than_max_age_are_dropped(
    server: InProcessServer, clock: SecondsClock
) -> None:
    def handed_out() -> float:
        return counts(server).get('snowflake_ids_by_agent_total{agent="aged"}', 0)

    async def test() -> None:
        async with AsyncSnowflakePool(
            address(server), agent="aged", prefetch=50, prefetch_max_age=1.0, clock=clock
        ) as pool:
            first = await pool.next_id()
            assert await pool.next_id() > first and handed_out() == 50, "the same batch"
            clock.advance(1.0)
            assert await pool.next_id() > first and handed_out() == 50, "as old as the limit"
            clock.advance(0.5)
            fresh = await pool.next_id()
            assert handed_out() == 100, "older than the limit: dropped for a new batch"
            clock.advance(0.5)
            assert await pool.next_id() > fresh and handed_out() == 100, "the new batch's age"
        async with AsyncSnowflakePool(address(server), agent="aged", prefetch=5, clock=clock) as p:
            await p.next_id()
            clock.advance(10**9)
            assert len({await p.next_id() for _ in range(4)}) == 4 and handed_out() == 105

    run(test)


# -- discovery --------------------------------------------------------------------------------


def test_a_blocking_discovery_runs_off_the_loop(servers: MakeServer, clock: SecondsClock) -> None:
    one, two = servers(worker_id=1), servers(worker_id=2)
    current = [address(one)]
    asked_on: list[int] = []
    started, loop_ran = threading.Event(), threading.Event()

    def discover() -> list[str]:
        asked_on.append(threading.get_ident())
        started.set()
        # Set by a task on the loop: if this ran on the loop's thread, nobody could.
        assert loop_ran.wait(10), "the event loop was blocked by the discovery"
        return list(current)

    async def test() -> None:
        async with AsyncSnowflakePool(discover, refresh_interval=5, clock=clock) as pool:
            call = asyncio.create_task(pool.next_id())
            assert await off_loop(lambda: started.wait(10))
            loop_ran.set()
            assert decompose(await call).worker_id == 1
            assert pool.servers == [address(one)]
            current[:] = [address(two)]
            clock.advance(4)
            assert decompose(await pool.next_id()).worker_id == 1, "not asked again yet"
            clock.advance(1)
            assert decompose(await pool.next_id()).worker_id == 2
            assert pool.servers == [address(two)]

    run(test)
    assert len(asked_on) == 2 and threading.get_ident() not in asked_on


def test_a_coroutine_discovery_is_awaited_and_a_failed_one_keeps_the_last_list(
    server: InProcessServer, clock: SecondsClock
) -> None:
    answers: list[Any] = [[address(server)], OSError("registry down")]

    async def discover() -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    async def test() -> None:
        async with AsyncSnowflakePool(discover, refresh_interval=1, clock=clock) as pool:
            assert await pool.next_id() > 0
            clock.advance(1)
            assert await pool.next_id() > 0, "the error keeps the old list"
            assert pool.servers == [address(server)] and not answers
        async with AsyncSnowflakePool(lambda: [], clock=clock) as pool:
            with pytest.raises(NoServerAvailableError, match="discovery found no servers"):
                await pool.next_id()

    run(test)
    with pytest.raises(ConfigurationError, match="AsyncSnowflakePool only"):
        SnowflakePool(discover)  # type: ignore[arg-type] # what mypy refuses, refused at run time


@pytest.mark.zookeeper
def test_zookeeper_discovery_feeds_an_async_pool(
    zookeeper: ZooKeeper, server: InProcessServer, zk_path: str
) -> None:
    client = zookeeper.client()
    client.start(timeout=10)
    try:
        client.create(f"{zk_path}/nodes/0/3", address(server).encode(), makepath=True)
    finally:
        client.stop()
        client.close()

    async def test() -> None:
        with ZooKeeperDiscovery(zookeeper.hosts, zk_path, timeout=5) as found:
            async with AsyncSnowflakePool(found) as pool:
                assert await pool.next_id() > 0
                assert pool.servers == [address(server)]

    run(test)


# -- TLS --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Pki]]:
    # A process of its own: the in-process server leaks the socket of a refused handshake.
    pki = Pki(tmp_path_factory.mktemp("pki"))
    server = start_server("--worker-id", "6", "--tls-cert", str(pki.server))
    yield server, pki
    assert server.stop() == 0, server.log()


def test_tls_with_a_context_that_trusts_the_servers_ca(
    tls_server: tuple[ServerProcess, Pki], silent: str
) -> None:
    server, pki = tls_server

    async def test() -> None:
        trusted = client_context(str(pki.ca))
        async with AsyncSnowflakePool(address(server), ssl_context=trusted) as pool:
            assert decompose(await pool.next_id()).worker_id == 6
            assert len(await pool.next_ids(5)) == 5
        untrusted = client_context()  # the system's CAs only
        async with AsyncSnowflakePool(address(server), attempts=1, ssl_context=untrusted) as p:
            with pytest.raises(NoServerAvailableError) as info:
                await p.next_id()
        ((_, error),) = info.value.failures
        assert isinstance(error, ConnectionFailedError) and not error.connected
        assert "CERTIFICATE_VERIFY_FAILED" in str(error)
        async with AsyncSnowflakePool(address(server), timeout=2, attempts=1) as plain:
            with pytest.raises(NoServerAvailableError):
                await plain.next_id()
        # A handshake that never ends times out as the connect does.
        async with AsyncSnowflakePool(
            silent, timeout=5, connect_timeout=0.2, attempts=1, ssl_context=trusted
        ) as pool:
            with pytest.raises(NoServerAnsweredError) as answered:
                await pool.next_id()
        ((_, error),) = answered.value.failures
        assert isinstance(error, CallTimedOutError) and not error.connected

    run(test)


# -- arguments and life cycle -----------------------------------------------------------------


def test_leaving_async_with_closes_every_connection(server: InProcessServer) -> None:
    async def test() -> AsyncSnowflakePool:
        async with AsyncSnowflakePool(address(server), prefetch=10) as pool:
            await asyncio.gather(*(pool.next_ids(2) for _ in range(3)))
            assert (
                await pool.next_id() > 0 and await off_loop(lambda: open_connections(server)) == 3
            )
        assert "idle=0" in repr(pool)
        with pytest.raises(RuntimeError, match="closed"):
            await pool.next_ids(2)
        with pytest.raises(RuntimeError, match="closed"):
            await pool.next_id()  # the prefetched ids were dropped too
        await pool.aclose()  # closing twice is harmless
        return pool

    run(test)
    wait_until(lambda: open_connections(server) == 0, "the server to see every connection close")


def test_a_pool_serves_the_event_loop_it_was_first_used_on(server: InProcessServer) -> None:
    pool = AsyncSnowflakePool(address(server))  # made outside any loop, its locks too

    async def use() -> list[int]:
        return await asyncio.gather(*(pool.next_id() for _ in range(3)))

    async def use_and_close() -> list[int]:
        try:
            return await use()
        finally:
            await pool.close()

    assert len(set(run(use_and_close))) == 3
    with pytest.raises(RuntimeError, match="another event loop"):
        run(use)


def test_servers_lists_the_servers_known_now_without_asking() -> None:
    async def coroutine_discovery() -> list[str]:
        return ["h:1"]

    pools = [
        AsyncSnowflakePool(coroutine_discovery),
        AsyncSnowflakePool(lambda: ["h:1"]),
        AsyncSnowflakePool("h:1"),
        AsyncSnowflakePool([("h", 1), "h:2", ("h", 1)]),
    ]
    assert [p.servers for p in pools] == [[], [], ["h:1"], ["h:1", "h:2"]]
    assert repr(pools[0]) == "<AsyncSnowflakePool (discovered) framed idle=0>"


def test_threaded_users_do_not_import_asyncio() -> None:
    check = (
        "import sys, snowflake_thrift_client as c; assert 'asyncio' not in sys.modules; "
        "assert c.AsyncSnowflakePool.__name__ == 'AsyncSnowflakePool'; "
        "assert 'asyncio' in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
