"""Twitter's start-up sanity checks, against real peers: servers in this process,
registered by writing their address into a real ZooKeeper."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
from kazoo.client import KazooClient
from thriftpy2.rpc import make_server
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TFramedTransportFactory

from snowflake_server import ServerSettings, StartupRefused
from snowflake_server._cluster.peers import _no_answer, check_peers, refused_retry_s
from snowflake_server._cluster.zk import children
from snowflake_server._errors import StartupDeferred, StartupInterrupted
from snowflake_server._ids.clocks import wall_clock_ms
from tests.support.endpoints import free_port
from tests.support.inprocess import InProcessServer
from tests.support.processes import twitter_idl
from tests.support.zookeeper import ZooKeeper

pytestmark = pytest.mark.zookeeper

US = "127.0.0.1:1"  # our own advertised address: never dialled


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """A server answering as datacenter 0, worker 5."""
    settings = ServerSettings(datacenter_id=0, worker_id=5)
    with InProcessServer(settings, tmp_path_factory.mktemp("peer")) as server:
        yield server


Register = Callable[[str, str], None]


@pytest.fixture
def register(zk: KazooClient, zk_path: str) -> Register:
    """``register("0/5", "host:port")``: a registration as a node makes it."""

    def add(dc_and_worker: str, address: str) -> None:
        zk.create(f"{zk_path}/nodes/{dc_and_worker}", address.encode(), makepath=True)

    return add


def address(server: InProcessServer) -> str:
    return f"127.0.0.1:{server.port}"


class Check(Protocol):
    def __call__(
        self,
        clock: Callable[[], int] = ...,
        ours: str = ...,
        sleep: Callable[[float], object] = ...,
        stopped: Callable[[], bool] = ...,
        **overrides: object,
    ) -> set[tuple[int, int]] | None: ...


@pytest.fixture
def check(zookeeper: ZooKeeper, zk: KazooClient, zk_path: str) -> Check:
    """``check(clock=..., ours=..., **settings)``: the peer checks as worker 6 would run them."""

    def run(
        clock: Callable[[], int] = wall_clock_ms,
        ours: str = US,
        sleep: Callable[[float], object] = lambda _s: None,
        stopped: Callable[[], bool] = lambda: False,
        **overrides: object,
    ) -> set[tuple[int, int]] | None:
        settings = ServerSettings(
            zookeeper=zookeeper.hosts,
            zk_path=zk_path,
            worker_id=6,
            **overrides,  # type: ignore[arg-type]
        )
        return check_peers(zk, settings.cluster, ours, clock, sleep, stopped)

    return run


def test_no_registrations_no_peers(
    check: Check, zk: KazooClient, zk_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    assert children(zk, f"{zk_path}/nodes", "reading") == []
    assert check() == set()  # the registrations seen: none
    assert "no registered peers to check" in caplog.text


def test_children_are_in_numeric_order(zk: KazooClient, zk_path: str) -> None:
    for name in ("10", "2", "1"):
        zk.create(f"{zk_path}/{name}", makepath=True)
    assert children(zk, zk_path, "reading") == ["1", "2", "10"]


def test_a_sane_peer_passes(
    check: Check, peer: InProcessServer, register: Register, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    register("0/5", address(peer))
    register("1/3", US)  # ours (another process of this node): never dialled, but seen
    assert check() == {(0, 5), (1, 3)}
    assert re.search(r"1 peer\(s\) sane; mean clock offset [+-]\d+ ms", caplog.text)


@pytest.mark.parametrize(
    ("registered", "message"),
    [
        (["0/7"], "Worker id insanity: peer {peer} (registered as datacenter 0, worker 7) "
                  "says it is worker 5"),
        (["1/5"], "Datacenter id insanity: peer {peer} (registered as datacenter 1, worker 5) "
                  "says it is in datacenter 0"),
        # Two registrations at one address are the processes of one node; if one of
        # them never answers, the address is not what it claims.
        (["0/5", "0/7"], "Worker id insanity: peer {peer} (registered as datacenter 0, worker "
                         "5, datacenter 0, worker 7) never answered as datacenter 0, worker 7 "
                         "in 16 connections"),
    ],
    ids=["another-worker", "another-datacenter", "never-answers-as-registered"],
)  # fmt: skip
def test_a_peer_not_what_its_registration_says_is_insanity(
    check: Check, peer: InProcessServer, register: Register, registered: list[str], message: str
) -> None:
    for dc_and_worker in registered:
        register(dc_and_worker, address(peer))
    with pytest.raises(StartupRefused) as info:
        check()
    assert str(info.value) == message.format(peer=address(peer))


def test_a_peer_silent_past_the_bound_defers_start(check: Check, register: Register) -> None:
    """Exit 75, not 3: a silent peer passes by itself (it listens, or its registration
    expires); nothing was registered meanwhile."""
    dead = f"127.0.0.1:{free_port()}"
    register("0/9", dead)
    waits: list[float] = []
    with pytest.raises(StartupDeferred) as info:
        check(sleep=waits.append)
    message = str(info.value)
    assert message.startswith(f"peer {dead} (registered as datacenter 0, worker 9) is unreachable")
    # As long as a node may take to listen after registering (its start-up waits:
    # in cluster mode the first-start wait is 10 + 10 s, the start-up wait 10 s).
    assert "it stayed registered and silent for the 35 s the peer checks wait" in message
    assert "--skip-sanity-checks" in message
    assert "(connection refused)" in message
    # The waits between tries make up the bound, less what the failed tries took.
    assert 30 < sum(waits) < 35.01


@pytest.mark.parametrize(
    "data", ["no-port-here", "10.0.0.9:http", "10.0.0.9:0", "10.0.0.9:70000", ":7609", "10.0.0.9:"]
)
def test_a_registration_that_is_not_host_port_defers_at_once(
    check: Check, register: Register, zk_path: str, data: str
) -> None:
    """Not asked for 35 s as a silent peer; and exit 75, not 3: the registration is
    ephemeral and goes with its session, so a later start may pass by itself."""
    register("0/9", data)
    waits: list[float] = []
    with pytest.raises(StartupDeferred) as info:
        check(sleep=waits.append)
    assert str(info.value) == (
        f"the registration {zk_path}/nodes/0/9 holds {data!r}, not a node's host:port: a "
        "registration that cannot be read cannot be checked; remove it by hand (a node "
        "registers as its --advertise-host:--advertise-port)"
    )
    assert waits == [], "deferred at once"


@pytest.mark.parametrize("name", ["0/x9", "dc/9"])
def test_a_registration_whose_name_is_not_a_number_refuses(
    check: Check, register: Register, zk_path: str, name: str
) -> None:
    register(name, "10.0.0.9:7609")
    bad = name.split("/")[0] if name.startswith("dc") else name
    with pytest.raises(StartupRefused) as info:
        check()
    assert str(info.value) == (
        f"{zk_path}/nodes/{bad} is not a node's registration (its name is not a number): "
        "registrations that cannot be read cannot be checked; remove it by hand"
    )


def test_a_peer_that_does_not_speak_thrift_is_said_so_in_words(
    check: Check, register: Register
) -> None:
    """It said "ProtocolError: No protocol version header"."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def answer_garbage() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(1024)
                    conn.sendall(b"\x00\x00\x00\x08garbage!")

        threading.Thread(target=answer_garbage, daemon=True).start()
        register("0/9", f"127.0.0.1:{listener.getsockname()[1]}")
        with pytest.raises(StartupDeferred) as info:
            check(first_start_wait=0.0, max_startup_wait=0.0, zk_connect_timeout=1.0)
        listener.shutdown(socket.SHUT_RDWR)
    assert "is unreachable: it answered with something that is not the Snowflake protocol;" in (
        str(info.value)
    )


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (TApplicationException(TApplicationException.INTERNAL_ERROR, "boom"),
         "it answered with an error: boom"),
        (TApplicationException(TApplicationException.INTERNAL_ERROR),
         "it answered with an error: no message"),
        (TimeoutError(), "it did not answer in time"),
        (ConnectionResetError(), "it hung up"),
        (OSError(113, "No route to host"), "no route to host"),
        (EOFError(), "it answered with something that is not the Snowflake protocol"),
        (RuntimeError("odd"), "no answer (RuntimeError: odd)"),
        (RuntimeError(), "no answer (RuntimeError)"),
    ],
)  # fmt: skip
def test_why_a_peer_gave_no_answer_is_said_in_words(error: Exception, said: str) -> None:
    assert _no_answer(error) == said


