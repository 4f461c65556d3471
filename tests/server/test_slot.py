"""The slot cluster mode serves from: a worker while the session gate is open, under
fake clocks (the gate's in seconds, the ids' in ms)."""

from __future__ import annotations

from pathlib import Path

import pytest

from snowflake_server import (
    GeneratorCounters,
    ReservationError,
    ServerSettings,
    UnavailableError,
    decompose,
)
from snowflake_server._cluster.gate import SessionGate
from snowflake_server._cluster.slot import CurrentReservation, WorkerSlot
from snowflake_server._native import native_core
from snowflake_server._state.worker import Worker
from tests.support.fakes import FakeClock, SecondsClock

T0 = 1_700_000_000_000
TIMEOUT = 10.0  # s: the session timeout a confirmation counts with


def open_worker(tmp_path: Path, clock: FakeClock, worker_id: int) -> Worker:
    settings = ServerSettings(
        state_dir=str(tmp_path / "state"), first_start_wait=0.0, host_lock_scope=str(tmp_path)
    )
    return Worker.open(settings.worker, worker_id, clock=clock, sleep=clock.sleep)


def opened(gate: SessionGate) -> float:
    """Open ``gate`` as a registration and a confirmed heartbeat do; its deadline."""
    assert gate.reopen(gate.registering())
    assert gate.confirm(gate.send(), TIMEOUT)
    return gate.open_until


def test_an_empty_slot_refuses_and_reports_the_placeholder() -> None:
    ids = ServerSettings(worker_id=7).ids
    slot = WorkerSlot(ids, SessionGate(SecondsClock()))
    opened(slot.gate)
    assert not slot.serving and slot.worker is None, "an open gate serves nothing without a worker"
    assert slot.settings == ids
    assert slot.counters() == GeneratorCounters()
    assert slot.retire() is None
    assert slot.unavailable_reason() is not None
    with pytest.raises(UnavailableError, match="not handing out ids"):
        slot.next_id()
    assert list(CurrentReservation(slot).collect()) == []


def test_a_new_slot_says_it_is_not_registered_yet() -> None:
    slot = WorkerSlot(ServerSettings().ids, SessionGate(SecondsClock()))
    with pytest.raises(UnavailableError, match="not handing out ids: not registered yet"):
        slot.next_id()


def test_a_slot_serves_while_its_gate_is_open(tmp_path: Path) -> None:
    clock_s = SecondsClock(1000.0)
    clock = FakeClock(T0)
    slot = WorkerSlot(ServerSettings().ids, SessionGate(clock_s))
    slot.install(open_worker(tmp_path, clock, worker_id=4))
    try:
        assert not slot.serving, "installed, but nothing proved it may serve yet"
        assert slot.unavailable_reason() == "this node is not handing out ids: not registered yet"
        deadline = opened(slot.gate)
        assert slot.serving and slot.unavailable_reason() is None
        assert decompose(slot.next_id()).worker_id == 4
        assert len(slot.next_ids(5)) == 5
        assert slot.settings.worker_id == 4
        clock_s.now = deadline
        assert slot.serving, "the deadline itself still counts"
        clock_s.now = deadline + 0.001
        assert not slot.serving
        with pytest.raises(UnavailableError, match="ZooKeeper unreachable"):
            slot.next_ids(2)
        names = {m.name for m in CurrentReservation(slot).collect()}
        assert {"snowflake_high_water_mark_timestamp_seconds", "snowflake_first_starts"} <= names
    finally:
        assert slot.retire() is not None


def test_a_closed_gate_stops_ids_at_once_with_its_reason(tmp_path: Path) -> None:
    slot = WorkerSlot(ServerSettings().ids, SessionGate(SecondsClock(0.0)))
    slot.install(open_worker(tmp_path, FakeClock(T0), worker_id=3))
    opened(slot.gate)
    assert slot.serving
    slot.gate.close("the ZooKeeper session was lost")
    assert not slot.serving
    with pytest.raises(UnavailableError, match="the ZooKeeper session was lost"):
        slot.next_id()
    assert slot.retire() is not None


def test_counters_add_up_every_worker_the_slot_held(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    slot = WorkerSlot(ServerSettings().ids, SessionGate(SecondsClock(0.0)))
    slot.install(open_worker(tmp_path, clock, worker_id=1))
    opened(slot.gate)
    slot.next_ids(3)
    next_worker = open_worker(tmp_path, clock, worker_id=2)
    with pytest.raises(AssertionError, match="retire the old worker first"):
        slot.install(next_worker)
    first = slot.retire()
    assert first is not None and not slot.serving, "retiring closes the slot"
    assert slot.gate.shut and not slot.gate.is_open()
    with pytest.raises(ReservationError):
        first.generator.next_id()  # and its worker: sealed
    assert slot.counters().ids_generated == 3, "a retired worker's ids still count"
    slot.install(next_worker)
    assert not slot.serving, "the next worker serves only once its registration is proven"
    opened(slot.gate)
    slot.next_ids(4)
    assert slot.counters().ids_generated == 7
    assert slot.retire("this node is stopping") is not None
    assert slot.counters().ids_generated == 7
    with pytest.raises(UnavailableError, match="this node is stopping"):
        slot.next_id()


@pytest.mark.skipif(native_core() is None, reason="the native core is not built")
def test_the_installed_workers_native_state_follows_the_gate_and_is_sealed_on_retire(
    tmp_path: Path,
) -> None:
    clock_s = SecondsClock(1000.0)
    clock = FakeClock(T0)
    slot = WorkerSlot(ServerSettings().ids, SessionGate(clock_s))
    worker = open_worker(tmp_path, clock, worker_id=5)
    state = worker.native_state
    assert state is not None, "the native core is there: the worker's state is native"
    seen: list[object] = []

    def watcher(now: object) -> None:
        seen.append((now, state.sealed))  # whether the old state was sealed when told

    slot.watch(watcher)
    assert seen == [(None, False)], "no worker yet"
    slot.install(worker)
    assert seen[-1] == (state, False), "a watcher is told the state native threads issue from"
    assert slot.gate.attached is state and not state.gate_open
    deadline = opened(slot.gate)
    assert state.gate_until == deadline
    first = state.next_id(clock(), clock_s.now)
    assert first is not None and decompose(first).worker_id == 5
    assert slot.next_id() > first, "Python and the native state: one sequence"
    clock_s.now = deadline + 0.001
    assert state.next_id(clock(), clock_s.now) is None, "the deadline passed: SLOW"
    clock_s.now = 1000.0
    assert slot.retire("this node is stopping") is worker
    assert state.sealed and not state.gate_open and slot.gate.attached is None
    assert seen[-1] == (None, True), "told once retired, after the seal"
    slot.watch(watcher)
    assert seen[-1] == (None, True), "a late watcher: no worker now"
    assert state.next_id(clock(), clock_s.now) is None
