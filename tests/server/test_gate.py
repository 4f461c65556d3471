"""The session gate: ids only while ZooKeeper confirmed the session within 0.9 x the
granted timeout.

The proof is driven in-process on a fake clock (the law, then each way it closes);
the heartbeat that feeds it is driven against a real ZooKeeper.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kazoo.client import KazooClient

from snowflake_server._cluster.gate import OPEN_FRACTION, UNREACHABLE, Heartbeat, SessionGate
from snowflake_server._cluster.session import GrantedTimeout, watch_granted_timeout
from snowflake_server._native import native_core
from tests.support.fakes import SecondsClock
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

if TYPE_CHECKING:
    from snowflake_server._native._core import GeneratorState

TIMEOUT = 4.0


def registered(clock: SecondsClock) -> SessionGate:
    """A gate whose node just registered (not confirmed yet)."""
    gate = SessionGate(clock)
    assert gate.reopen(gate.registering())
    return gate


# -- the proof, in-process --------------------------------------------------------


def test_a_new_gate_is_closed_and_no_confirmation_opens_it_before_a_registration() -> None:
    gate = SessionGate(SecondsClock())
    assert not gate.is_open() and gate.shut and gate.reason == "not registered yet"
    assert not gate.confirm(gate.send(), TIMEOUT)
    assert not gate.is_open()


def test_a_confirmation_opens_until_0_9_x_timeout_after_the_heartbeat_was_sent() -> None:
    clock = SecondsClock(100.0)
    gate = registered(clock)
    beat = gate.send()
    clock.advance(1.5)  # the answer took its time: the proof counts from the send
    assert gate.confirm(beat, TIMEOUT)
    assert gate.open_until == 100.0 + OPEN_FRACTION * TIMEOUT
    clock.now = gate.open_until
    assert gate.is_open(), "the deadline itself counts"
    clock.advance(0.001)
    assert not gate.is_open()
    assert gate.reason == UNREACHABLE, "a lapsed gate says why"
    assert gate.last_contact == 100.0 and gate.age() == pytest.approx(clock.now - 100.0)


def test_a_closure_while_a_heartbeat_is_under_way_voids_its_answer() -> None:
    clock = SecondsClock()
    gate = registered(clock)
    beat = gate.send()
    gate.close("the ZooKeeper session was lost; registering again")
    assert gate.reopen(gate.registering())  # a registration since: the answer is to the old one
    assert not gate.confirm(beat, TIMEOUT)
    assert not gate.is_open()
    assert gate.confirm(gate.send(), TIMEOUT), "a heartbeat sent after it counts"


def test_a_closure_shuts_the_gate_until_a_new_registration() -> None:
    clock = SecondsClock()
    gate = registered(clock)
    assert gate.confirm(gate.send(), TIMEOUT) and gate.is_open()
    gate.close("worker id lost: a mark write was refused; registering again")
    assert not gate.is_open() and gate.shut
    assert gate.reason == "worker id lost: a mark write was refused; registering again"
    assert not gate.confirm(gate.send(), TIMEOUT), "the old registration proves nothing"
    assert gate.reopen(gate.registering())
    assert gate.confirm(gate.send(), TIMEOUT) and gate.is_open()


def test_a_closure_while_registering_keeps_the_gate_shut() -> None:
    """A mark write refused while the worker opened (the reservation's thread) is about
    the registration under way: it must be made again, not reopened."""
    gate = SessionGate(SecondsClock())
    token = gate.registering()
    gate.close("worker id lost: a mark write was refused; registering again")
    assert not gate.reopen(token) and gate.shut
    assert not gate.confirm(gate.send(), TIMEOUT)
    gate.hold("held")
    gate.hold(None)
    assert gate.reopen(gate.registering()), "a hold is no closure of the registration"


def test_a_closure_without_a_reason_keeps_the_one_given() -> None:
    gate = registered(SecondsClock())
    gate.close("the ZooKeeper session was lost; registering again")
    gate.close()
    assert gate.reason == "the ZooKeeper session was lost; registering again"


def test_a_hold_closes_at_once_and_keeps_it_closed_whatever_zookeeper_confirms() -> None:
    clock = SecondsClock()
    gate = registered(clock)
    gate.confirm(gate.send(), TIMEOUT)
    gate.hold("this node's layout is not the cluster's")
    assert not gate.is_open() and gate.held == "this node's layout is not the cluster's"
    assert not gate.confirm(gate.send(), TIMEOUT)
    assert gate.reason == "this node's layout is not the cluster's"
    gate.hold(None)
    assert not gate.is_open(), "released, but not proven yet"
    assert gate.confirm(gate.send(), TIMEOUT) and gate.is_open()


def test_a_heartbeat_sent_before_a_hold_opens_nothing_after_its_release() -> None:
    gate = registered(SecondsClock())
    beat = gate.send()
    gate.hold("held")
    gate.hold(None)
    assert not gate.confirm(beat, TIMEOUT)


def test_zookeeper_out_of_reach_closes_nothing_but_says_why_once_it_lapses() -> None:
    clock = SecondsClock()
    gate = registered(clock)
    gate.confirm(gate.send(), TIMEOUT)
    gate.close("something")
    gate.unreachable()
    assert gate.reason == UNREACHABLE
    assert gate.reopen(gate.registering())
    gate.confirm(gate.send(), TIMEOUT)
    gate.unreachable()
    assert gate.is_open(), "SUSPENDED: the deadline runs out by itself"


class GateLaw(RuleBasedStateMachine):
    """The law, against a model, under any interleaving of what happens to a gate: it is
    open exactly while a registration begun after the last closure stands, nothing holds
    it, and now is within 0.9 x timeout of the send of the last heartbeat that opened it,
    a heartbeat sent after the last closure or hold."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = SecondsClock(0.0)
        self.gate = SessionGate(self.clock)
        self.beats: list[Heartbeat] = []
        self.tokens: list[tuple[int, bool]] = []  # (token, whether it may still reopen)
        self.last_closure = float("-inf")  # a close or a hold
        self.valid_until = float("-inf")
        self.shut, self.held = True, False
        self.reason = "not registered yet"

    def _closed(self) -> None:
        self.valid_until, self.last_closure = float("-inf"), self.clock.now
        self.clock.advance(1e-6)  # a heartbeat sent after it is strictly later

    @rule(seconds=st.floats(min_value=0.0, max_value=3.0))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def send(self) -> None:
        self.beats.append(self.gate.send())

    @precondition(lambda self: self.beats)
    @rule(data=st.data(), timeout=st.floats(min_value=0.5, max_value=20.0))
    def confirm(self, data: st.DataObject, timeout: float) -> None:
        beat = self.beats.pop(data.draw(st.integers(0, len(self.beats) - 1)))
        opened = self.gate.confirm(beat, timeout)
        assert opened == (not self.shut and not self.held and beat.sent > self.last_closure)
        if opened:
            self.valid_until = beat.sent + OPEN_FRACTION * timeout
            self.reason = UNREACHABLE  # what it says once it lapses

    @rule()
    def close(self) -> None:
        self.gate.close("closed")
        self.shut, self.reason = True, "closed"
        self.tokens = [(token, False) for token, _ in self.tokens]
        self._closed()

    @rule()
    def begin_registering(self) -> None:
        self.tokens.append((self.gate.registering(), True))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def reopen(self, data: st.DataObject) -> None:
        token, valid = self.tokens.pop(data.draw(st.integers(0, len(self.tokens) - 1)))
        assert self.gate.reopen(token) == valid
        if valid:
            self.shut = False

    @rule()
    def hold(self) -> None:
        self.gate.hold("held")
        self.held, self.reason = True, "held"
        self._closed()

    @rule()
    def release(self) -> None:
        self.gate.hold(None)
        self.held = False

    @invariant()
    def open_exactly_while_proven(self) -> None:
        expected = not self.shut and not self.held and self.clock.now <= self.valid_until
        assert self.gate.is_open() == expected
        assert self.gate.reason == self.reason


GateLaw.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_gate_is_open_exactly_while_a_valid_proof_stands = GateLaw.TestCase


# -- the heartbeat, against a real ZooKeeper --------------------------------------


@pytest.fixture
def session(zookeeper: ZooKeeper) -> Iterator[tuple[KazooClient, GrantedTimeout]]:
    """A session whose granted timeout is watched, as a node's is."""
    client = KazooClient(hosts=zookeeper.hosts, timeout=TIMEOUT)
    granted = watch_granted_timeout(client, TIMEOUT)
    client.start(timeout=10)
    yield client, granted
    client.stop()
    client.close()


@pytest.mark.zookeeper
def test_a_heartbeat_on_our_registration_opens_the_gate(
    session: tuple[KazooClient, GrantedTimeout], zk_path: str
) -> None:
    client, granted = session
    node = f"{zk_path}/nodes/0/3"
    client.create(node, b"127.0.0.1:1", ephemeral=True, makepath=True)
    clock = SecondsClock()
    gate = registered(clock)
    assert gate.heartbeat(client, node, granted)
    timeout = granted.for_session(client.client_id[0])
    assert timeout is not None and timeout <= TIMEOUT
    assert gate.is_open() and gate.open_until == clock.now + OPEN_FRACTION * timeout


@pytest.mark.zookeeper
def test_a_heartbeat_on_a_registration_gone_or_another_sessions_says_so(
    session: tuple[KazooClient, GrantedTimeout],
    zk_sessions: Callable[[], KazooClient],
    zk_path: str,
) -> None:
    client, granted = session
    gate = registered(SecondsClock())
    assert not gate.heartbeat(client, f"{zk_path}/nodes/0/4", granted), "gone"
    other = zk_sessions()
    theirs = f"{zk_path}/nodes/0/5"
    other.create(theirs, b"10.0.0.9:7609", ephemeral=True, makepath=True)
    assert not gate.heartbeat(client, theirs, granted), "another session's"
    assert not gate.is_open()


@pytest.mark.zookeeper
def test_a_heartbeat_of_a_session_whose_granted_timeout_is_unknown_proves_nothing(
    session: tuple[KazooClient, GrantedTimeout], zk_path: str
) -> None:
    client, _ = session
    node = f"{zk_path}/nodes/0/6"
    client.create(node, b"127.0.0.1:1", ephemeral=True, makepath=True)
    unknown = GrantedTimeout(TIMEOUT)  # saw no connect reply of this session
    gate = registered(SecondsClock())
    assert gate.heartbeat(client, node, unknown), "not lost: nothing to register again"
    assert not gate.is_open()
    unknown.record(client.client_id[0], 4000)
    assert gate.heartbeat(client, node, unknown) and gate.is_open()


# -- the native state's copy ------------------------------------------------------

core = native_core()
needs_core = pytest.mark.skipif(core is None, reason="the native core is not built")
T_MS = 1_700_000_000_000


def native_state() -> GeneratorState:
    assert core is not None
    state: GeneratorState = core.GeneratorState(1288834974657, 22, 4095, True)
    state.ceiling = T_MS + 10_000
    return state


def fast(state: GeneratorState, clock: SecondsClock) -> int | None:
    """The native fast call at the gate's time (None: SLOW)."""
    return state.next_id(T_MS, clock.now)


@needs_core
def test_an_attached_native_state_copies_every_change_of_the_deadline() -> None:
    clock = SecondsClock(100.0)
    gate = registered(clock)
    state = native_state()
    gate.attach(state)
    assert gate.attached is state
    assert not state.gate_open and fast(state, clock) is None, "closed, as the gate"
    assert gate.confirm(gate.send(), TIMEOUT)
    assert state.gate_open and state.gate_until == gate.open_until
    assert fast(state, clock) is not None
    clock.now = gate.open_until + 0.001
    assert fast(state, clock) is None, "past the deadline: SLOW, with no word from Python"
    clock.now = 100.0
    gate.hold("another layout's record")
    assert not state.gate_open and fast(state, clock) is None
    gate.hold(None)
    assert not state.gate_open, "no longer held opens nothing by itself"
    assert gate.confirm(gate.send(), TIMEOUT) and state.gate_open
    gate.close("the ZooKeeper session was lost")
    assert not state.gate_open and fast(state, clock) is None, "at once"
    gate.attach(None)
    assert gate.attached is None
    assert gate.reopen(gate.registering()) and gate.confirm(gate.send(), TIMEOUT)
    assert not state.gate_open, "detached: the old state keeps its closed copy"


@needs_core
def test_a_gate_closed_by_the_thread_holding_the_native_state_closes_it_in_place() -> None:
    # A clock-sequence switch writes its marks with the state held; a refused write closes
    # the gate from inside: the copy must neither deadlock nor wait for the release.
    clock = SecondsClock(100.0)
    gate = registered(clock)
    state = native_state()
    gate.attach(state)
    assert gate.confirm(gate.send(), TIMEOUT)
    with state:
        gate.close("worker id lost")
        assert not state.gate_open
    assert fast(state, clock) is None


@needs_core
def test_copies_that_cross_leave_the_newest_deadline() -> None:
    # A confirmation's copy waits for the mutex while its holder closes the gate: the copy
    # that lands last must carry the closure, not the deadline its own change set.
    clock = SecondsClock(100.0)
    gate = registered(clock)
    state = native_state()
    gate.attach(state)
    state.acquire()
    confirming = threading.Thread(target=gate.confirm, args=(gate.send(), TIMEOUT))
    try:
        confirming.start()
        wait_until(lambda: gate.open_until > 100.0, "the confirmation", timeout_s=10)
        gate.close("the ZooKeeper session was lost")  # in place: the holder
    finally:
        state.release()
    confirming.join(timeout=10)
    assert not confirming.is_alive()
    assert not gate.is_open() and not state.gate_open, "the closure stands"
    assert fast(state, clock) is None
