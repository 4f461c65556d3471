"""A worker (state file, marks, start-up wait, generator) under fake clocks: no test
waits for real time to pass."""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from snowflake_server import (
    ConfigurationError,
    ReservationError,
    ServerSettings,
    StartupRefused,
    decompose,
)
from snowflake_server._app.node import standalone
from snowflake_server._ids.generator import IdGenerator, NativeStateIdGenerator
from snowflake_server._native import native_core
from snowflake_server._state.reservation import MarkStore
from snowflake_server._state.worker import Worker, generator_class
from tests.support.fakes import FakeClock

T0 = 1_700_000_000_000


class MemoryMarks(MarkStore):
    """A second mark store kept in memory, standing in for ZooKeeper's."""

    name = "memory"

    def __init__(self, mark_ms: int, marks: tuple[int, ...] = (), clock_sequence: int = 0) -> None:
        super().__init__(mark_ms, marks, clock_sequence)
        self.stored: list[int] = []
        self.records: list[tuple[tuple[int, ...], int]] = []
        self.refusing: Exception | None = None  # raised by each write while set
        # Called as each write lands: the worker writes its state file first, this after.
        self.on_store: Callable[[], object] | None = None

    @property
    def where(self) -> str:
        return "memory"

    def _store(self, marks: tuple[int, ...], clock_sequence: int) -> None:
        if self.refusing is not None:
            raise self.refusing
        if self.on_store is not None:
            self.on_store()
        self.stored.append(marks[clock_sequence])
        self.records.append((marks, clock_sequence))


def settings(tmp_path: Path, **overrides: object) -> ServerSettings:
    """A worker's settings in this test's own host lock scope; no first-start wait
    unless the test asks for one."""
    values: dict[str, object] = {
        "state_dir": str(tmp_path / "state"),
        "first_start_wait": 0.0,
        "host_lock_scope": str(tmp_path),  # tests running at once never share a lock
        **overrides,
    }
    return ServerSettings(**values)  # type: ignore[arg-type]


def on_disk(tmp_path: Path, worker_id: int, datacenter_id: int = 0) -> int:
    path = tmp_path / "state" / f"worker-{datacenter_id}-{worker_id}.json"
    return int(json.loads(path.read_text())["high_water_mark_ms"])


def open_worker(
    tmp_path: Path,
    clock: FakeClock,
    worker_id: int = 3,
    remote: tuple[MarkStore, int] | None = None,
    **overrides: object,
) -> Worker:
    return Worker.open(
        settings(tmp_path, **overrides).worker,
        worker_id,
        clock=clock,
        sleep=clock.sleep,
        remote=remote,
    )


# -- Worker -------------------------------------------------------------------


