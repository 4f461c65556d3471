"""The Python client: SnowflakeClient (one connection) and SnowflakePool (threads, failover,
prefetch), against real server processes and, for misbehaving servers, in-process fakes."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trustme
from snowflake_thrift_client import (
    CallFailedError,
    ClockMovedBackwardsError,
    InvalidCountError,
    InvalidUserAgentError,
    NoServerAvailableError,
    RequestError,
    SnowflakeClient,
    SnowflakeError,
    SnowflakePool,
    UnavailableError,
    decompose,
    parse_server,
)
from snowflake_thrift_client._idl import snowflake_thrift
from snowflake_thrift_client._transports import (
    Transport,
    binary_protocol,
    client_socket,
    server_socket,
)
from thriftpy2.thrift import TClient, TProcessor

from tests.support import FakeTime, ServerProcess, parse_metrics, start_server
from tests.support.endpoints import Endpoints
from tests.support.inprocess import InProcessServer

thrift = snowflake_thrift()


@contextmanager
def servers(*worker_ids: int, args: tuple[str, ...] = (), **kwargs: Any) -> Iterator[list[Any]]:
    """Real server processes, one per worker id; all stopped (and checked) at the end."""
    started: list[ServerProcess] = []
    try:
        for worker in worker_ids:
            started.append(start_server("--worker-id", str(worker), *args, **kwargs))
        yield started
    finally:
        codes = [server.stop() for server in started]
    assert all(code == 0 for code in codes), [server.log() for server in started]


def address(server: Any) -> str:
    return f"{server.host}:{server.port}"


def counts(server: Endpoints) -> dict[str, float]:
    return parse_metrics(server.metrics())


def free_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class FakeServer:
    """A Thrift server in this process whose handler the test writes (to misbehave)."""

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


@pytest.fixture
def fake() -> Iterator[Callable[[object], FakeServer]]:
    made: list[FakeServer] = []

    def make(handler: object) -> FakeServer:
        made.append(FakeServer(handler))
        return made[-1]

    yield make
    for server in made:
        server.close()


# -- SnowflakeClient: one connection ------------------------------------------------------


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_every_call_over_each_transport(transport: Transport) -> None:
    with (
        servers(5, args=("--datacenter-id", "2"), transport=transport) as (server,),
        SnowflakeClient(server.host, server.port, transport=transport, agent="t-1") as client,
    ):
        first = client.next_id()
        assert (decompose(first).worker_id, decompose(first).datacenter_id) == (5, 2)
        batch = client.next_ids(4096)
        assert len(batch) == 4096 and batch == sorted(set(batch)) and batch[0] > first
        layout, datacenter_id, worker_id = client.layout()
        assert (datacenter_id, worker_id) == (2, 5)
        assert layout.decompose(batch[-1]).worker_id == 5
        assert (client.worker_id(), client.datacenter_id()) == (5, 2)
        assert abs(client.timestamp() - time.time() * 1000) < 10_000
        assert client.is_open
        assert counts(server)["snowflake_connections_accepted_total"] == 1
    assert not client.is_open


def test_declared_errors_are_typed_and_keep_the_connection(server: InProcessServer) -> None:
    with SnowflakeClient(server.host, server.port) as client:
        first = client.next_id()
        with pytest.raises(InvalidUserAgentError, match="letter followed by letters") as info:
            client.next_id("1bad")
        assert isinstance(info.value, RequestError) and isinstance(info.value, SnowflakeError)
        with pytest.raises(InvalidCountError, match=r"1\.\.4096"):
            client.next_ids(0)
        with pytest.raises(InvalidCountError):
            client.next_ids(4097)
        assert client.is_open
        assert client.next_id() > first
    assert counts(server)["snowflake_connections_accepted_total"] == 1


def test_a_timed_out_connection_is_discarded_so_a_late_reply_is_never_read(
    fake: Callable[[object], FakeServer],
) -> None:
    class SlowFirstReply:
        calls = 0

        def get_id(self, useragent: str) -> int:
            self.calls += 1
            if self.calls == 1:
                time.sleep(0.6)  # the thing under test is a reply that comes too late
                return 111
            return 100 + self.calls

    # The pitfall, shown with a bare thriftpy2 client: after a timeout, the next
    # call on the same connection reads the previous call's late reply.
    server = fake(SlowFirstReply())
    protocol = binary_protocol(client_socket(server.host, server.port, 0.2), "framed")
    protocol.trans.open()
    bare = TClient(thrift.Snowflake, protocol)
    with pytest.raises(TimeoutError):
        bare.get_id("late")
    time.sleep(0.6)
    assert bare.get_id("late") == 111, "the fake server reproduces the pitfall"
    bare.close()

    server = fake(SlowFirstReply())
    with SnowflakeClient(server.host, server.port, timeout=0.2) as client:
        started = time.monotonic()
        with pytest.raises(CallFailedError, match="timed out") as info:
            client.next_id()
        assert time.monotonic() - started < 0.5
        assert info.value.timed_out and info.value.connected
        assert not client.is_open, "the connection is discarded"
        time.sleep(0.6)
        assert client.next_id() == 102, "a new connection, and the answer to this call"
    assert server.accepted == 2


def test_unreachable_and_mismatched_servers_are_call_failed_errors(server: InProcessServer) -> None:
    port = free_port()
    with pytest.raises(CallFailedError, match=f"127.0.0.1:{port}: cannot connect") as info:
        SnowflakeClient("127.0.0.1", port).next_id()
    assert not info.value.connected and not info.value.timed_out
    buffered = SnowflakeClient(server.host, server.port, transport="buffered", timeout=2)
    with pytest.raises(CallFailedError) as info:  # a closed connection, or bytes it cannot read
        buffered.next_id()
    assert info.value.connected and not buffered.is_open


# -- SnowflakePool: failover ----------------------------------------------------------------


def test_pool_fails_over_past_dead_and_silent_servers() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent, servers(4) as (good,):
        # `silent` accepts connections (the kernel does) but never answers.
        pool = SnowflakePool(
            [f"127.0.0.1:{free_port()}", silent.getsockname(), address(good)], timeout=0.3
        )
        with pool:
            started = time.monotonic()
            ids = [pool.next_id() for _ in range(20)]
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


def test_callers_errors_are_raised_at_once_not_retried() -> None:
    with servers(1, 2) as (one, two), SnowflakePool([address(one), address(two)]) as pool:
        with pytest.raises(InvalidUserAgentError):
            pool.next_id("not valid")
        with pytest.raises(InvalidCountError):
            pool.next_ids(5000)
        refused = [
            counts(s)[f'snowflake_exceptions_total{{kind="{kind}"}}']
            for s in (one, two)
            for kind in ("invalid_user_agent", "invalid_count")
        ]
        assert sum(refused) == 2, "each error came from one server only"
        assert pool.next_id() > 0


def test_a_server_whose_clock_went_back_fails_over_to_one_with_a_good_clock(
    tmp_path: Path,
) -> None:
    clock = FakeTime(tmp_path)
    with servers(1, env=clock.env) as (behind,), servers(2) as (good,):
        single = SnowflakeClient(behind.host, behind.port)
        assert decompose(single.next_id()).worker_id == 1
        clock.set("-60")
        with pytest.raises(ClockMovedBackwardsError, match="Clock moved backwards") as info:
            single.next_id()
        assert info.value.behind_ms >= 59_000
        assert single.is_open, "a declared error keeps the connection"

        with SnowflakePool([address(behind), address(good)]) as pool:
            ids = [pool.next_id() for _ in range(10)] + pool.next_ids(10)
        assert {decompose(i).worker_id for i in ids} == {2}
        with SnowflakePool(address(behind)) as alone, pytest.raises(NoServerAvailableError) as e:
            alone.next_id()
        assert all(isinstance(err, ClockMovedBackwardsError) for _, err in e.value.failures)

        clock.set("+0")
        assert decompose(single.next_id()).worker_id == 1, "back once the clock has caught up"
        single.close()


def test_new_connections_are_spread_over_the_servers() -> None:
    with servers(1, 2) as (one, two):
        with SnowflakePool([address(one), address(two)], pool_size=0) as pool:
            assert {decompose(pool.next_id()).worker_id for _ in range(6)} == {1, 2}
        assert counts(one)["snowflake_connections_accepted_total"] == 3
        assert counts(two)["snowflake_connections_accepted_total"] == 3


def test_a_node_that_says_it_is_unavailable_is_skipped(
    fake: Callable[[object], FakeServer],
) -> None:
    class Unavailable:
        def get_id(self, useragent: str) -> int:
            raise thrift.UnavailableError(message="shutting down")

    class Fine:
        def get_id(self, useragent: str) -> int:
            return 42

    down, up = fake(Unavailable()), fake(Fine())
    with (
        SnowflakeClient(down.host, down.port) as client,
        pytest.raises(UnavailableError, match="shutting down"),
    ):
        client.next_id()
    with SnowflakePool([address(down), address(up)], pool_size=0) as pool:
        assert [pool.next_id() for _ in range(4)] == [42] * 4
    assert down.accepted == 2, "tried once by the pool, then last while it was marked failed"


def test_a_server_stopping_mid_use_fails_over_without_an_error() -> None:
    with servers(1, 2) as (one, two), SnowflakePool([address(one), address(two)]) as pool:
        in_use, other = (one, two) if decompose(pool.next_id()).worker_id == 1 else (two, one)
        assert in_use.stop() == 0
        after = [pool.next_id() for _ in range(20)]
        assert {decompose(i).worker_id for i in after} == {2 if in_use is one else 1}
        assert counts(other)["snowflake_connections_accepted_total"] == 1


def test_idle_connections_the_server_closed_are_reopened_transparently() -> None:
    with servers(1, args=("--idle-timeout", "0.3")) as (server,):
        with SnowflakePool(address(server)) as pool:
            first = pool.next_id()
            time.sleep(1.0)  # the thing under test is the server's idle timeout
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


def test_prefetched_ids_older_than_max_age_are_dropped(server: InProcessServer) -> None:
    def handed_out() -> float:
        return counts(server)['snowflake_ids_by_agent_total{agent="aged"}']

    with SnowflakePool(address(server), agent="aged", prefetch=50, prefetch_max_age=0.2) as pool:
        first = pool.next_id()
        assert pool.next_id() > first and handed_out() == 50, "the same batch"
        time.sleep(0.4)  # the thing under test is the age of the buffer
        fresh = pool.next_id()
        assert handed_out() == 100, "a new batch"
        assert decompose(fresh).timestamp_ms >= decompose(first).timestamp_ms + 300


# -- discovery ------------------------------------------------------------------------------


def test_servers_can_come_from_a_discovery_callable() -> None:
    with servers(1, 2) as (one, two):
        current = [address(one)]
        asked: list[float] = []

        def discover() -> list[str]:
            asked.append(time.monotonic())
            return list(current)

        with SnowflakePool(discover, refresh_interval=0.2) as pool:
            assert {decompose(pool.next_id()).worker_id for _ in range(5)} == {1}
            assert pool.servers == [address(one)]
            current[:] = [address(two)]
            time.sleep(0.3)  # the thing under test is the refresh interval
            assert {decompose(pool.next_id()).worker_id for _ in range(5)} == {2}
            assert pool.servers == [address(two)]
        assert 2 <= len(asked) <= 4, "asked once per refresh interval, not per call"
        deadline = time.monotonic() + 5
        while counts(one)["snowflake_connections_open"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counts(one)["snowflake_connections_open"] == 0, "its idle connection was closed"


def test_a_failing_discovery_keeps_the_last_list(server: InProcessServer) -> None:
    answers: list[Any] = [[address(server)], RuntimeError("registry down"), []]

    def discover() -> list[str]:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    with SnowflakePool(discover, refresh_interval=0.05) as pool:
        assert pool.next_id() > 0
        for _ in range(2):
            time.sleep(0.1)
            assert pool.next_id() > 0, "the error, then the empty list, keep the old list"
    with (
        SnowflakePool(lambda: [], refresh_interval=0.05) as pool,
        pytest.raises(NoServerAvailableError, match="discovery found no servers"),
    ):
        pool.next_id()


# -- arguments ------------------------------------------------------------------------------


def test_server_addresses() -> None:
    assert parse_server("10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert parse_server("id-host") == ("id-host", 7609)
    assert parse_server("[::1]:7610") == ("::1", 7610)
    assert parse_server(("localhost", 1)) == ("localhost", 1)
    for bad in ["", "a:b:c", "host:0", "host:65536", "host:x", ("host", "7609"), ("", 1)]:
        with pytest.raises(ValueError, match=r"address|port"):
            parse_server(bad)  # type: ignore[arg-type]
    pool = SnowflakePool("h:1")
    assert pool.servers == ["h:1"]
    assert SnowflakePool(("h", 2)).servers == ["h:2"]
    assert SnowflakePool(["h:1", ("h", 1), "[::1]:3"]).servers == ["h:1", "[::1]:3"]


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
        {"transport": "http"},
        {"servers": []},
    ],
)
def test_bad_pool_arguments_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"must|no servers"):
        SnowflakePool(**kwargs)


def test_a_closed_pool_refuses_calls(server: InProcessServer) -> None:
    pool = SnowflakePool(address(server), prefetch=10)
    assert pool.next_id() > 0
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.next_ids(2)


def test_tls(tmp_path: Path) -> None:

    ca = trustme.CA()
    pem = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    with servers(3, args=("--tls-cert", str(pem))) as (server,):
        with SnowflakePool(address(server), ssl_context=context) as pool:
            assert decompose(pool.next_id()).worker_id == 3 and len(pool.next_ids(5)) == 5
        untrusting = ssl.create_default_context()  # does not trust the test CA
        for refused in [untrusting, None]:  # a CA it does not trust; plain Thrift
            with (
                SnowflakePool(address(server), timeout=2, attempts=1, ssl_context=refused) as pool,
                pytest.raises(NoServerAvailableError),
            ):
                pool.next_id()


def test_a_failed_discovery_is_reported_on_every_call_until_it_recovers() -> None:
    answers: list[object] = [OSError("registry down"), OSError("registry down")]

    def discover() -> list[str]:
        answer = answers.pop(0) if answers else []
        if isinstance(answer, BaseException):
            raise answer
        return []

    pool = SnowflakePool(discover, refresh_interval=60)
    for _ in range(3):  # the second call must not fall through to an empty list
        with pytest.raises(NoServerAvailableError, match="server discovery failed"):
            pool.next_id()
    pool.close()
