"""A worker id's high-water mark in a real ZooKeeper: loaded once, then written
only by compare-and-set from the session that registered the id."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
from kazoo.client import KazooClient, KazooState
from kazoo.protocol.connection import _SESSION_EXPIRED

from snowflake_server import Layout, ReservationError, StartupRefused
from snowflake_server._cluster.zkmarks import MarkOfAnotherLayout, ZkMarkStore, restore_marks
from snowflake_server._errors import StartupDeferred
from snowflake_server._ids.layouts import layout_to_json
from tests.support.zookeeper import ZooKeeper

pytestmark = pytest.mark.zookeeper

T0 = 1_700_000_000_000  # whole seconds


@pytest.fixture
def other(zk_sessions: Callable[[], KazooClient]) -> KazooClient:
    """Another node's session (``zk`` is the one that registered the worker id)."""
    return zk_sessions()


@pytest.fixture
def path(request: pytest.FixtureRequest) -> str:
    """A mark of its own for each test."""
    return f"/zkmarks-{re.sub(r'[^A-Za-z0-9_-]', '-', request.node.name)}/marks/0/3"


class Lost:
    """Records ``on_lost`` calls."""

    def __init__(self) -> None:
        self.why: list[str] = []

    def __call__(self, why: str) -> None:
        self.why.append(why)


def load(zk: Any, path: str, lost: Callable[[str], None]) -> ZkMarkStore:
    return ZkMarkStore.load(lambda: zk, path, lost)


def stored(client: KazooClient, path: str) -> tuple[int, int]:
    """The mark in ``path`` and the znode's version (a plain number: another writer's)."""
    data, stat = client.get(path)
    value = json.loads(data.decode())
    return int(value if isinstance(value, int) else value["mark_ms"]), stat.version


def test_no_znode_is_no_mark(zk: KazooClient, path: str) -> None:
    store = load(zk, path, Lost())
    assert store.mark_ms == -1
    assert store.where == f"zookeeper:{path}"
    assert store.name == "zookeeper"
    assert zk.exists(path) is None, "loading writes nothing"


def test_a_stored_mark_is_loaded_and_written_over_by_version(
    zk: KazooClient, other: KazooClient, path: str
) -> None:
    other.create(path, str(T0 + 5000).encode(), makepath=True)
    other.set(path, str(T0 + 7000).encode())  # version 1
    store = load(zk, path, Lost())
    assert store.mark_ms == T0 + 7000
    assert store.advance(T0 + 7001) == T0 + 8000
    assert stored(other, path) == (T0 + 8000, 2)


@pytest.mark.parametrize("data", [b"soon", b"", b"\xff\xfe"], ids=["text", "empty", "binary"])
def test_a_mark_that_is_not_a_number_refuses_start(
    zk: KazooClient, other: KazooClient, path: str, data: bytes
) -> None:
    other.create(path, data, makepath=True)
    with pytest.raises(StartupRefused, match=r"is not a number .* repair it by hand") as info:
        load(zk, path, Lost())
    assert path in str(info.value)


def test_marks_are_rounded_up_to_whole_seconds(zk: KazooClient, path: str) -> None:
    store = load(zk, path, Lost())
    assert store.advance(T0 + 1) == T0 + 1000, "the first write creates the znode and parents"
    assert stored(zk, path) == (T0 + 1000, 0)
    assert store.advance(T0 + 999) == T0 + 1000
    assert store.advance(T0 + 1000) == T0 + 1000
    assert store.writes == 1, "within the reserved second: no write"
    assert store.advance(T0 + 1001) == T0 + 2000
    assert stored(zk, path) == (T0 + 2000, 1)
    assert store.advance(T0 + 500) == T0 + 2000, "never lowered by advance"
    assert (store.writes, store.write_errors) == (2, 0)


