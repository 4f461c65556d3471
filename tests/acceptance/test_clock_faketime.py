"""Black-box clock tests: the real server process under libfaketime.

libfaketime fakes only the server's wall clock (CLOCK_REALTIME); the offset
is read from a file on every call, so a test steps the clock back or forward
while the server runs. In every scenario: no id twice, and none lower than an
id issued before.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from snowflake_thrift_client._idl import snowflake_thrift

from tests.support.endpoints import Endpoints, take_ids
from tests.support.processes import (
    FakeTime,
    ServerDidNotStart,
    ServerProcess,
    failures,
    parse_metrics,
    start_server,
)

pytestmark = [pytest.mark.slow]

thrift = snowflake_thrift()


@pytest.fixture
def faketime(tmp_path: Path) -> FakeTime:
    return FakeTime(tmp_path)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def timed_server(faketime: FakeTime, state_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(state_dir=state_dir, env=faketime.env)
    yield server
    assert server.stop() == 0, server.log()


def take(server: Endpoints, rounds: int = 50, batch: int = 100) -> list[int]:
    return take_ids(server, rounds, batch, "clock-test")


def assert_after(later: list[int], earlier: list[int]) -> None:
    assert later == sorted(later) and len(set(later)) == len(later)
    assert min(later) > max(earlier), "no id lower than one issued before"


def test_a_few_ms_back_are_waited_out(faketime: FakeTime, state_dir: Path) -> None:
    server = start_server("--max-backwards-ms", "100", state_dir=state_dir, env=faketime.env)
    try:
        client = server.raw_client()
        ids = [client.get_id("clock-test") for _ in range(100)]
        # Step back 40 ms at a time, between two calls: each step finds the clock behind
        # the last id by up to 40 ms (less the time between the calls, which a busy
        # machine makes longer), within the 100 ms tolerance; a wait over a ms runs on a
        # worker thread.
        for step in range(1, 11):
            faketime.set(f"-{0.040 * step:.3f}")
            ids.extend(client.get_id("clock-test") for _ in range(20))
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        counts = parse_metrics(server.metrics())
        assert counts['snowflake_clock_backwards_total{action="waited"}'] >= 1
        assert counts['snowflake_clock_backwards_total{action="refused"}'] == 0
        assert failures(counts, "invalid_system_clock") == 0
    finally:
        assert server.stop() == 0, server.log()


def test_two_seconds_back_is_refused_then_recovers(
    timed_server: ServerProcess, faketime: FakeTime
) -> None:
    client = timed_server.raw_client()
    before = take(timed_server)
    faketime.set("-2")
    refusals = 0
    after: list[int] = []
    deadline = time.monotonic() + 10
    while not after and time.monotonic() < deadline:
        try:
            after = client.get_ids("clock-test", 100)
        except thrift.InvalidSystemClock as e:
            assert "Clock moved backwards.  Refusing to generate id for" in e.message
            behind = int(e.message.split("for ")[1].split(" ")[0])
            assert 0 < behind <= 2000
            refusals += 1
            time.sleep(0.05)  # a client retrying while the (faked) clock is behind
    assert refusals >= 1 and after, "refused while behind, served once past the last id"
    after += take(timed_server)
    assert_after(after, before)
    counts = parse_metrics(timed_server.metrics())
    assert counts['snowflake_clock_backwards_total{action="refused"}'] == refusals
    assert failures(counts, "invalid_system_clock") == refusals


def test_restart_with_the_clock_5_s_behind_waits(faketime: FakeTime, state_dir: Path) -> None:
    first = start_server(state_dir=state_dir, env=faketime.env)
    before = take(first)
    # A crash: the mark on disk is the reservation, up to 1 s past the last id.
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    faketime.set("-5")
    started = time.monotonic()
    second = start_server(state_dir=state_dir, env=faketime.env, timeout_s=30)
    try:
        assert time.monotonic() - started > 4.5, "it waited for the clock"
        assert "behind the high-water mark" in second.log()
        after = take(second)
        assert_after(after, before)
        wait = parse_metrics(second.metrics())["snowflake_startup_clock_wait_seconds"]
        # 5 s behind, plus up to 1 s of reservation, less the time from the last id
        # to the check at start-up (a slow interpreter start on a busy machine).
        assert 3.0 < wait < 6.5
    finally:
        assert second.stop() == 0


def test_restart_with_the_clock_60_s_behind_is_refused(faketime: FakeTime, state_dir: Path) -> None:
    first = start_server(state_dir=state_dir, env=faketime.env)
    before = take(first)
    assert first.stop() == 0
    faketime.set("-60")
    with pytest.raises(ServerDidNotStart) as info:
        start_server(state_dir=state_dir, env=faketime.env)
    assert info.value.returncode == 3
    # 60 s back, less the time since the last id.
    behind = re.search(r"refusing to start: the clock is (5\d\.\d{3}) s behind", info.value.log)
    advice = re.search(r"--max-startup-wait (\d+) or more", info.value.log)
    assert behind and advice, info.value.log
    assert float(behind[1]) < int(advice[1]) <= 61, "the advice covers the whole gap"
    # Once the clock is fixed the worker starts and continues above its old ids.
    faketime.set("+0")
    fixed = start_server(state_dir=state_dir, env=faketime.env)
    try:
        assert_after(take(fixed), before)
    finally:
        assert fixed.stop() == 0


@pytest.mark.parametrize(("stop", "max_wait"), [(signal.SIGTERM, 0.0), (signal.SIGKILL, 1.05)])
def test_restart_with_a_healthy_clock_serves_within_1_s(
    faketime: FakeTime, state_dir: Path, stop: int, max_wait: float
) -> None:
    first = start_server(state_dir=state_dir, env=faketime.env)
    before = take(first, rounds=5)
    first.stop(stop)
    second = start_server(state_dir=state_dir, env=faketime.env)
    try:
        assert_after(take(second, rounds=5), before)
        wait = parse_metrics(second.metrics())["snowflake_startup_clock_wait_seconds"]
        # A clean stop writes the exact last timestamp; a crash leaves the 1 s reservation.
        assert wait <= max_wait
    finally:
        assert second.stop() == 0


def test_a_corrupt_state_file_is_refused_until_overridden(
    faketime: FakeTime, state_dir: Path
) -> None:
    first = start_server(state_dir=state_dir, env=faketime.env)
    before = take(first, rounds=5)
    assert first.stop() == 0
    (state_dir / "worker-0-0.json").write_text("{torn")
    with pytest.raises(ServerDidNotStart) as info:
        start_server(state_dir=state_dir, env=faketime.env)
    assert info.value.returncode == 3 and "--discard-corrupt-state" in info.value.log
    forced = start_server("--discard-corrupt-state", state_dir=state_dir, env=faketime.env)
    try:
        assert_after(take(forced, rounds=5), before)
    finally:
        assert forced.stop() == 0
