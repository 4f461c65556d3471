"""The state file: atomic, whole or not at all, strict about corruption, locked per worker,
in a directory of the server's own, never written through a link."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from pathlib import Path

import pytest
from snowflake_thrift_client import TWITTER_EPOCH_MS, Layout

from snowflake_server import ConfigurationError, ReservationError, StartupRefused
from snowflake_server._state.reservation import Reservation
from snowflake_server._state.statefile import StateFile, _unusable_dir

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


@pytest.mark.parametrize("where", ["file", "file/sub"])
def test_a_file_where_the_directory_should_be_is_a_configuration_error(
    tmp_path: Path, where: str
) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigurationError) as info:
        StateFile.open(tmp_path / where, 0, 0)
    message = str(info.value)
    assert f"cannot use state directory {tmp_path / where}: Not a directory" in message
    assert "a file is where a directory should be" in message and "--state-dir" in message


def test_a_directory_that_cannot_be_made_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "nowhere").symlink_to(tmp_path / "missing")  # a dangling link as a parent
    with pytest.raises(ConfigurationError, match=r"cannot use state directory .*File exists"):
        StateFile.open(tmp_path / "nowhere" / "sub", 0, 0)


def test_a_missing_state_dir_is_created_for_this_user_only(tmp_path: Path) -> None:
    StateFile.open(tmp_path / "a" / "b", 0, 0).close()
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_state_dir_is_a_configuration_error(tmp_path: Path, dangling: bool) -> None:
    real = tmp_path / "real"
    if not dangling:
        real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigurationError) as info:
        StateFile.open(tmp_path / "link", 0, 0)
    assert f"state directory {tmp_path / 'link'} is a symbolic link" in str(info.value)
    assert f"Give --state-dir the directory itself ({real})" in str(info.value)
    assert not (real / "worker-0-0.lock").exists()


@pytest.mark.parametrize(
    ("mode", "owner", "problem", "fix"),
    [
        (0o777, (0, 0), "every user may write to it", "chmod o-w"),
        (0o1777, (0, 0), "every user may write to it", "chmod o-w"),  # sticky, as /tmp
        (0o700, (10002, 0), "it belongs to another user (uid 10002)", "chown 0"),
        (0o2775, (10002, 10002), "it belongs to another user (uid 10002)", "chown 0"),
        (0o770, (0, 10002), "group 10002 may write to it and this server's user", "chmod g-w"),
    ],
)
def test_a_state_dir_others_may_write_to_is_a_configuration_error(
    tmp_path: Path, mode: int, owner: tuple[int, int], problem: str, fix: str
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: to give the directory to another user")
    directory = tmp_path / "state"
    directory.mkdir()
    os.chown(directory, *owner)
    directory.chmod(mode)
    with pytest.raises(ConfigurationError) as info:
        StateFile.open(directory, 0, 0)
    message = str(info.value)
    assert f"state directory {directory} is not this server's own: {problem}" in message
    assert f"owner uid {owner[0]}, group gid {owner[1]}, mode {mode:04o}" in message
    assert f"Fix: {fix} {directory}" in message and "this server runs as uid 0" in message
    assert not list(directory.iterdir()), "refused before creating anything in it"


def test_a_state_dir_of_root_and_this_user_s_group_is_accepted(tmp_path: Path) -> None:
    """The shape of a Kubernetes volume under fsGroup, as root sees it (the real thing,
    another uid: tests/acceptance/test_state_dir.py)."""
    directory = tmp_path / "state"
    directory.mkdir()
    directory.chmod(0o2775)
    os.chown(directory, 0, os.getegid())
    StateFile.open(directory, 0, 0).close()


def test_the_unusable_directory_messages_say_what_to_do(tmp_path: Path) -> None:
    """Errors root never meets in a test: their messages still say the fix."""
    denied = str(_unusable_dir(tmp_path, PermissionError(errno.EACCES, "Permission denied")))
    assert f"cannot use state directory {tmp_path}: Permission denied" in denied
    assert f"(chmod u+rwx {tmp_path})" in denied, "ours already: its mode is the fix"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 10002, 10002)
    denied = str(_unusable_dir(theirs, PermissionError(errno.EACCES, "Permission denied")))
    assert f"(chown {os.geteuid()}:{os.getegid()} {theirs})" in denied
    missing = tmp_path / "missing"
    denied = str(_unusable_dir(missing, PermissionError(errno.EACCES, "Permission denied")))
    assert f"(chown {os.geteuid()}:{os.getegid()} {missing})" in denied
    read_only = str(_unusable_dir(tmp_path, OSError(errno.EROFS, "Read-only file system")))
    assert read_only.endswith("Read-only file system; choose another --state-dir")


def test_a_symlinked_state_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    state = StateFile.open(tmp_path, 0, 0)
    state.load()
    state.advance(1000)
    state.close()
    victim = tmp_path / "elsewhere.json"
    (tmp_path / "worker-0-0.json").rename(victim)
    before = victim.read_bytes()
    (tmp_path / "worker-0-0.json").symlink_to(victim)
    for discard in (False, True):  # a link is no corrupt file: never discarded
        state = StateFile.open(tmp_path, 0, 0)
        try:
            with pytest.raises(ConfigurationError) as info:
                state.load(discard_corrupt=discard)
        finally:
            state.close()
        message = str(info.value)
        assert (
            f"state file {tmp_path / 'worker-0-0.json'} is a symbolic link (to {victim})" in message
        )
        assert "cp --remove-destination" in message
    assert victim.read_bytes() == before


def test_a_state_file_that_is_no_regular_file_is_a_refusal(tmp_path: Path) -> None:
    (tmp_path / "worker-0-0.json").mkdir()
    os.mkfifo(tmp_path / "worker-0-1.json")  # opened without blocking: no writer needed
    for worker_id in (0, 1):
        state = StateFile.open(tmp_path, 0, worker_id)
        with pytest.raises(StartupRefused, match="unusable: not a regular file"):
            state.load()
        assert state.load(discard_corrupt=True) is None
        state.close()


def test_a_state_file_that_cannot_be_opened_is_a_refusal(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:  # open(2) of a socket: ENXIO
        sock.bind(str(tmp_path / "worker-0-0.json"))
        state = StateFile.open(tmp_path, 0, 0)
        with pytest.raises(StartupRefused, match="cannot read it: No such device or address"):
            state.load()
        state.close()


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_a_lock_file_that_is_no_regular_file_is_a_configuration_error(
    tmp_path: Path, kind: str
) -> None:
    lock = tmp_path / "worker-0-0.lock"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(ConfigurationError) as info:
        StateFile.open(tmp_path, 0, 0)
    assert f"lock file {lock}" in str(info.value)
    assert f"remove it (rm -r {lock}) and the server creates its own" in str(info.value)
    assert victim.read_text() == "precious"


def test_a_planted_tmp_link_is_removed_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "worker-0-0.json.tmp").symlink_to(victim)
    state = StateFile.open(tmp_path, 0, 0)
    state.load()
    assert state.advance(1000) == 1000
    state.close()
    assert victim.read_text() == "precious"
    assert json.loads((tmp_path / "worker-0-0.json").read_text())["high_water_mark_ms"] == 1000
    assert not (tmp_path / "worker-0-0.json.tmp").exists()


def test_a_tmp_name_that_cannot_be_cleared_fails_the_write(tmp_path: Path) -> None:
    state = StateFile.open(tmp_path, 0, 0)
    state.load()
    state.advance(1000)
    (tmp_path / "worker-0-0.json.tmp").mkdir()
    with pytest.raises(OSError, match="Is a directory"):
        state.advance(2000)
    assert state.mark_ms == 1000 and state.write_errors == 1
    state.close()


class ShortWrites:
    """An ``os.write`` that stores at most ``each`` bytes per call, and fails (``error``)
    or stores nothing once ``limit`` bytes are written: a file-size limit, a full disk."""

    def __init__(self, each: int, limit: int | None = None, error: int | None = None) -> None:
        self.each, self.limit, self.error = each, limit, error
        self.written = 0

    def __call__(self, fd: int, data: memoryview) -> int:
        room = len(data) if self.limit is None else self.limit - self.written
        if room <= 0:
            if self.error is not None:
                raise OSError(self.error, os.strerror(self.error))
            return 0
        written = os.write(fd, data[: min(self.each, room)])
        self.written += written
        return written


def test_short_writes_are_carried_on_until_the_whole_record_is_stored(tmp_path: Path) -> None:
    state = StateFile.open(tmp_path, 0, 0)
    state.load()
    state.writer = ShortWrites(each=7)
    assert state.advance(1000) == 1000
    state.close()
    again = StateFile.open(tmp_path, 0, 0)
    assert again.load() == 1000
    again.close()


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (errno.EFBIG, "File too large"),
        (errno.ENOSPC, "No space left on device"),
        (errno.EIO, "Input/output error"),
        (None, "a write stored nothing"),
    ],
)
def test_a_write_cut_short_fails_and_leaves_the_good_file(
    tmp_path: Path, error: int | None, said: str
) -> None:
    """The issue: a file cut at 120 bytes was renamed over the good one, and the
    next start refused it (exit 3)."""
    state = StateFile.open(tmp_path, 0, 0)
    state.load()
    state.advance(1000)
    good = (tmp_path / "worker-0-0.json").read_bytes()
    state.writer = ShortWrites(each=4096, limit=120, error=error)
    with pytest.raises(OSError, match="the state file is unchanged") as info:
        state.advance(2000)
    assert said in str(info.value)
    assert (tmp_path / "worker-0-0.json").read_bytes() == good
    assert not (tmp_path / "worker-0-0.json.tmp").exists()
    assert state.mark_ms == 1000 and (state.writes, state.write_errors) == (1, 1)
    state.close()
    again = StateFile.open(tmp_path, 0, 0)
    assert again.load() == 1000
    again.close()


def test_a_short_write_fails_the_reservation_and_says_why(tmp_path: Path) -> None:
    """What /readyz and the calls past the reserved mark report (worker.py:
    ``unavailable_reason``)."""
    now = 1_700_000_000_000
    state = StateFile.open(tmp_path, 0, 0)
    state.load()
    reservation = Reservation([(state, 1000)], lambda: now)
    assert reservation.reserve(now) == now + 1000
    state.writer = ShortWrites(each=4096, limit=120, error=errno.EFBIG)
    with pytest.raises(ReservationError, match="File too large") as info:
        reservation.reserve(now + 2000)
    assert f"cannot write the high-water mark to {tmp_path / 'worker-0-0.json'}" in str(info.value)
    assert reservation.failing is not None and "File too large" in reservation.failing
    state.close()
    again = StateFile.open(tmp_path, 0, 0)
    assert again.load() == now + 1000, "the good mark stays"
    again.close()


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