def test_the_bound_is_one_for_all_peers(check: Check, register: Register) -> None:
    """Two silent peers wait side by side: the check ends after one bound, not two."""
    register("0/8", f"127.0.0.1:{free_port()}")
    register("0/9", f"127.0.0.1:{free_port()}")
    waits: list[float] = []
    with pytest.raises(StartupDeferred, match="worker 8"):
        check(sleep=waits.append, first_start_wait=0.0, max_startup_wait=1.0)
    assert 5 < sum(waits) < 6.01, "--first-start-wait 0 + --max-startup-wait 1 + 5 s"


@pytest.mark.parametrize("then", ["deleted", "taken-by-another-address"])
def test_a_silent_peer_whose_registration_goes_is_skipped(
    check: Check,
    register: Register,
    zk: KazooClient,
    zk_path: str,
    peer: InProcessServer,
    caplog: pytest.LogCaptureFixture,
    then: str,
) -> None:
    """Issue 22, item 2: a node killed -9 leaves its registration until its session
    expires; the check dialled its address for 35 s although it expired after 6 s,
    then refused to start (exit 3, which systemd does not restart)."""
    caplog.set_level("INFO")
    dead = f"127.0.0.1:{free_port()}"
    register("0/5", address(peer))  # a live peer, still checked
    register("0/9", dead)
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:  # its session expires meanwhile
            path = f"{zk_path}/nodes/0/9"
            zk.delete(path)
            if then == "taken-by-another-address":
                zk.create(path, b"127.0.0.1:2")  # a node that registered since: not dialled

    check(sleep=sleep)
    assert (
        f"peer {dead} (registered as datacenter 0, worker 9) does not answer (Could not "
        "connect to" in caplog.text
    )
    assert "is not registered any more: not a peer (a node gone, its session expired); " in (
        caplog.text
    )
    assert "1 peer(s) sane" in caplog.text
    # Read again every 10 tries: the first read after the registration went ends the wait.
    assert len(waits) == 10


