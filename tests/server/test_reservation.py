"""The reserved high-water mark and the start-up wait, under a fake clock."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from kazoo.handlers.threading import KazooTimeoutError

from snowflake_server import (
    GeneratorSettings,
    IdGenerator,
    Layout,
    ReservationError,
    StartupRefused,
    UnavailableError,
    decompose,
)
from snowflake_server._state.reservation import MarkStore, Reservation, wait_for_clock
from snowflake_server._state.statefile import StateFile
from tests.support.fakes import FakeClock
from tests.support.waiting import run_in_thread, wait_until

T0 = 1_700_000_000_000


def test_waits_for_a_clock_a_little_behind() -> None:
    clock = FakeClock(T0)
    waited = wait_for_clock(T0 + 4000, clock, clock.sleep, 10, "state")
    assert clock() > T0 + 4000
    assert sum(clock.sleeps) == pytest.approx(4.001, abs=0.06)
    assert waited >= 0


def test_the_mark_itself_counts_as_used() -> None:
    clock = FakeClock(T0)
    wait_for_clock(T0, clock, clock.sleep, 10, "state")
    assert clock() == T0 + 1


def test_no_wait_when_the_clock_is_past() -> None:
    clock = FakeClock(T0)
    assert wait_for_clock(T0 - 1, clock, clock.sleep, 10, "state") == 0.0
    assert clock.sleeps == []


def test_refuses_a_clock_far_behind_and_says_what_to_do() -> None:
    clock = FakeClock(T0)
    with pytest.raises(StartupRefused) as info:
        wait_for_clock(T0 + 60_000, clock, clock.sleep, 10, "/var/x.json")
    message = str(info.value)
    assert "60.000 s behind" in message and "/var/x.json" in message
    assert "--max-startup-wait 61" in message and "NTP" in message
    assert clock.sleeps == [], "refused at once, not after waiting"


def make(tmp_path: Path, clock: FakeClock, resume: int = -1) -> tuple[IdGenerator, Reservation]:
    state = StateFile.open(tmp_path, 0, 0)
    reservation = Reservation([(state, 1000)], clock)
    generator = IdGenerator(
        GeneratorSettings(),
        clock=clock,
        sleep=clock.sleep,
        resume_after_ms=resume,
        ceiling_ms=resume,
        reserve=reservation.reserve,
    )
    return generator, reservation


def test_no_id_is_stamped_past_the_mark_on_disk(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    generator, _ = make(tmp_path, clock)
    state_path = tmp_path / "worker-0-0.json"
    for step in [0, 1, 500, 999, 1000, 1001, 5000, 7]:
        clock.now += step
        id_ = generator.next_id()
        on_disk = int(state_path.read_text().split('"high_water_mark_ms": ')[1].rstrip("}\n"))
        assert decompose(id_).timestamp_ms <= on_disk
    # Without the background thread each pass of the ceiling renews on the id path:
    # at T0 (nothing reserved yet), +1500, +3501 and +8501.
    assert generator.reservation_stalls == 4


def test_resumes_after_the_previous_mark(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    generator, _ = make(tmp_path, clock, resume=T0)
    assert decompose(generator.next_id()).timestamp_ms == T0 + 1, "the mark's own ms is used up"


def test_finish_stores_the_exact_last_timestamp(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    generator, reservation = make(tmp_path, clock)
    generator.next_id()
    clock.now += 3
    last = generator.next_id()
    reservation.finish(generator)
    with pytest.raises(ReservationError, match="shut down"):
        generator.next_id()
    text = (tmp_path / "worker-0-0.json").read_text()
    assert f'"high_water_mark_ms": {decompose(last).timestamp_ms}' in text


def test_a_failed_write_stops_ids_past_the_old_mark(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    generator, _ = make(tmp_path, clock)
    generator.next_id()
    path = tmp_path / "worker-0-0.json"
    saved = path.read_text()
    path.unlink()
    path.mkdir()  # the rename onto it fails, even for root
    clock.now += 999
    assert decompose(generator.next_id()).timestamp_ms == T0 + 999, "still within the mark"
    clock.now += 2
    with pytest.raises(ReservationError, match="cannot write the high-water mark"):
        generator.next_id()
    path.rmdir()
    path.write_text(saved)
    assert decompose(generator.next_id()).timestamp_ms == T0 + 1001, "recovers once writable"


# A bound for what must happen at once: only reached when it does not (a hang).
PROMPTLY_S = 10.0
# How long a stand-in for a slow write holds on unless the test lets it go on: far
# longer than PROMPTLY_S, so a call that waits for the write shows as a hang.
HOLD_S = 60.0


class SlowStore(MarkStore):
    """A mark store in memory whose writes can be held up (a ZooKeeper write that
    takes seconds) or made to fail."""

    name = "slow"

    def __init__(self, values: int = 1) -> None:
        super().__init__(-1, [-1] * values)
        self.hold = False
        self.fail: Exception | None = None
        self.entered = threading.Event()
        self.go_on = threading.Event()

    @property
    def where(self) -> str:
        return "slow:/marks/0/0"

    def _store(self, marks: tuple[int, ...], clock_sequence: int) -> None:
        if self.hold:
            self.entered.set()
            self.go_on.wait(HOLD_S)
        if self.fail is not None:
            raise self.fail


class LateStore(SlowStore):
    """A :class:`SlowStore` whose next write (once ``hold_next``) is held before it
    takes the store's lock: a renewal that read its value and then lost the CPU."""

    def __init__(self, values: int = 1) -> None:
        super().__init__(values)
        self.hold_next = False

    def _target(self, mark_ms: int) -> int:
        if self.hold_next:
            self.hold_next = False
            self.entered.set()
            self.go_on.wait(HOLD_S)
        return mark_ms


