"""Black-box clock-sequence tests: the real server under libfaketime, stepped back while
serving and restarted behind its marks, with ``--clock-sequence-bits 2``.

Each scenario prints one ``CLOCK-SEQUENCE`` line (ids, errors, switches) for the record:
``pytest -s tests/acceptance/test_clock_steps_back.py | grep CLOCK-SEQUENCE``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from snowflake_thrift_client import Layout
from snowflake_thrift_client._idl import snowflake_thrift

from tests.support.endpoints import Endpoints, take_ids
from tests.support.processes import FakeTime, ServerProcess, failures, parse_metrics, start_server

pytestmark = [pytest.mark.slow]

thrift = snowflake_thrift()

LAYOUT = Layout(datacenter_id_bits=3, clock_sequence_bits=2)
FLAGS = ("--datacenter-id-bits", "3", "--clock-sequence-bits", "2")


@pytest.fixture
def faketime(tmp_path: Path) -> FakeTime:
    return FakeTime(tmp_path)


def take(server: Endpoints, rounds: int = 20, batch: int = 100) -> list[int]:
    """Ids in batches and singles; any InvalidSystemClock fails the test."""
    ids = take_ids(server, rounds, batch, "clock-sequence")
    client = server.raw_client()
    ids.extend(client.get_id("clock-sequence") for _ in range(rounds))
    return ids


def report(scenario: str, server: ServerProcess, ids: list[int]) -> dict[str, float]:
    counts = parse_metrics(server.metrics())
    errors = failures(counts, "invalid_system_clock")
    switches = counts["snowflake_clock_sequence_switches_total"]
    print(
        f"CLOCK-SEQUENCE {scenario}: {len(ids)} ids, {len(set(ids))} distinct, "
        f"{errors:g} InvalidSystemClock errors, {switches:g} clock-sequence switches, "
        f"clock sequence now {counts['snowflake_clock_sequence']:g}"
    )
    return counts


def test_steps_of_2_s_and_60_s_back_while_serving_refuse_nothing_and_repeat_nothing(
    faketime: FakeTime, tmp_path: Path
) -> None:
    server = start_server(*FLAGS, state_dir=tmp_path / "state", env=faketime.env)
    try:
        ids = take(server)
        faketime.set("-2")
        after_2s = take(server)
        assert {LAYOUT.decompose(i).clock_sequence for i in after_2s} == {1}
        faketime.set("-62")
        after_60s = take(server)
        assert {LAYOUT.decompose(i).clock_sequence for i in after_60s} == {2}
        ids += after_2s + after_60s
        counts = report("2 s then 60 s back while serving", server, ids)
        assert len(set(ids)) == len(ids), "no id twice"
        assert counts["snowflake_clock_sequence_switches_total"] == 2
        assert failures(counts, "invalid_system_clock") == 0
        assert counts['snowflake_clock_backwards_total{action="refused"}'] == 0
        assert counts["snowflake_clock_sequence"] == 2
        assert "moving from clock sequence 0 to 1" in server.log()
        # Moved to before any id used them: the state file names value 2, marked ahead.
        state = json.loads((tmp_path / "state" / "worker-0-0.json").read_text())
        newest = max(LAYOUT.decompose(i).timestamp_ms for i in after_60s)
        assert state["clock_sequence"] == 2 and state["high_water_marks_ms"][2] >= newest
    finally:
        assert server.stop() == 0, server.log()
    state = json.loads((tmp_path / "state" / "worker-0-0.json").read_text())
    assert state["high_water_marks_ms"][2] == newest, "a clean stop writes the exact mark"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_a_restart_60_s_behind_serves_at_once_with_another_value(
    faketime: FakeTime, tmp_path: Path, stop: int
) -> None:
    state_dir = tmp_path / "state"
    first = start_server(*FLAGS, state_dir=state_dir, env=faketime.env)
    before = take(first)
    first.stop(stop)
    faketime.set("-60")
    second = start_server(*FLAGS, "--max-startup-wait", "0", state_dir=state_dir, env=faketime.env)
    try:
        after = take(second)
        ids = before + after
        counts = report(f"a restart 60 s behind after {signal.Signals(stop).name}", second, ids)
        assert len(set(ids)) == len(ids), "no id twice"
        assert {LAYOUT.decompose(i).clock_sequence for i in after} == {1}
        assert counts["snowflake_startup_clock_wait_seconds"] == 0, "no wait"
        assert counts["snowflake_clock_sequence_switches_total"] == 1
        assert failures(counts, "invalid_system_clock") == 0
        assert "starting with clock sequence 1" in second.log()
    finally:
        assert second.stop() == 0, second.log()


def test_without_a_clock_sequence_the_same_step_is_refused(
    faketime: FakeTime, tmp_path: Path
) -> None:
    """The contrast: the default layout refuses while the clock is behind."""
    server = start_server(state_dir=tmp_path / "state", env=faketime.env)
    try:
        take(server, rounds=2)
        faketime.set("-60")
        with pytest.raises(thrift.InvalidSystemClock):
            server.raw_client().get_id("clock-sequence")
    finally:
        assert server.stop() == 0, server.log()