def test_a_mark_changed_by_another_writer_is_not_overwritten(
    zk: KazooClient, other: KazooClient, path: str
) -> None:
    lost = Lost()
    store = load(zk, path, lost)
    store.advance(T0)
    other.set(path, str(T0 + 60_000).encode())  # the id's new holder moved it
    with pytest.raises(ReservationError, match="changed by another node: this node no longer"):
        store.advance(T0 + 1500)
    assert lost.why == [f"{path} was changed by another node"]
    assert stored(other, path)[0] == T0 + 60_000, "the new holder's mark stands"
    assert (store.mark_ms, store.writes, store.write_errors) == (T0, 1, 1)


def test_a_mark_created_by_another_writer_meanwhile_is_not_overwritten(
    zk: KazooClient, other: KazooClient, path: str
) -> None:
    lost = Lost()
    store = load(zk, path, lost)  # none yet
    other.create(path, str(T0 + 60_000).encode(), makepath=True)
    with pytest.raises(ReservationError):
        store.advance(T0)
    assert lost.why == [f"{path} was changed by another node"]
    assert stored(other, path)[0] == T0 + 60_000


def test_a_disconnected_client_is_not_told_its_session_is_gone(
    zk: KazooClient, zookeeper: ZooKeeper, path: str
) -> None:
    """kazoo has no client_id while disconnected: that is not a lost session, and the
    message says which it is."""
    lost = Lost()
    disconnected = zookeeper.client()  # never started: no session, as while reconnecting
    store = ZkMarkStore(lambda: disconnected, path, -1, None, zk.client_id[0], lost)
    with pytest.raises(ReservationError, match="disconnected from ZooKeeper") as info:
        store.advance(T0)
    assert "may still be alive" in str(info.value) and "is gone" not in str(info.value)
    assert lost.why == []


def test_no_write_once_the_registering_session_has_expired(zk: KazooClient, path: str) -> None:
    lost = Lost()
    store = load(zk, path, lost)
    store.advance(T0)
    states: list[str] = []
    reconnected = threading.Event()

    def listen(state: str) -> bool:
        states.append(state)
        if KazooState.LOST in states and state == KazooState.CONNECTED:
            reconnected.set()
            return True
        return False

    zk.add_listener(listen)
    zk._call(_SESSION_EXPIRED, None)  # as kazoo's own test harness expires a session
    assert reconnected.wait(10), f"a new session after LOST, saw {states}"
    with pytest.raises(
        ReservationError, match=r"session that registered this worker id \(0x[0-9a-f]+\) is gone"
    ):
        store.advance(T0 + 5000)
    assert lost.why == [], "not another writer: the session is simply not ours any more"
    assert stored(zk, path)[0] == T0, "untouched"
    assert store.write_errors == 1


def test_no_write_without_a_client(zk: KazooClient, path: str) -> None:
    """Cluster mode may drop a stuck client before it has a new one."""
    current: list[Any] = [zk]
    store = ZkMarkStore.load(lambda: current[0], path, Lost())
    current[0] = None
    with pytest.raises(ReservationError, match="no ZooKeeper client"):
        store.finish(T0)
    assert zk.exists(path) is None


def test_finish_writes_the_exact_mark_even_lower(zk: KazooClient, path: str) -> None:
    store = load(zk, path, Lost())
    store.advance(T0 + 1)
    store.finish(T0 + 7)
    assert stored(zk, path) == (T0 + 7, 1)
    assert store.mark_ms == T0 + 7


# -- the layout a mark was made under -------------------------------------------------

NARROW = Layout(worker_id_bits=4, sequence_bits=13)


def test_a_mark_is_written_with_its_layout(zk: KazooClient, path: str) -> None:
    store = ZkMarkStore.load(lambda: zk, path, Lost(), NARROW)
    store.advance(T0 + 1)
    assert json.loads(zk.get(path)[0]) == {
        "mark_ms": T0 + 1000,
        "layout": {"epoch_ms": NARROW.epoch_ms, "timestamp_bits": 41, "datacenter_id_bits": 5,
                   "worker_id_bits": 4, "sequence_bits": 13},
    }  # fmt: skip
    assert ZkMarkStore.load(lambda: zk, path, Lost(), NARROW).mark_ms == T0 + 1000