def started(
    clock: FakeClock, store: SlowStore, *, wait_s: float = 0.1, layout: Layout | None = None
) -> tuple[IdGenerator, Reservation]:
    """A generator and its reservation with the renewal thread running, as a worker
    has them; the thread renews only when asked (every_s: never by itself)."""
    reservation = Reservation([(store, 1000)], clock, every_s=3600, wait_s=wait_s)
    generator = IdGenerator(
        GeneratorSettings(layout=layout or Layout()), clock=clock, sleep=clock.sleep,
        ceiling_ms=-1, reserve=reservation.reserve, switch=reservation.switch,
    )  # fmt: skip
    generator.raise_ceiling(reservation.reserve(clock()))
    reservation.start(generator)
    return generator, reservation


def test_a_slow_write_neither_blocks_the_generator_nor_hangs_the_call() -> None:
    # The regression of issue 16, item 5: the mark write (up to 2 s in ZooKeeper)
    # ran under the generator's lock, and every call waited for it.
    clock = FakeClock(T0)
    store = SlowStore()
    generator, reservation = started(clock, store)
    store.hold = True
    clock.now += 1001  # past the reserved mark, and the renewal has not run
    caller, outcome = run_in_thread(generator.next_id)
    try:
        assert store.entered.wait(PROMPTLY_S), "the call asked the renewal to write now"
        counting, counted = run_in_thread(generator.counters)
        counting.join(PROMPTLY_S)
        assert not counting.is_alive(), "the generator's lock is held during the write"
        caller.join(PROMPTLY_S)  # the call waits RENEW_WAIT_S, not for the write
        assert not caller.is_alive(), "the call waits for the slow write"
        error = outcome[0]
        assert isinstance(error, ReservationError), error
        assert isinstance(error, UnavailableError), "clients fail over to another node"
        assert f"no high-water mark covers ms {T0 + 1001}" in str(error)
        assert "the renewal of slow:/marks/0/0 is behind" in str(error)
        assert "it has been writing slow:/marks/0/0 for " in str(error)
    finally:
        store.go_on.set()
        reservation.finish(generator)
    assert [c.reservation_stalls for c in counted] == [1]  # type: ignore[attr-defined]


def test_a_call_past_the_mark_has_it_renewed_at_once() -> None:
    clock = FakeClock(T0)
    store = SlowStore()
    # wait_s is long: the call gets its id as soon as the write is done, not after it.
    generator, reservation = started(clock, store, wait_s=PROMPTLY_S)
    try:
        clock.now += 1500
        assert decompose(generator.next_id()).timestamp_ms == T0 + 1500
        assert store.mark_ms == T0 + 2500 and generator.ceiling_ms == T0 + 2500
        assert generator.reservation_stalls == 1
    finally:
        reservation.finish(generator)
    assert store.mark_ms == T0 + 1500, "the exact last mark"


def test_a_failed_write_is_reported_at_once_with_its_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO")
    clock = FakeClock(T0)
    store = SlowStore()
    generator, reservation = started(clock, store, wait_s=PROMPTLY_S)
    try:
        store.fail = KazooTimeoutError()  # str() is empty: the type tells what happened
        clock.now += 1001
        for _ in range(2):
            with pytest.raises(ReservationError) as info:
                generator.next_id()
            assert str(info.value) == (
                f"no high-water mark covers ms {T0 + 1001} (2023-11-14T22:13:21.001+00:00) yet: "
                "the renewal of slow:/marks/0/0 is behind; its last write failed: cannot "
                "write the high-water mark to slow:/marks/0/0: KazooTimeoutError"
            )
        store.fail = None
        assert decompose(generator.next_id()).timestamp_ms == T0 + 1001, "and recovers"
    finally:
        reservation.finish(generator)  # joins the thread: its log is complete
    logged = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert logged == [
        ("ERROR", "cannot write the high-water mark to slow:/marks/0/0: KazooTimeoutError"),
        ("INFO", "the high-water mark is written again"),
    ], "a write that keeps failing is logged once, and its end"


def test_an_error_without_text_is_named_by_its_type() -> None:
    clock = FakeClock(T0)
    store = SlowStore()
    store.fail = KazooTimeoutError()
    reservation = Reservation([(store, 1000)], clock)
    with pytest.raises(ReservationError) as info:
        reservation.reserve(T0)  # not started: written here and now
    assert str(info.value) == (
        "cannot write the high-water mark to slow:/marks/0/0: KazooTimeoutError"
    )