def test_a_first_start_serves_at_once_and_closes_with_the_exact_mark(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(T0)
    caplog.set_level("INFO")
    worker = open_worker(tmp_path, clock, worker_id=3)
    try:
        assert "no high-water mark for worker 3 anywhere" in caplog.text
        assert "not waiting (--first-start-wait 0)" in caplog.text
        assert worker.worker_id == 3
        assert worker.reservation.startup_wait_s == 0.0
        assert clock.sleeps == [], "nothing to wait for"
        assert on_disk(tmp_path, 3) == T0 + 1000, "reserved ahead before the first id"
        first = worker.generator.next_id()
        parts = decompose(first)
        assert (parts.worker_id, parts.timestamp_ms) == (3, T0)
    finally:
        worker.close()
    assert on_disk(tmp_path, 3) == T0, "the exact last timestamp used, not the reservation"
    with pytest.raises(ReservationError):
        worker.generator.next_id()  # sealed


def test_a_restart_resumes_after_the_mark_without_waiting_when_the_clock_is_past(
    tmp_path: Path,
) -> None:
    clock = FakeClock(T0)
    last = issue_one_and_close(open_worker(tmp_path, clock))
    clock.now += 5  # a clean restart, a few ms later
    again = open_worker(tmp_path, clock)
    try:
        assert clock.sleeps == [] and again.reservation.startup_wait_s == 0.0
        assert again.generator.next_id() > last
    finally:
        again.close()


def issue_one_and_close(worker: Worker) -> int:
    """The last run: one id, then a clean stop (the exact mark is its timestamp)."""
    last = worker.generator.next_id()
    worker.close()
    return last


def test_a_worker_stopped_before_its_first_id_starts_again(tmp_path: Path) -> None:
    """A first start that never issued an id leaves a valid mark (it wrote -1, which
    the next start refused as a corrupt state file)."""
    clock = FakeClock(T0)
    open_worker(tmp_path, clock).close()
    assert on_disk(tmp_path, 3) >= 0
    clock.now += 1
    again = open_worker(tmp_path, clock)
    try:
        assert decompose(again.generator.next_id()).timestamp_ms == T0 + 1
    finally:
        again.close()


def test_a_clock_behind_the_mark_on_disk_is_waited_for(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    issue_one_and_close(open_worker(tmp_path, clock))  # mark: T0
    clock.now = T0 - 3000  # the clock stepped back 3 s since
    worker = open_worker(tmp_path, clock)
    try:
        assert sum(clock.sleeps) == pytest.approx(3.001, abs=0.06), "slept on the fake clock"
        assert clock() > T0
        assert decompose(worker.generator.next_id()).timestamp_ms > T0
    finally:
        worker.close()


def test_the_remote_mark_is_honoured_and_reserved_ahead(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    remote = MemoryMarks(T0 + 2000)  # a recycled id: the previous holder got this far
    worker = open_worker(tmp_path, clock, remote=(remote, 5000))
    try:
        assert clock() > T0 + 2000, "waited for the remote mark, the later one"
        now = clock()
        assert remote.stored == [now + 5000], "reserved ahead by the remote margin"
        assert decompose(worker.generator.next_id()).timestamp_ms > T0 + 2000
        assert not worker.reservation.first_start, "a mark in ZooKeeper is a mark"
    finally:
        worker.close()
    assert remote.stored[-1] == on_disk(tmp_path, 3), "the same exact final mark in both"


def test_a_remote_store_without_a_mark_is_a_first_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(T0)
    caplog.set_level("INFO")
    remote = MemoryMarks(-1)
    worker = open_worker(tmp_path, clock, remote=(remote, 2000))
    try:
        assert "no high-water mark for worker 3 anywhere" in caplog.text
        assert worker.reservation.first_start
        assert remote.stored == [T0 + 2000]
    finally:
        worker.close()


def test_a_clock_far_behind_the_mark_is_refused_and_the_state_unlocked(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    issue_one_and_close(open_worker(tmp_path, clock))  # mark: T0
    clock.now = T0 - 60_000
    with pytest.raises(StartupRefused, match=r"60\.000 s behind .* --max-startup-wait 61"):
        open_worker(tmp_path, clock, max_startup_wait=10.0)
    assert clock.sleeps == [], "refused at once"
    clock.now = T0 + 1
    open_worker(tmp_path, clock).close()  # the lock was released: it opens again


def test_a_worker_held_by_another_opener_is_refused(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    worker = open_worker(tmp_path, clock)
    try:
        with pytest.raises(StartupRefused, match="another process on this host"):
            open_worker(tmp_path, clock)
    finally:
        worker.close()


def test_the_host_lock_holds_whatever_the_state_dir(tmp_path: Path) -> None:
    """Issue 16, item 1: another --state-dir (another user, $HOME) used to start and
    hand out the same ids: the state file's lock lives in the directory."""
    clock = FakeClock(T0)
    worker = open_worker(tmp_path, clock, worker_id=5)
    try:
        with pytest.raises(StartupRefused, match="worker 5, whatever its --state-dir"):
            open_worker(tmp_path, clock, worker_id=5, state_dir=str(tmp_path / "other"))
        assert not (tmp_path / "other").exists(), "refused before touching the state"
    finally:
        worker.close()
    open_worker(tmp_path, clock, worker_id=5, state_dir=str(tmp_path / "other")).close()


def test_a_failed_open_releases_the_host_lock(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigurationError, match="cannot use state directory"):
        open_worker(tmp_path, clock, state_dir=str(blocker / "sub"))
    held = open_worker(tmp_path, clock)  # the state file lock: refused after the host lock
    try:
        with pytest.raises(StartupRefused, match="from this state directory"):
            open_worker(tmp_path, clock, host_lock_scope=str(tmp_path / "elsewhere"))
    finally:
        held.close()
    issue_one_and_close(open_worker(tmp_path, clock))
    clock.now = T0 - 60_000  # refused after both locks were taken
    with pytest.raises(StartupRefused, match="behind"):
        open_worker(tmp_path, clock, max_startup_wait=1.0)
    clock.now = T0 + 10
    open_worker(tmp_path, clock, state_dir=str(tmp_path / "fresh")).close()  # both released


def test_a_state_file_of_another_layout_is_refused(tmp_path: Path) -> None:
    """Issue 16, item 2: a moved epoch made lower ids, repeats of the last run's."""
    clock = FakeClock(T0)
    issue_one_and_close(open_worker(tmp_path, clock))
    clock.now += 10
    moved = settings(tmp_path).epoch + 4477
    with pytest.raises(StartupRefused, match="written under another id layout"):
        open_worker(tmp_path, clock, epoch=moved)
    with pytest.raises(StartupRefused, match="written under another id layout"):
        open_worker(tmp_path, clock, epoch=moved, discard_corrupt_state=True)
    again = open_worker(tmp_path, clock)  # the recorded layout: served, locks released
    again.close()


# -- the first-start wait ---------------------------------------------------------


def metrics_of(worker: Worker) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in worker.reservation.collect()
        for sample in family.samples
        if not sample.labels
    }


def test_a_first_start_waits_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 16, item 4: with no mark anywhere, Twitter's start-up sleep."""
    clock = FakeClock(T0)
    caplog.set_level("WARNING")
    worker = open_worker(tmp_path, clock, first_start_wait=3.0)
    try:
        assert clock.sleeps == [3.0], "the injected sleep, once"
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        message = caplog.records[0].getMessage()
        assert "no high-water mark for worker 3 anywhere" in message
        assert str(tmp_path / "state" / "worker-0-3.json") in message
        assert "a lost state directory; waiting --first-start-wait 3 s" in message
        assert worker.reservation.first_start and worker.reservation.first_start_wait_s == 3.0
        assert metrics_of(worker)["snowflake_first_starts_total"] == 1
        assert on_disk(tmp_path, 3) == T0 + 3000 + 1000, "reserved after the wait"
        assert decompose(worker.generator.next_id()).timestamp_ms == T0 + 3000
    finally:
        worker.close()
    caplog.clear()
    clock.now += 1  # past the mark: no wait for the clock either
    again = open_worker(tmp_path, clock, first_start_wait=3.0)
    try:
        assert clock.sleeps == [3.0], "a mark exists now: no first-start wait"
        assert not again.reservation.first_start and again.reservation.first_start_wait_s == 0
        assert metrics_of(again)["snowflake_first_starts_total"] == 0
        assert "anywhere" not in caplog.text
    finally:
        again.close()


def test_a_lost_state_and_a_clock_behind_repeat_nothing(tmp_path: Path) -> None:
    """The finding: state directory lost (tmpfs, a new container), clock 2 s behind."""
    clock = FakeClock(T0)
    worker = open_worker(tmp_path, clock, first_start_wait=3.0)
    before = worker.generator.next_ids(50)
    clock.now += 500
    before += worker.generator.next_ids(50)
    worker.close()
    (tmp_path / "state" / "worker-0-3.json").unlink()
    clock.now -= 2000
    after = open_worker(tmp_path, clock, first_start_wait=3.0)
    try:
        ids = after.generator.next_ids(50)
        assert min(ids) > max(before) and not set(ids) & set(before)
    finally:
        after.close()


def test_a_discarded_corrupt_state_is_a_first_start(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "worker-0-3.json").write_text("{torn")
    clock = FakeClock(T0)
    worker = open_worker(tmp_path, clock, first_start_wait=2.0, discard_corrupt_state=True)
    try:
        assert worker.reservation.first_start and clock.sleeps == [2.0]
    finally:
        worker.close()


# -- a clock sequence -----------------------------------------------------------


def state_record(tmp_path: Path, worker_id: int = 3) -> dict[str, object]:
    path = tmp_path / "state" / f"worker-0-{worker_id}.json"
    record: dict[str, object] = json.loads(path.read_text())
    return record


def test_a_switch_is_on_disk_before_its_first_id_and_the_close_is_exact(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    # The second store is written after the state file: what is on disk then is what the
    # switch wrote before any id used the new value.
    remote = MemoryMarks(-1, (-1, -1, -1, -1))
    worker = open_worker(
        tmp_path, clock, remote=(remote, 1000), datacenter_id_bits=3, clock_sequence_bits=2
    )
    layout = worker.generator.settings.layout
    try:
        worker.generator.next_id()
        clock.now -= 60_000
        seen: list[dict[str, object]] = []
        remote.on_store = lambda: seen.append(state_record(tmp_path))
        id_ = worker.generator.next_id()
        assert layout.decompose(id_).clock_sequence == 1
        assert seen, "the switch wrote the state file"
        assert seen[0]["clock_sequence"] == 1
        assert seen[0]["high_water_marks_ms"] == [T0 + 1000, T0 - 59_000, -1, -1]
    finally:
        worker.close()
    record = state_record(tmp_path)
    assert record["format"] == 3 and record["clock_sequence"] == 1
    assert record["high_water_marks_ms"] == [T0 + 1000, T0 - 60_000, -1, -1]
    assert record["high_water_mark_ms"] == T0 + 1000
    assert record["layout"] == {
        "epoch_ms": layout.epoch_ms, "timestamp_bits": 41, "datacenter_id_bits": 3,
        "worker_id_bits": 5, "sequence_bits": 12, "clock_sequence_bits": 2,
    }  # fmt: skip


def test_a_restart_with_the_clock_behind_serves_at_once_with_another_value(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(T0)
    worker = open_worker(tmp_path, clock, datacenter_id_bits=3, clock_sequence_bits=2)
    before = worker.generator.next_id()
    worker.close()
    clock.now -= 60_000
    again = open_worker(
        tmp_path, clock, datacenter_id_bits=3, clock_sequence_bits=2, max_startup_wait=0.0
    )
    try:
        assert clock.sleeps == [] and again.reservation.startup_wait_s == 0.0
        assert "starting with clock sequence 1" in caplog.text
        id_ = again.generator.next_id()
        parts = again.generator.settings.layout.decompose(id_)
        assert (parts.timestamp_ms, parts.clock_sequence) == (T0 - 60_000, 1)
        assert id_ != before and again.generator.counters().clock_sequence_switches == 1
        assert state_record(tmp_path)["clock_sequence"] == 1, "reserved before serving"
    finally:
        again.close()
    clock.now += 120_000  # past every mark: the value last in use goes on
    third = open_worker(tmp_path, clock, datacenter_id_bits=3, clock_sequence_bits=2)
    try:
        assert third.generator.clock_sequence == 1
        assert third.generator.counters().clock_sequence_switches == 0
    finally:
        third.close()


def test_a_restart_with_every_value_ahead_waits_for_the_lowest(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    worker = open_worker(tmp_path, clock, datacenter_id_bits=3, clock_sequence_bits=2)
    worker.generator.next_id()
    for _ in range(3):
        clock.now -= 1000
        worker.generator.next_id()
    worker.close()  # marks: T0, T0 - 1000 ... T0 - 3000 (value 3 exact)
    clock.now = T0 - 3200
    with pytest.raises(StartupRefused, match="behind the high-water mark"):
        open_worker(
            tmp_path, clock, datacenter_id_bits=3, clock_sequence_bits=2, max_startup_wait=0.1
        )
    again = open_worker(
        tmp_path, clock, datacenter_id_bits=3, clock_sequence_bits=2, max_startup_wait=1.0
    )
    try:
        assert again.generator.clock_sequence == 3
        assert again.reservation.startup_wait_s > 0 and clock.now > T0 - 3000
    finally:
        again.close()


def test_a_failed_switch_stays_on_the_old_value_and_renews_it(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    store = MemoryMarks(-1, (-1, -1, -1, -1))
    worker = open_worker(
        tmp_path, clock, remote=(store, 1000), datacenter_id_bits=3, clock_sequence_bits=2
    )
    try:
        worker.generator.next_id()
        clock.now -= 60_000
        failing = ReservationError("the remote store is down")

        store.refusing = failing
        with pytest.raises(ReservationError, match="the remote store is down"):
            worker.generator.next_id()
        assert worker.generator.clock_sequence == 0
        assert worker.reservation.clock_sequence == 0
        assert "the remote store is down" in (worker.unavailable_reason() or ""), "/readyz"
    finally:
        store.refusing = None
        worker.close()
    assert store.records[-1] == ((T0, -1, -1, -1), 0), "the exact mark of the value in use"


def test_a_restart_a_few_ms_behind_waits_rather_than_moving(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    worker = open_worker(tmp_path, clock, datacenter_id_bits=3, clock_sequence_bits=2)
    worker.generator.next_id()
    worker.close()  # the exact mark: T0
    clock.now -= 3  # within --max-backwards-ms 5
    again = open_worker(tmp_path, clock, datacenter_id_bits=3, clock_sequence_bits=2)
    try:
        assert again.generator.clock_sequence == 0, "ids go on increasing"
        assert again.reservation.startup_wait_s > 0
        assert again.generator.counters().clock_sequence_switches == 0
    finally:
        again.close()


def test_a_worker_gets_the_native_state_where_the_core_is_there_and_says_which(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="snowflake_server")
    chosen = generator_class.__wrapped__()
    assert generator_class.__wrapped__(False) is IdGenerator, "no native threads: pure Python"
    if native_core() is None:
        assert chosen is IdGenerator
    else:
        assert chosen is NativeStateIdGenerator
        assert "native generator state" in caplog.text
    # Off (SNOWFLAKE_NO_NATIVE=1): today's generator, its state in Python attributes.
    monkeypatch.setenv("SNOWFLAKE_NO_NATIVE", "1")
    monkeypatch.setattr("snowflake_server._state.worker.native_core", native_core.__wrapped__)
    assert generator_class.__wrapped__() is IdGenerator
    monkeypatch.setattr(
        "snowflake_server._state.worker.generator_class", lambda _native=True: IdGenerator
    )
    clock = FakeClock(T0)
    worker = Worker.open(settings(tmp_path).worker, 3, clock=clock, sleep=clock.sleep)
    try:
        assert type(worker.generator) is IdGenerator and worker.native_state is None
        assert decompose(worker.generator.next_id()).worker_id == 3
    finally:
        worker.close()


@pytest.mark.skipif(native_core() is None, reason="the native core is not built")
def test_a_standalone_node_opens_its_native_state_until_the_worker_is_sealed(
    tmp_path: Path,
) -> None:
    server = settings(tmp_path, worker_id=6)
    closes: list[Callable[[], None]] = []
    clock = FakeClock(T0)
    mode = standalone(server, clock, closes.append, threading.Event())
    generator = mode.source
    assert isinstance(generator, NativeStateIdGenerator)
    state = generator.native_state
    assert state.gate_open and state.gate_until == math.inf, "no session to prove"
    fast = state.next_id(clock(), 0.0)
    assert fast is not None and decompose(fast).worker_id == 6
    for close in reversed(closes):
        close()
    assert state.sealed and state.next_id(clock(), 0.0) is None