def test_a_plain_number_is_a_mark_of_the_layout_in_use(
    zk: KazooClient, other: KazooClient, path: str
) -> None:
    """0.1.0 wrote plain numbers: an upgrade reads them whatever the layout."""
    other.create(path, str(T0).encode(), makepath=True)
    assert ZkMarkStore.load(lambda: zk, path, Lost(), NARROW).mark_ms == T0


def test_a_mark_of_another_layout_refuses(zk: KazooClient, path: str) -> None:
    ZkMarkStore.load(lambda: zk, path, Lost(), NARROW).advance(T0)
    with pytest.raises(MarkOfAnotherLayout) as info:
        load(zk, path, Lost())
    assert str(info.value).startswith(
        f"the high-water mark {path} was recorded under another layout (epoch 1288834974657 "
        "ms, bits 41/5/4/13 (timestamp/datacenter/worker/sequence)) than ours (epoch "
        "1288834974657 ms, bits 41/5/5/12 (timestamp/datacenter/worker/sequence))"
    )
    assert isinstance(info.value, StartupRefused)


CLOCKED = Layout(datacenter_id_bits=3, clock_sequence_bits=2)


def test_a_clock_sequence_keeps_a_mark_per_value(zk: KazooClient, path: str) -> None:
    store = ZkMarkStore.load(lambda: zk, path, Lost(), CLOCKED)
    assert (store.marks, store.clock_sequence) == ((-1, -1, -1, -1), 0)
    store.advance(T0 + 1)
    store.advance(T0 - 60_000, clock_sequence=1, switching=True)
    assert json.loads(zk.get(path)[0]) == {
        "mark_ms": T0 + 1000,
        "marks_ms": [T0 + 1000, T0 - 60_000, -1, -1],
        "clock_sequence": 1,
        "layout": {"epoch_ms": CLOCKED.epoch_ms, "timestamp_bits": 41, "datacenter_id_bits": 3,
                   "worker_id_bits": 5, "sequence_bits": 12, "clock_sequence_bits": 2},
    }  # fmt: skip
    again = ZkMarkStore.load(lambda: zk, path, Lost(), CLOCKED)
    assert (again.marks, again.clock_sequence, again.mark_ms) == (
        (T0 + 1000, T0 - 60_000, -1, -1), 1, T0 - 60_000
    )  # fmt: skip
    with pytest.raises(MarkOfAnotherLayout, match=r"bits 41/2/3/5/12 \(timestamp/clock sequence/"):
        load(zk, path, Lost())


@pytest.mark.parametrize(
    "data",
    [b'"marks_ms": [5, -1, -1, -1], "clock_sequence": 4',
     b'"marks_ms": [4, -1, -1, -1], "clock_sequence": 0',
     b'"marks_ms": [5, -1], "clock_sequence": 0'],
    ids=["value-out-of-range", "newest-not-mark", "too-few-values"],
)  # fmt: skip
def test_bad_clock_sequence_marks_refuse(
    zk: KazooClient, other: KazooClient, path: str, data: bytes
) -> None:
    layout = json.dumps({"epoch_ms": CLOCKED.epoch_ms, "timestamp_bits": 41,
                         "datacenter_id_bits": 3, "worker_id_bits": 5, "sequence_bits": 12,
                         "clock_sequence_bits": 2}).encode()  # fmt: skip
    other.create(path, b'{"mark_ms": 5, "layout": ' + layout + b", " + data + b"}", makepath=True)
    with pytest.raises(StartupRefused, match="repair it by hand"):
        ZkMarkStore.load(lambda: zk, path, Lost(), CLOCKED)


@pytest.mark.parametrize(
    "data",
    [b'{"mark_ms": 1}', b'{"mark_ms": "1", "layout": {}}', b"[1]",
     b'{"mark_ms": 1, "layout": {"epoch_ms": 0}}'],
    ids=["no-layout", "mark-not-a-number", "a-list", "half-a-layout"],
)  # fmt: skip
def test_a_mark_of_no_known_shape_refuses(
    zk: KazooClient, other: KazooClient, path: str, data: bytes
) -> None:
    other.create(path, data, makepath=True)
    with pytest.raises(StartupRefused, match="repair it by hand"):
        load(zk, path, Lost())


