"""The state file: atomic, strict about corruption, locked per worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from snowflake_thrift_client import TWITTER_EPOCH_MS, Layout

from snowflake_server import StartupRefused
from snowflake_server._state.statefile import StateFile, default_state_dir

TWITTER = {
    "epoch_ms": TWITTER_EPOCH_MS,
    "timestamp_bits": 41,
    "datacenter_id_bits": 5,
    "worker_id_bits": 5,
    "sequence_bits": 12,
}


def test_first_start_then_marks_survive_reopening(tmp_path: Path) -> None:
    state = StateFile.open(tmp_path, 1, 2)
    assert state.load() is None
    assert state.advance(1000) == 1000
    assert state.advance(900) == 1000, "a mark never moves back while serving"
    state.close()
    again = StateFile.open(tmp_path, 1, 2)
    assert again.load() == 1000
    again.finish(950)  # after the generator is sealed the exact mark may be lower
    again.close()
    data = json.loads((tmp_path / "worker-1-2.json").read_text())
    assert data == {
        "format": 2,
        "datacenter_id": 1,
        "worker_id": 2,
        "layout": TWITTER,
        "high_water_mark_ms": 950,
    }


def test_one_process_per_worker(tmp_path: Path) -> None:
    held = StateFile.open(tmp_path, 0, 7)
    with pytest.raises(StartupRefused, match="serving datacenter 0, worker 7 from this state dir"):
        StateFile.open(tmp_path, 0, 7)
    StateFile.open(tmp_path, 0, 8).close()  # another worker is fine
    held.close()
    StateFile.open(tmp_path, 0, 7).close()  # released


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("", "not a state file"),
        ("{not json", "not a state file"),
        ("[]", "not a state file"),
        ('{"format": 1, "datacenter_id": 0, "worker_id": 0}', "not a state file"),
        ('{"format": 4, "datacenter_id": 0, "worker_id": 0, "high_water_mark_ms": 5}', "format"),
        ('{"format": 1, "datacenter_id": 0, "worker_id": 1, "high_water_mark_ms": 5}', "another"),
        ('{"format": 1, "datacenter_id": 0, "worker_id": 0, "high_water_mark_ms": "5"}', "bad"),
        ('{"format": 1, "datacenter_id": 0, "worker_id": 0, "high_water_mark_ms": -1}', "bad"),
        # format 2 records the layout: it must be there, and whole
        ('{"format": 2, "datacenter_id": 0, "worker_id": 0, "high_water_mark_ms": 5}', "layout"),
        ('{"format": 2, "datacenter_id": 0, "worker_id": 0, "layout": {"epoch_ms": 1}, '
         '"high_water_mark_ms": 5}', "bad layout"),
        ('{"format": 2, "datacenter_id": 0, "worker_id": 0, "layout": [], '
         '"high_water_mark_ms": 5}', "bad layout"),
        ('{"format": 2, "datacenter_id": 0, "worker_id": 0, "layout": '
         + json.dumps({**TWITTER, "sequence_bits": "12"})
         + ', "high_water_mark_ms": 5}', "bad layout"),
    ],
)  # fmt: skip
def test_a_corrupt_file_is_a_refusal_not_a_reset(tmp_path: Path, content: str, why: str) -> None:
    (tmp_path / "worker-0-0.json").write_text(content)
    state = StateFile.open(tmp_path, 0, 0)
    with pytest.raises(StartupRefused, match=why) as info:
        state.load()
    assert "--discard-corrupt-state" in str(info.value)
    assert state.load(discard_corrupt=True) is None
    state.close()


def write_state(directory: Path, record: dict[str, object]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "worker-0-0.json").write_text(json.dumps(record))


def test_a_format_1_file_is_taken_as_the_current_layout_and_rewritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """0.1.0 recorded no layout: an upgrade must not refuse to start."""
    write_state(
        tmp_path, {"format": 1, "datacenter_id": 0, "worker_id": 0, "high_water_mark_ms": 5000}
    )
    layout = Layout(epoch_ms=1000, sequence_bits=10)
    state = StateFile.open(tmp_path, 0, 0, layout)
    try:
        assert state.load() == 5000
        assert "records no id layout (format 1, from 0.1.0)" in caplog.text
        assert "epoch_ms 1000" in caplog.text and "sequence_bits 10" in caplog.text
        state.advance(6000)
    finally:
        state.close()
    data = json.loads((tmp_path / "worker-0-0.json").read_text())
    assert data["format"] == 2 and data["high_water_mark_ms"] == 6000
    assert data["layout"] == {**TWITTER, "epoch_ms": 1000, "sequence_bits": 10}
    again = StateFile.open(tmp_path, 0, 0, layout)
    try:
        assert again.load() == 6000, "its own layout, recorded: accepted"
    finally:
        again.close()


@pytest.mark.parametrize(
    "change",
    [
        {"epoch_ms": TWITTER_EPOCH_MS + 4477},
        {"epoch_ms": TWITTER_EPOCH_MS - 1},
        {"timestamp_bits": 40},
        {"datacenter_id_bits": 4, "worker_id_bits": 6},
        {"sequence_bits": 11},
    ],
)
def test_a_file_of_another_layout_is_refused_even_with_discard_corrupt(
    tmp_path: Path, change: dict[str, int]
) -> None:
    write_state(
        tmp_path,
        {
            "format": 2,
            "datacenter_id": 0,
            "worker_id": 0,
            "layout": TWITTER,
            "high_water_mark_ms": 5000,
        },
    )
    state = StateFile.open(tmp_path, 0, 0, Layout(**change))
    try:
        for discard in (False, True):  # not corrupt: discarding it would repeat ids
            with pytest.raises(StartupRefused) as info:
                state.load(discard_corrupt=discard)
            message = str(info.value)
            assert "was written under another id layout" in message
            assert f"(epoch_ms {TWITTER_EPOCH_MS}, timestamp_bits 41," in message
            changed = ", ".join(f"{k} {v}" for k, v in change.items())
            assert changed in message.split("than this server's")[1], "both layouts named"
            assert "--worker-id" in message and "move the state file away" in message
    finally:
        state.close()


def test_an_unreadable_file_is_a_refusal(tmp_path: Path) -> None:
    (tmp_path / "worker-0-0.json").write_bytes(b"\xff\xfe garbage")
    state = StateFile.open(tmp_path, 0, 0)
    with pytest.raises(StartupRefused, match="cannot read it"):
        state.load()
    state.close()


def test_an_unusable_directory_is_a_refusal(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StartupRefused, match="cannot use state directory"):
        StateFile.open(blocker / "sub", 0, 0)


def test_default_dir_follows_xdg() -> None:
    assert default_state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/snowflake")
    assert default_state_dir({"HOME": "/home/u"}) == Path("/home/u/.local/state/snowflake")


_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from snowflake_server._state.statefile import StateFile
    state = StateFile.open(Path(sys.argv[1]), 0, 0)
    mark = 0
    while True:
        mark += 1
        state.advance(mark)
        print(mark, flush=True)
    """
)