def test_a_peer_of_several_registrations_is_waited_for_while_one_remains(
    check: Check, register: Register, zk: KazooClient, zk_path: str
) -> None:
    """A node run with --processes registers several ids at one address: the ones
    gone are dropped from what it must answer as, the rest still count."""
    dead = f"127.0.0.1:{free_port()}"
    register("0/8", dead)
    register("0/9", dead)
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 1:
            zk.delete(f"{zk_path}/nodes/0/8")

    with pytest.raises(StartupDeferred) as info:
        check(sleep=sleep, first_start_wait=0.0, max_startup_wait=1.0)
    assert str(info.value).startswith(
        f"peer {dead} (registered as datacenter 0, worker 9) is unreachable"
    )


def test_a_stop_ends_the_waits_for_a_silent_peer(check: Check, register: Register) -> None:
    """Issue 22, item 3: a SIGTERM during the checks waited through every retry."""
    register("0/9", f"127.0.0.1:{free_port()}")
    waits: list[float] = []
    with pytest.raises(StartupInterrupted, match="stopping while the peer checks waited"):
        check(sleep=waits.append, stopped=lambda: len(waits) >= 2)
    assert len(waits) == 2, "not one try more after the stop"


def test_a_peer_that_registered_but_listens_only_now_is_asked_again(
    check: Check, register: Register, tmp_path: Path
) -> None:
    # A node registers, then listens: a check in between meets a refused connection.
    port = free_port()
    register("0/9", f"127.0.0.1:{port}")
    late = InProcessServer(ServerSettings(worker_id=9), tmp_path, port=port)
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            late.start()

    try:
        check(sleep=sleep)
    finally:
        late.stop()
    assert len(waits) == 3


def test_a_refusing_peer_is_asked_for_as_long_as_a_start_may_take() -> None:
    cluster = ServerSettings(first_start_wait=5, max_startup_wait=10).cluster
    assert refused_retry_s(cluster) == 20
    unbounded = ServerSettings(first_start_wait=0, max_startup_wait=float("inf")).cluster
    assert refused_retry_s(unbounded) == 65


@pytest.mark.parametrize(
    ("offset_ms", "words"), [(-30_000, "behind"), (30_000, "ahead of")], ids=["behind", "ahead"]
)
def test_a_clock_far_from_the_peers_refuses_start(
    check: Check, peer: InProcessServer, register: Register, offset_ms: int, words: str
) -> None:
    register("0/5", address(peer))

    def our_clock() -> int:
        return wall_clock_ms() + offset_ms

    with pytest.raises(StartupDeferred) as info:  # exit 75: passes once the clocks are fixed
        check(clock=our_clock)
    message = str(info.value)
    found = re.match(rf"our clock is (\d+) ms {words} the mean of 1 peers' clocks", message)
    assert found, message
    # 30 s off, give or take the ms the peer's answer took to arrive.
    assert 29_000 < int(found[1]) < 31_000
    assert "more than --max-peer-skew 10 s" in message and address(peer) in message
    # Within a wider allowance the same offset passes.
    check(clock=our_clock, max_peer_skew=40.0)