def test_finish_ends_the_wait_of_a_call_at_once() -> None:
    clock = FakeClock(T0)
    store = SlowStore()
    generator, reservation = started(clock, store, wait_s=PROMPTLY_S)
    generator.next_id()
    store.hold = True
    clock.now += 1001
    caller, outcome = run_in_thread(generator.next_id)
    assert store.entered.wait(PROMPTLY_S)
    finishing, _ = run_in_thread(lambda: reservation.finish(generator))
    caller.join(PROMPTLY_S)
    assert not caller.is_alive(), "the call waited for the write after all"
    assert isinstance(outcome[0], ReservationError) and "shut down" in str(outcome[0])
    store.go_on.set()
    finishing.join(PROMPTLY_S)
    assert not finishing.is_alive()
    assert store.mark_ms == T0, "the exact last mark: no id after T0"


def test_failing_says_why_while_the_marks_are_not_kept_ahead() -> None:
    clock = FakeClock(T0)
    store = SlowStore()
    generator, reservation = started(clock, store, wait_s=0.05)
    try:
        assert reservation.failing is None
        clock.now += 999
        assert reservation.failing is None, "within the mark stored"
        store.hold = True  # the next write hangs: no error, but no mark covers now
        clock.now += 2
        with pytest.raises(ReservationError):
            generator.next_id()  # asks for the write, and gives up waiting for it
        assert store.entered.wait(PROMPTLY_S)
        failing = reservation.failing
        assert failing is not None
        assert failing.startswith(f"no high-water mark covers ms {T0 + 1001} ")
        assert "it has been writing slow:/marks/0/0 for " in failing
        store.hold = False
        store.fail = OSError(28, "No space left on device")
        store.go_on.set()  # the hung write ends, failing
        wait_until(lambda: "cannot write" in str(reservation.failing), "the write's end")
        assert reservation.failing == (
            "cannot write the high-water mark to slow:/marks/0/0: No space left on device"
        )
        store.fail = None
        clock.now += 1
        assert decompose(generator.next_id()).timestamp_ms == T0 + 1002
        assert reservation.failing is None, "written again"
    finally:
        store.go_on.set()
        reservation.finish(generator)
    assert reservation.failing is None, "finished: sealed on purpose"


def test_a_renewal_of_the_old_value_done_after_a_switch_is_not_the_new_ceiling() -> None:
    clock = FakeClock(T0)
    store = SlowStore(values=4)
    layout = Layout(datacenter_id_bits=3, clock_sequence_bits=2)
    generator, reservation = started(clock, store, layout=layout)
    try:
        generator.next_id()
        store.hold = True
        clock.now += 10
        # A call past the ceiling asks the renewal thread to write at once (and gives
        # up after wait_s: the write is held).
        run_in_thread(lambda: reservation.reserve(T0 + 1001))
        assert store.entered.wait(PROMPTLY_S)
        clock.now -= 60_010  # a rollback: the next call moves to value 1 and writes it
        caller, outcome = run_in_thread(generator.next_id)
        caller.join(0.05)
        assert caller.is_alive(), "the switch waits for the store: ids wait for it"
        store.go_on.set()  # the renewal of value 0 lands first, then the switch
        caller.join(PROMPTLY_S)
        assert not caller.is_alive()
        assert layout.decompose(outcome[0]).clock_sequence == 1  # type: ignore[arg-type]
        assert reservation.clock_sequence == 1
        assert generator.ceiling_ms == T0 - 59_000, "the switch's mark, not value 0's"
        assert store.marks[0] >= T0 + 1000 and store.marks[1] == T0 - 59_000
    finally:
        store.hold = False
        store.go_on.set()
        reservation.finish(generator)
    assert (store.marks[1], store.clock_sequence) == (T0 - 60_000, 1)


def test_a_renewal_of_the_old_value_landing_after_a_move_is_no_ceiling_of_the_new() -> None:
    clock = FakeClock(T0)
    store = LateStore(values=4)
    generator, reservation = started(clock, store)
    try:
        assert store.marks[0] == T0 + 1000
        store.hold_next = True
        asking, _ = run_in_thread(lambda: reservation.reserve(T0 + 1001))
        assert store.entered.wait(PROMPTLY_S), "the renewal read value 0, not yet written"
        asking.join(PROMPTLY_S)
        clock.now = T0 - 60_000
        assert reservation.switch(1, T0 - 60_000) == T0 - 59_000
        store.go_on.set()  # the renewal of value 0 lands after the move
        wait_until(lambda: store.marks[0] == T0 + 2001, "the renewal's write")
        assert store.marks[0] == T0 + 2001, "value 0's mark still moves on: safe"
        clock.now = T0 - 58_000  # past value 1's mark, long before value 0's
        failing = reservation.failing or ""
        assert "no high-water mark covers" in failing, "value 1 is not covered"
    finally:
        store.go_on.set()
        reservation.finish(generator)