@pytest.mark.slow  # 15 real processes killed mid-write
def test_a_crash_at_any_instant_leaves_a_whole_file(tmp_path: Path) -> None:
    for round_ in range(15):
        directory = tmp_path / str(round_)
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(directory)], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout is not None
        confirmed = 0
        for line in writer.stdout:  # a varying number of writes before the kill
            confirmed = int(line)
            if confirmed >= 5 + round_ * 7:
                break
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        state = StateFile.open(directory, 0, 0)
        stored = state.load()  # must parse: never torn
        state.close()
        assert stored is not None and stored >= confirmed


CLOCK_LAYOUT = Layout(datacenter_id_bits=3, clock_sequence_bits=2)


def test_a_clock_sequence_keeps_a_mark_per_value_in_format_3(tmp_path: Path) -> None:
    state = StateFile.open(tmp_path, 1, 2, CLOCK_LAYOUT)
    assert state.load() is None and state.marks == (-1, -1, -1, -1)
    assert state.advance(1000) == 1000
    assert state.advance(400, clock_sequence=2) == 400, "another value's own mark"
    assert state.clock_sequence == 0, "only a move names the value in use"
    assert state.advance(300, clock_sequence=2, switching=True) == 400, "never back"
    assert (state.clock_sequence, state.mark_ms) == (2, 400)
    state.close()
    again = StateFile.open(tmp_path, 1, 2, CLOCK_LAYOUT)
    assert again.load() == 1000, "the newest of the marks"
    assert (again.marks, again.clock_sequence) == ((1000, -1, 400, -1), 2)
    again.finish(350, clock_sequence=2)
    again.close()
    data = json.loads((tmp_path / "worker-1-2.json").read_text())
    assert data == {
        "format": 3,
        "datacenter_id": 1,
        "worker_id": 2,
        "layout": {**TWITTER, "datacenter_id_bits": 3, "clock_sequence_bits": 2},
        "high_water_mark_ms": 1000,
        "clock_sequence": 2,
        "high_water_marks_ms": [1000, -1, 350, -1],
    }