def test_skip_sanity_checks_asks_nobody(
    check: Check, register: Register, caplog: pytest.LogCaptureFixture
) -> None:
    register("0/9", f"127.0.0.1:{free_port()}")  # would be unreachable
    check(skip_sanity_checks=True)
    assert "--skip-sanity-checks: not asking registered peers" in caplog.text


def test_our_own_address_is_not_asked(
    check: Check, register: Register, caplog: pytest.LogCaptureFixture
) -> None:
    """Sibling processes of ours (--processes) share our address, and our socket does
    not answer before we register."""
    caplog.set_level("INFO")
    ours = f"127.0.0.1:{free_port()}"
    register("0/3", ours)
    register("0/4", ours)
    check(ours=ours)
    assert "no registered peers to check" in caplog.text


def test_peers_with_skew_within_the_allowance_pass(
    check: Check, peer: InProcessServer, register: Register, tmp_path: Path
) -> None:
    """Two peers, one a little ahead of us (its own injected clock): the mean counts."""
    register("0/5", address(peer))
    ahead = ServerSettings(datacenter_id=0, worker_id=8)
    with InProcessServer(ahead, tmp_path, clock=lambda: wall_clock_ms() + 4000) as second:
        register("0/8", address(second))
        check()  # mean offset about 2 s: within 10 s
        with pytest.raises(StartupDeferred, match="ms behind the mean of 2 peers' clocks"):
            check(max_peer_skew=1.0)


# -- the layout -------------------------------------------------------------------------


def test_a_peer_of_another_layout_is_layout_insanity(
    check: Check, register: Register, tmp_path: Path
) -> None:
    """Issue 16, item 3: the checks compared ids and clocks, never the layout."""
    narrow = ServerSettings(datacenter_id=0, worker_id=5, worker_id_bits=4, sequence_bits=13)
    with InProcessServer(narrow, tmp_path) as other:
        register("0/5", address(other))
        with pytest.raises(StartupRefused) as info:
            check()
        check(worker_id_bits=4, sequence_bits=13)  # the peer's layout passes
    assert str(info.value) == (
        f"Layout insanity: peer {address(other)} (registered as datacenter 0, worker 5) makes "
        "ids with epoch 1288834974657 ms, bits 41/5/4/13 (timestamp/datacenter/worker/"
        "sequence), this node would make them with epoch 1288834974657 ms, bits 41/5/5/12 "
        "(timestamp/datacenter/worker/sequence); two layouts in one cluster hand out the same "
        "ids: start with the cluster's --epoch and --*-bits"
    )


class TwitterPeer:
    """Twitter's original server, as far as the checks see it: no ``get_layout``."""

    def get_worker_id(self) -> int:
        return 5

    def get_datacenter_id(self) -> int:
        return 0

    def get_timestamp(self) -> int:
        return wall_clock_ms()

    def get_id(self, useragent: str) -> int:
        raise NotImplementedError


@pytest.fixture
def twitter_peer() -> Iterator[str]:
    port = free_port()
    server: Any = make_server(
        twitter_idl().Snowflake, TwitterPeer(), "127.0.0.1", port,
        trans_factory=TFramedTransportFactory(),
    )  # fmt: skip
    server.trans.listen()  # before the thread: the checks may dial at once
    server.trans.listen = lambda: None
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{port}"
    server.close()
    socket.create_connection(("127.0.0.1", port)).close()  # wakes its accept()
    thread.join(5)
    server.trans.close()


def test_a_peer_without_get_layout_is_not_checked_for_it(
    check: Check, register: Register, twitter_peer: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    register("0/5", twitter_peer)
    check()
    assert (
        f"peer {twitter_peer} (registered as datacenter 0, worker 5) has no get_layout "
        "(Twitter's server?): its layout is not checked; the layout recorded in ZooKeeper "
        "still is" in caplog.text
    )
    assert "1 peer(s) sane" in caplog.text
