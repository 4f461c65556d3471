"""Black-box regression tests for issue 16: an operator's wrong setting must not
hand out an id twice. Real server processes; the clock moved by libfaketime.

- the same worker id twice on one host, with different state directories;
- the id layout (epoch, widths) changed between runs on one state file;
- the state directory lost, and the clock behind.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
from snowflake_thrift_client import TWITTER_EPOCH_MS

from tests.support.endpoints import Endpoints, take_ids, unique_scope
from tests.support.processes import (
    FakeTime,
    ServerDidNotStart,
    ServerProcess,
    parse_metrics,
    start_server,
)

pytestmark = [pytest.mark.slow]  # restarts, and a real first-start wait


def take(server: Endpoints, rounds: int = 20, batch: int = 100) -> list[int]:
    return take_ids(server, rounds, batch, "operator-mistakes")


def repeats(later: list[int], earlier: list[int]) -> str:
    """What went wrong, said as the issue said it."""
    lower = sum(1 for i in later if i <= max(earlier))
    return (
        f"{lower} of {len(later)} new ids were not above the last run's, "
        f"{len(set(later) & set(earlier))} were exact repeats"
    )


def started_anyway(server: ServerProcess, others: list[int]) -> str:
    """The second server should have been refused: show the harm, stop it."""
    try:
        ids = take(server)
    finally:
        server.stop()
    return f"it started: {repeats(ids, others)}\n{server.log()}"


def both_serve(first: ServerProcess, second: ServerProcess) -> str:
    """Two servers of one worker id, asked in turn: the ids both issued. Stops ``second``."""
    try:
        clients = [first.raw_client(), second.raw_client()]
        issued: list[set[int]] = [set(), set()]
        for _ in range(50):
            for client, ids in zip(clients, issued, strict=True):
                ids.update(client.get_ids("operator-mistakes", 100))
    finally:
        second.stop()
    both = len(issued[0] & issued[1])
    return f"{both} of {len(issued[0] | issued[1])} ids were issued by both\n{second.log()}"


# -- item 1: one worker id, two state directories -----------------------------------


def test_a_second_server_with_the_worker_id_in_another_state_dir_is_refused(
    tmp_path: Path,
) -> None:
    """Another user, $HOME or $XDG_STATE_HOME: the state file's lock is elsewhere,
    the host lock is not."""
    scope = unique_scope()  # both servers share it, as two real ones share "" (the default)
    args = ("--datacenter-id", "2", "--worker-id", "7")
    first = start_server(*args, state_dir=tmp_path / "alice", lock_scope=scope)
    try:
        before = take(first)
        try:
            second = start_server(*args, state_dir=tmp_path / "bob", lock_scope=scope)
        except ServerDidNotStart as refused:
            assert refused.returncode == 3, refused.log
            assert "another process on this host is serving datacenter 2, worker 7" in refused.log
            assert "whatever its --state-dir" in refused.log
        else:
            pytest.fail(f"the second server with worker 7 started: {both_serve(first, second)}")
        assert not (tmp_path / "bob" / "worker-2-7.json").exists(), "refused before any mark"
        assert len(set(take(first) + before)) == 2 * len(before), "the first serves on"
        # Another worker id is no conflict.
        start_server(*args[:2], "--worker-id", "8", lock_scope=scope).stop()
    finally:
        assert first.stop() == 0, first.log()
    # Released when its holder stopped: the same worker starts from the other directory.
    again = start_server(*args, state_dir=tmp_path / "bob", lock_scope=scope)
    assert again.stop() == 0, again.log()


def test_the_host_lock_is_released_by_a_crash(tmp_path: Path) -> None:
    scope = unique_scope()
    first = start_server("--worker-id", "4", state_dir=tmp_path / "a", lock_scope=scope)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    again = start_server("--worker-id", "4", state_dir=tmp_path / "b", lock_scope=scope)
    assert again.stop() == 0, again.log()


# -- item 2: the layout changed under one state file --------------------------------


def test_a_moved_epoch_is_refused_until_the_layout_is_restored(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    first = start_server(state_dir=state_dir)
    before = take(first)
    assert first.stop() == 0, first.log()
    moved = str(TWITTER_EPOCH_MS + 4477)  # the 4,477 ms: every new id lower
    try:
        second = start_server("--epoch", moved, state_dir=state_dir)
    except ServerDidNotStart as refused:
        assert refused.returncode == 3, refused.log
        log = refused.log
        assert "was written under another id layout" in log
        assert f"(epoch_ms {TWITTER_EPOCH_MS}, timestamp_bits 41" in log, "the recorded one"
        assert f"than this server's (epoch_ms {moved}, timestamp_bits 41" in log, "and ours"
        assert "--worker-id" in log and "move the state file away" in log, "what to do"
    else:
        pytest.fail(f"the moved epoch: {started_anyway(second, before)}")
    # The recorded layout starts again and carries on above the old ids.
    restored = start_server("--epoch", str(TWITTER_EPOCH_MS), state_dir=state_dir)
    try:
        after = take(restored)
        assert min(after) > max(before), repeats(after, before)
    finally:
        assert restored.stop() == 0, restored.log()


def test_a_state_file_of_0_1_0_is_upgraded_not_refused(tmp_path: Path) -> None:
    """0.1.0 wrote format 1, without the layout: taken as the current layout."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    mark = int(time.time() * 1000) - 60_000  # a clean stop a minute ago
    old = {"format": 1, "datacenter_id": 0, "worker_id": 0, "high_water_mark_ms": mark}
    (state_dir / "worker-0-0.json").write_text(json.dumps(old) + "\n")
    server = start_server(state_dir=state_dir)
    try:
        assert "records no id layout (format 1, from 0.1.0)" in server.log()
        take(server, rounds=1)
    finally:
        assert server.stop() == 0, server.log()
    data = json.loads((state_dir / "worker-0-0.json").read_text())
    assert data["format"] == 2 and data["layout"]["epoch_ms"] == TWITTER_EPOCH_MS
    assert data["high_water_mark_ms"] > mark


# -- item 4: the state directory lost, the clock behind -----------------------------


def test_a_lost_state_dir_with_the_clock_2_s_behind_repeats_nothing(tmp_path: Path) -> None:
    faketime = FakeTime(tmp_path)
    state_dir = tmp_path / "state"
    first = start_server(state_dir=state_dir, env=faketime.env)
    before = take(first)
    assert first.stop() == 0, first.log()
    shutil.rmtree(state_dir)  # tmpfs after a reboot, or a new container
    faketime.set("-2")
    started = time.monotonic()
    second = start_server(
        "--first-start-wait", "3", state_dir=state_dir, env=faketime.env, timeout_s=30
    )
    try:
        waited = time.monotonic() - started
        after = take(second)
        assert min(after) > max(before), repeats(after, before)
        assert waited >= 3, "the first-start wait came before the ready line"
        log = second.log()
        assert "WARNING" in log and "no high-water mark for worker 0 anywhere" in log
        assert "waiting --first-start-wait 3 s" in log
        assert parse_metrics(second.metrics())["snowflake_first_starts_total"] == 1
    finally:
        assert second.stop() == 0, second.log()
    # The next start finds the mark: no first-start wait, however long it is set.
    faketime.set("+0")
    third = start_server("--first-start-wait", "60", state_dir=state_dir, env=faketime.env)
    try:
        assert parse_metrics(third.metrics())["snowflake_first_starts_total"] == 0
        assert min(take(third)) > max(after)
    finally:
        assert third.stop() == 0, third.log()
