"""The reserved high-water mark and the start-up wait, under a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from snowflake_server import (
    GeneratorSettings,
    IdGenerator,
    ReservationError,
    StartupRefused,
    decompose,
)
from snowflake_server._state.reservation import Reservation, wait_for_clock
from snowflake_server._state.statefile import StateFile
from tests.support.fakes import FakeClock

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
    reservation.finish(generator, floor_ms=-1)
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