@pytest.mark.parametrize(
    ("marks", "in_use"),
    [
        ("[1000, -1, 400]", 0),  # one value short for the layout
        ("[999, -1, 400, -1]", 0),  # the newest is not high_water_mark_ms
        ('[1000, "x", 400, -1]', 0),
        ("[1000, -2, 400, -1]", 0),
        ("[]", 0),
        ("[1000, -1, 400, -1]", 4),
        ("[1000, -1, 400, -1]", '"1"'),
    ],
)
def test_bad_clock_sequence_marks_are_a_refusal(tmp_path: Path, marks: str, in_use: object) -> None:
    layout = json.dumps({**TWITTER, "datacenter_id_bits": 3, "clock_sequence_bits": 2})
    (tmp_path / "worker-0-0.json").write_text(
        f'{{"format": 3, "datacenter_id": 0, "worker_id": 0, "layout": {layout}, '
        f'"high_water_mark_ms": 1000, "clock_sequence": {in_use}, '
        f'"high_water_marks_ms": {marks}}}'
    )
    state = StateFile.open(tmp_path, 0, 0, CLOCK_LAYOUT)
    with pytest.raises(StartupRefused, match=r"clock-sequence marks|is unusable"):
        state.load()
    assert state.load(discard_corrupt=True) is None
    state.close()


def test_a_layout_without_a_clock_sequence_still_writes_format_2(tmp_path: Path) -> None:
    # An older server can read it: the layout has no clock_sequence_bits key at all.
    state = StateFile.open(tmp_path, 0, 0)
    state.advance(5)
    state.close()
    data = json.loads((tmp_path / "worker-0-0.json").read_text())
    assert data["format"] == 2 and "clock_sequence_bits" not in data["layout"]
    assert "high_water_marks_ms" not in data
    with pytest.raises(StartupRefused, match="written under another id layout"):
        StateFile.open(tmp_path, 0, 0, CLOCK_LAYOUT).load()


def test_a_format_1_mark_is_the_first_clock_sequence_value_s(tmp_path: Path) -> None:
    (tmp_path / "worker-0-0.json").write_text(
        '{"format": 1, "datacenter_id": 0, "worker_id": 0, "high_water_mark_ms": 5000}'
    )
    state = StateFile.open(tmp_path, 0, 0, CLOCK_LAYOUT)
    assert state.load() == 5000
    assert (state.marks, state.clock_sequence) == ((5000, -1, -1, -1), 0)
    state.close()