# -- ZooKeeper calls that end in time ---------------------------------------------------


def test_load_while_disconnected_is_a_refusal(zookeeper: ZooKeeper, path: str) -> None:
    """kazoo has no session id while disconnected (it was a TypeError, exit 1)."""
    never_started = zookeeper.client()
    with pytest.raises(StartupDeferred, match="connection dropped while loading the high-water"):
        load(never_started, path, Lost())
    never_started.close()


# -- putting marks back after ZooKeeper lost them -----------------------------------


def record(path: str, client: KazooClient) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(client.get(path)[0].decode())
    return value


def test_restore_creates_a_mark_zookeeper_lost(zk: KazooClient, path: str) -> None:
    assert restore_marks(zk, path, (T0 + 5000,), 0, Layout())
    assert record(path, zk) == {"mark_ms": T0 + 5000, "layout": layout_to_json(Layout())}
    assert not restore_marks(zk, path, (T0 + 5000,), 0, Layout()), "nothing left to do"


def test_restore_never_lowers_a_mark_and_raises_a_lower_one(zk: KazooClient, path: str) -> None:
    zk.create(path, str(T0 + 9000).encode(), makepath=True)
    assert not restore_marks(zk, path, (T0 + 5000,), 0, Layout())
    assert stored(zk, path) == (T0 + 9000, 0)
    assert restore_marks(zk, path, (T0 + 12000,), 0, Layout())
    assert stored(zk, path) == (T0 + 12000, 1)


def test_restore_merges_marks_per_clock_sequence_value_keeping_the_value_in_use(
    zk: KazooClient, path: str
) -> None:
    layout = Layout(timestamp_bits=40, clock_sequence_bits=1)
    store = ZkMarkStore.load(lambda: zk, path, Lost(), layout)
    store.advance(T0 + 3000, 1, switching=True)  # the holder now uses value 1
    assert restore_marks(zk, path, (T0 + 8000, T0 + 1000), 0, layout)
    found = record(path, zk)
    assert found["marks_ms"] == [T0 + 8000, T0 + 3000] and found["clock_sequence"] == 1
    with pytest.raises(ReservationError, match="was changed by another node"):
        store.advance(T0 + 6000, 1)  # the holder's next write is refused: it stops


def test_restore_leaves_a_mark_of_another_layout_alone(zk: KazooClient, path: str) -> None:
    other = json.dumps({"mark_ms": T0, "layout": layout_to_json(Layout(epoch_ms=0))})
    zk.create(path, other.encode(), makepath=True)
    assert not restore_marks(zk, path, (T0 + 5000,), 0, Layout())
    assert record(path, zk)["mark_ms"] == T0


def test_restore_of_no_mark_writes_nothing(zk: KazooClient, path: str) -> None:
    assert not restore_marks(zk, path, (-1,), 0, Layout())
    assert zk.exists(path) is None


def test_restore_merges_with_a_mark_created_meanwhile(zk: KazooClient, path: str) -> None:
    class RacingClient:
        """Another node creates the mark between our read and our create."""

        def __init__(self) -> None:
            self.raced = False

        def __getattr__(self, name: str) -> Any:
            if name == "create_async" and not self.raced:
                self.raced = True
                zk.create(path, str(T0 + 1000).encode(), makepath=True)
            return getattr(zk, name)

    assert restore_marks(RacingClient(), path, (T0 + 5000,), 0, Layout())
    assert stored(zk, path) == (T0 + 5000, 1)


def test_restore_gives_up_on_a_mark_that_keeps_changing(zk: KazooClient, path: str) -> None:
    zk.create(path, str(T0).encode(), makepath=True)

    class Meddler:
        """Another writer moves the mark between each read and our write."""

        def __getattr__(self, name: str) -> Any:
            if name == "set_async":
                zk.set(path, str(T0).encode())
            return getattr(zk, name)

    with pytest.raises(StartupRefused, match="kept changing"):
        restore_marks(Meddler(), path, (T0 + 5000,), 0, Layout())
