"""The generator under a fake clock: time is an input; its clock sequence (a rollback
moves to another value) too. Every test runs on both homes of the generator's state:
Python attributes (``IdGenerator``) and the native core's ``GeneratorState``
(``NativeStateIdGenerator``; skipped where the native core is not built)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snowflake_server import (
    TWITTER_EPOCH_MS,
    ClockMovedBackwardsError,
    ConfigurationError,
    GeneratorCounters,
    GeneratorSettings,
    IdGenerator,
    InvalidCountError,
    Layout,
    ReservationError,
    TimestampOverflowError,
    decompose,
)
from snowflake_server._ids.generator import (
    NativeStateIdGenerator,
    WouldBlock,
    forbid_waiting,
    pick_clock_sequence,
    waiting_forbidden,
)
from snowflake_server._native import native_core
from tests.support.fakes import FakeClock
from tests.support.waiting import run_in_thread

T0 = 1_700_000_000_000


@pytest.fixture(scope="module", autouse=True, params=["python", "native"])
def state_home(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test of this module once per home of the generator's state: ``IdGenerator``
    below is then the class of that home (module-scoped, which hypothesis allows)."""
    if request.param == "python":
        yield request.param
        return
    if native_core() is None:
        pytest.skip("the native core is not built")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(globals(), "IdGenerator", NativeStateIdGenerator)
        yield request.param


def make(clock: FakeClock, **kwargs: object) -> IdGenerator:
    return IdGenerator(GeneratorSettings(**kwargs), clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]


def test_same_ms_increments_the_sequence() -> None:
    clock = FakeClock(T0)
    gen = make(clock, datacenter_id=3, worker_id=7)
    parts = [decompose(gen.next_id()) for _ in range(3)]
    assert [p.sequence for p in parts] == [0, 1, 2]
    assert {(p.timestamp_ms, p.datacenter_id, p.worker_id) for p in parts} == {(T0, 3, 7)}


def test_new_ms_restarts_the_sequence() -> None:
    clock = FakeClock(T0)
    gen = make(clock)
    gen.next_id()
    gen.next_id()
    clock.now += 1
    part = decompose(gen.next_id())
    assert (part.timestamp_ms, part.sequence) == (T0 + 1, 0)


def test_a_full_ms_holds_4096_ids_then_waits_for_the_next() -> None:
    clock = FakeClock(T0)
    gen = make(clock)
    ids = [gen.next_id() for _ in range(4096)]
    assert [decompose(i).sequence for i in ids] == list(range(4096))
    assert clock.sleeps == [] and gen.sequence_exhausted_waits == 0
    wrapped = decompose(gen.next_id())
    assert (wrapped.timestamp_ms, wrapped.sequence) == (T0 + 1, 0)
    assert clock.sleeps, "the 4097th id must wait for the next ms"
    assert gen.sequence_exhausted_waits == 1
    assert wrapped.id > ids[-1]


def test_small_step_back_is_waited_out() -> None:
    clock = FakeClock(T0)
    gen = make(clock, max_backwards_ms=5)
    before = gen.next_id()
    clock.now -= 3
    after = gen.next_id()
    assert after > before
    assert decompose(after).timestamp_ms == T0
    assert sum(clock.sleeps) == pytest.approx(0.003)
    assert (gen.clock_backwards_waited, gen.clock_backwards_refused) == (1, 0)


def test_large_step_back_is_refused_without_touching_the_sequence() -> None:
    clock = FakeClock(T0)
    gen = make(clock, max_backwards_ms=5)
    gen.next_id()
    last = gen.next_id()
    clock.now -= 2000
    with pytest.raises(ClockMovedBackwardsError, match="for 2000 milliseconds") as info:
        gen.next_id()
    assert info.value.behind_ms == 2000
    assert clock.sleeps == []
    assert gen.clock_backwards_refused == 1
    # Back at the last ms: the sequence continues where it was, no duplicate.
    clock.now = T0
    assert gen.next_id() == last + 1


@pytest.mark.parametrize(
    ("tolerance", "behind", "waits"),
    [(5, 5, True), (5, 6, False), (0, 1, False), (0, 0, True), (100, 100, True)],
)
def test_tolerance_boundary(tolerance: int, behind: int, waits: bool) -> None:
    clock = FakeClock(T0)
    gen = make(clock, max_backwards_ms=tolerance)
    first = gen.next_id()
    clock.now -= behind
    if waits:
        assert gen.next_id() > first
    else:
        with pytest.raises(ClockMovedBackwardsError) as info:
            gen.next_id()
        assert info.value.behind_ms == behind


def test_clock_stepping_further_back_while_waiting_is_refused() -> None:
    clock = FakeClock(T0)

    def sleep_and_jump(seconds: float) -> None:
        clock.now -= 50

    gen = IdGenerator(GeneratorSettings(max_backwards_ms=5), clock=clock, sleep=sleep_and_jump)
    gen.next_id()
    clock.now -= 2
    with pytest.raises(ClockMovedBackwardsError):
        gen.next_id()


def test_next_ids_are_contiguous_within_a_ms_and_cross_into_the_next() -> None:
    clock = FakeClock(T0)
    gen = make(clock)
    for _ in range(4000):
        gen.next_id()
    ids = gen.next_ids(200)
    parts = [decompose(i) for i in ids]
    assert [p.sequence for p in parts] == [*range(4000, 4096), *range(104)]
    assert [p.timestamp_ms for p in parts] == [T0] * 96 + [T0 + 1] * 104
    assert ids == sorted(ids) and len(set(ids)) == 200
    assert gen.counters().ids_generated == 4200


def test_next_ids_full_batch_is_one_ms() -> None:
    clock = FakeClock(T0)
    gen = make(clock)
    ids = gen.next_ids(4096)
    assert ids == list(range(ids[0], ids[0] + 4096))
    assert decompose(ids[-1]).timestamp_ms == T0


@pytest.mark.parametrize("count", [0, -1, 4097, None, True, 2.0, "3"])
def test_next_ids_rejects_bad_counts(count: object) -> None:
    gen = make(FakeClock(T0))
    with pytest.raises(InvalidCountError, match=r"1\.\.4096"):
        gen.next_ids(count)  # type: ignore[arg-type]
    assert gen.counters().ids_generated == 0


def test_next_ids_max_follows_sequence_bits() -> None:
    layout = Layout(sequence_bits=4)
    gen = make(FakeClock(T0), layout=layout)
    assert len(gen.next_ids(16)) == 16
    with pytest.raises(InvalidCountError):
        gen.next_ids(17)


def test_epoch_in_the_future_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="in the future"):
        make(FakeClock(T0), layout=Layout(epoch_ms=T0 + 1000))


def test_exhausted_timestamp_bits() -> None:
    layout = Layout(epoch_ms=T0, timestamp_bits=10)
    with pytest.raises(ConfigurationError, match="ran out"):
        make(FakeClock(T0 + 1024), layout=layout)
    clock = FakeClock(T0 + 1023)
    gen = make(clock, layout=layout)
    gen.next_id()
    clock.now += 1
    with pytest.raises(TimestampOverflowError):
        gen.next_id()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"worker_id": 32}, r"worker_id must be in 0\.\.31, got 32"),
        ({"datacenter_id": -1}, r"datacenter_id must be in 0\.\.31"),
        ({"worker_id": True}, "must be an integer"),
        ({"max_backwards_ms": -1}, "max_backwards_ms"),
        ({"layout": "twitter"}, "must be a Layout"),
    ],
)
def test_settings_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        GeneratorSettings(**kwargs)  # type: ignore[arg-type]


def test_default_layout_is_twitters() -> None:
    gen = make(FakeClock(T0))
    layout = gen.settings.layout
    assert layout.epoch_ms == TWITTER_EPOCH_MS == 1288834974657
    assert (layout.timestamp_shift, layout.datacenter_id_shift, layout.worker_id_shift) == (
        22,
        17,
        12,
    )


def test_ids_are_unique_across_8_threads() -> None:
    gen = IdGenerator(GeneratorSettings(worker_id=1))
    per_thread: list[list[int]] = [[] for _ in range(8)]
    start = threading.Barrier(8)

    def work(out: list[int]) -> None:
        start.wait()
        out.extend(gen.next_id() for _ in range(50_000))

    threads = [threading.Thread(target=work, args=(out,)) for out in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_ids = [i for out in per_thread for i in out]
    assert len(all_ids) == 400_000
    assert len(set(all_ids)) == 400_000
    for out in per_thread:
        assert out == sorted(out), "each thread sees increasing ids"
    assert gen.counters().ids_generated == 400_000


# Any walk of the clock (forwards, small and large steps back) and any mix of
# single and batch calls: the ids that come out are unique and increasing.
_steps = st.lists(
    st.tuples(st.integers(min_value=-50, max_value=3), st.integers(min_value=0, max_value=5000)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(steps=_steps, tolerance=st.integers(min_value=0, max_value=10))
def test_ids_only_go_up_whatever_the_clock_does(
    steps: list[tuple[int, int]], tolerance: int
) -> None:
    clock = FakeClock(T0)
    gen = make(clock, max_backwards_ms=tolerance, layout=Layout(sequence_bits=6))
    issued: list[int] = []
    for move, n in steps:
        clock.now += move
        try:
            issued.extend(gen.next_ids(n % 64 + 1) if n % 2 else [gen.next_id()])
        except ClockMovedBackwardsError as e:
            assert e.behind_ms > tolerance
    assert issued == sorted(issued)
    assert len(set(issued)) == len(issued)


def _low_digit_counts(sequence_start: str, seed: int = 7) -> list[int]:
    """How often each value of id % 100 occurs over 10,000 ids, one per ms (low traffic)."""
    clock = FakeClock(T0)
    gen = IdGenerator(
        GeneratorSettings(sequence_start=sequence_start),  # type: ignore[arg-type]
        clock=clock,
        sleep=clock.sleep,
        randbelow=random.Random(seed).randrange,
    )
    counts = [0] * 100
    for _ in range(10_000):
        clock.now += 1
        counts[gen.next_id() % 100] += 1
    return counts


def _chi_square(counts: list[int]) -> float:
    expected = sum(counts) / len(counts)
    return sum((n - expected) ** 2 / expected for n in counts)


def test_zero_start_leaves_low_digits_lopsided() -> None:
    counts = _low_digit_counts("zero")
    # (ms << 22) % 100 is always a multiple of 4: three residues in four never occur.
    assert sum(1 for n in counts if n) == 25


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_start_spreads_low_digits_evenly(seed: int) -> None:
    counts = _low_digit_counts("random", seed)
    assert all(counts), "every value of id % 100 occurs"
    # 99 degrees of freedom: the 99.99th percentile of chi-square is about 160.
    assert _chi_square(counts) < 160, counts


def test_random_start_keeps_ids_unique_and_increasing() -> None:
    clock = FakeClock(T0)
    gen = make(clock, sequence_start="random")
    ids = []
    for _ in range(300):
        ids.extend(gen.next_ids(97))
        ids.append(gen.next_id())
        clock.now += 1
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    starts = {decompose(i).sequence for i in ids if decompose(i).sequence < 100}
    assert max(starts) < 100


def test_random_start_bound_shrinks_with_the_sequence_field() -> None:
    assert GeneratorSettings(sequence_start="random").random_start_bound == 100
    narrow = GeneratorSettings(layout=Layout(sequence_bits=4), sequence_start="random")
    assert narrow.random_start_bound == 8
    with pytest.raises(ConfigurationError, match="sequence_start"):
        GeneratorSettings(sequence_start="leaf")  # type: ignore[arg-type]


def test_resume_after_skips_the_used_ms() -> None:
    clock = FakeClock(T0)
    gen = IdGenerator(GeneratorSettings(), clock=clock, sleep=clock.sleep, resume_after_ms=T0)
    assert decompose(gen.next_id()).timestamp_ms == T0 + 1


def test_the_id_count_is_exact_through_batches_errors_and_sealing() -> None:
    clock = FakeClock(T0)
    gen = make(clock, sequence_start="random")
    gen.next_id()
    gen.next_ids(4096)  # crosses into the next ms
    clock.now += 5
    gen.next_ids(10)
    assert gen.counters().ids_generated == 4107
    clock.now -= 1000
    with pytest.raises(ClockMovedBackwardsError):
        gen.next_ids(3)
    assert gen.counters().ids_generated == 4107, "a refused batch hands out nothing"
    clock.now += 1000
    gen.seal()
    assert gen.counters().ids_generated == 4107, "sealing closes the ms without counting more"


def test_a_batch_cut_short_counts_only_what_it_returned() -> None:
    clock = FakeClock(T0)

    def jump_back(seconds: float) -> None:
        clock.now -= 60_000  # the clock steps back while the batch waits for the next ms

    gen = IdGenerator(GeneratorSettings(max_backwards_ms=5), clock=clock, sleep=jump_back)
    gen.next_ids(4000)
    with pytest.raises(ClockMovedBackwardsError):
        gen.next_ids(200)  # 96 fit this ms; the rest would need the next
    assert gen.counters().ids_generated == 4000


# A bound for what must happen at once: only reached when it does not (a hang).
PROMPTLY_S = 10.0
# How long a stand-in for a slow write holds on unless the test lets it go on: far
# longer than PROMPTLY_S, so a call that waits for the write shows as a hang.
HOLD_S = 60.0


def slow_reserve_generator() -> tuple[IdGenerator, threading.Event, threading.Event]:
    """A generator whose reserve() blocks (as a ZooKeeper write that takes seconds)
    until the second event is set; the first is set once a reserve() has begun."""
    clock = FakeClock(T0)
    entered, finish = threading.Event(), threading.Event()

    def slow_reserve(ms: int) -> int:
        entered.set()
        finish.wait(HOLD_S)
        return ms + 1000

    gen = IdGenerator(
        GeneratorSettings(), clock=clock, sleep=clock.sleep, ceiling_ms=T0 - 1,
        reserve=slow_reserve,
    )  # fmt: skip
    return gen, entered, finish


def test_a_slow_reserve_never_holds_the_lock() -> None:
    # The regression of issue 16, item 5: reserve() stands in for a ZooKeeper write
    # that takes seconds. It used to run under the generator's lock, so every call
    # behind it hung; now other calls go on, and those covered get ids at once.
    gen, entered, finish = slow_reserve_generator()
    passing, passed = run_in_thread(gen.next_id)
    assert entered.wait(PROMPTLY_S)
    try:
        # The renewal thread raises the ceiling meanwhile: that, and the calls it
        # covers, must not wait for the slow write.
        raiser, _ = run_in_thread(lambda: gen.raise_ceiling(T0 + 500))
        raiser.join(PROMPTLY_S)
        assert not raiser.is_alive(), "raise_ceiling waited for the slow reserve"
        covered, got = run_in_thread(gen.next_id)
        covered.join(PROMPTLY_S)
        assert not covered.is_alive(), "a covered call waited for the slow reserve"
        assert decompose(got[0]).timestamp_ms == T0  # type: ignore[arg-type]
        assert gen.counters().reservation_stalls == 1
    finally:
        finish.set()
        passing.join(PROMPTLY_S)
    assert isinstance(passed[0], int) and passed[0] != got[0]
    assert decompose(passed[0]).timestamp_ms == T0
    assert gen.counters().ids_generated == 2


def test_a_call_whose_ceilings_the_clock_keeps_passing_raises() -> None:
    clock = FakeClock(T0)

    def late_reserve(ms: int) -> int:
        clock.now += 5  # the write took 5 ms, and reserved no margin
        return ms

    gen = IdGenerator(
        GeneratorSettings(), clock=clock, sleep=clock.sleep, ceiling_ms=T0 - 1,
        reserve=late_reserve,
    )  # fmt: skip
    with pytest.raises(ReservationError, match=f"no high-water mark covers ms {T0 + 15} yet"):
        gen.next_id()
    assert gen.counters() == GeneratorCounters(reservation_stalls=3)


def test_a_ceiling_passed_again_before_the_call_resumes_is_asked_for_again() -> None:
    # Seen on a busy machine: the ceiling returned had just been passed when the call
    # took the lock back. The next ask waits for a fresh write, and the call succeeds.
    clock = FakeClock(T0)
    asked: list[int] = []

    def reserve(ms: int) -> int:
        asked.append(ms)
        clock.now += 36
        return ms if len(asked) == 1 else ms + 1000

    gen = IdGenerator(
        GeneratorSettings(), clock=clock, sleep=clock.sleep, ceiling_ms=T0 - 1,
        reserve=reserve,
    )  # fmt: skip
    assert decompose(gen.next_id()).timestamp_ms == T0 + 72
    assert asked == [T0, T0 + 36]
    assert gen.counters().reservation_stalls == 2


def test_a_reserve_that_falls_short_is_an_error() -> None:
    clock = FakeClock(T0)
    gen = IdGenerator(
        GeneratorSettings(), clock=clock, sleep=clock.sleep, ceiling_ms=T0 - 1,
        reserve=lambda ms: ms - 1,
    )  # fmt: skip
    with pytest.raises(ReservationError, match="before the ms asked for"):
        gen.next_id()


def test_sealed_while_reserving_stays_sealed() -> None:
    gen, entered, finish = slow_reserve_generator()
    passing, passed = run_in_thread(gen.next_id)
    assert entered.wait(PROMPTLY_S)
    assert gen.seal() == -1, "sealing does not wait for the write either"
    finish.set()
    passing.join(PROMPTLY_S)
    assert isinstance(passed[0], ReservationError) and "shut down" in str(passed[0])
    assert gen.ceiling_ms == -1, "the late reservation did not reopen it"


def _renewing(clock: FakeClock) -> tuple[IdGenerator, list[int]]:
    """A generator whose reservation ends at T0; each renewal (recorded) adds a second."""
    reserved: list[int] = []

    def reserve(ms: int) -> int:
        reserved.append(ms)
        return ms + 1000

    gen = IdGenerator(
        GeneratorSettings(), clock=clock, sleep=clock.sleep, ceiling_ms=T0, reserve=reserve
    )
    return gen, reserved


def test_a_batch_may_span_a_renewal() -> None:
    clock = FakeClock(T0)
    gen, reserved = _renewing(clock)
    gen.next_ids(4000)
    ids = gen.next_ids(200)  # crosses into T0 + 1, past the ceiling
    assert reserved == [T0 + 1]
    assert ids == sorted(ids) and len(set(ids)) == 200
    assert [decompose(i).timestamp_ms for i in ids] == [T0] * 96 + [T0 + 1] * 104
    assert gen.counters() == GeneratorCounters(
        ids_generated=4200, sequence_exhausted_waits=1, reservation_stalls=1
    )


def test_one_call_is_capped_whatever_the_layout() -> None:
    # The regression of issue 16, item 6: with 22 sequence bits one call could ask
    # for 4,194,304 ids (hundreds of MB, seconds under the lock).
    layout = Layout(epoch_ms=T0 - 1000, timestamp_bits=31, sequence_bits=22)
    gen = make(FakeClock(T0), layout=layout)
    with pytest.raises(InvalidCountError, match=r"1\.\.4096, got 4194304: .*--max-batch 4096"):
        gen.next_ids(4_194_304)
    assert len(gen.next_ids(4096)) == 4096
    with pytest.raises(InvalidCountError, match=r"1\.\.4096, got 4097"):
        gen.next_ids(4097)


def test_max_batch_sets_the_cap_up_to_one_ms_of_ids() -> None:
    gen = make(FakeClock(T0), max_batch=10)
    assert len(gen.next_ids(10)) == 10
    with pytest.raises(InvalidCountError, match=r"1\.\.10, got 11: .*--max-batch 10 ids"):
        gen.next_ids(11)
    narrow = make(FakeClock(T0), layout=Layout(sequence_bits=4), max_batch=1000)
    with pytest.raises(InvalidCountError, match=r"1\.\.16, got 17: .*16 with 4 sequence bits"):
        narrow.next_ids(17)
    with pytest.raises(ConfigurationError, match="max_batch"):
        GeneratorSettings(max_batch=0)


def _on_a_thread_that_must_not_wait(call: Callable[[], object]) -> object:
    """What ``call`` returns (or raises) on a thread marked by ``forbid_waiting``."""
    outcome: list[object] = []

    def run() -> None:
        forbid_waiting()
        try:
            outcome.append(call())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    return outcome[0]


def test_a_thread_that_must_not_wait_gets_would_block_for_a_step_back_and_counts_nothing() -> None:
    clock = FakeClock(T0)
    gen = make(clock, max_backwards_ms=5)
    first = gen.next_id()
    clock.now -= 3  # more than the ms a loop thread may wait in place
    before = gen.counters()
    assert isinstance(_on_a_thread_that_must_not_wait(gen.next_id), WouldBlock)
    assert isinstance(_on_a_thread_that_must_not_wait(lambda: gen.next_ids(3)), WouldBlock)
    # Nothing counted; the step itself was seen (what the clock did, not a call's count).
    assert gen.counters() == replace(before, max_backward_step_ms=3) and not clock.sleeps
    # The same call on a thread that may wait: waited out, counted once.
    assert gen.next_id() > first
    assert gen.counters().clock_backwards_waited == 1


def test_a_thread_that_must_not_wait_never_waits_for_the_lock() -> None:
    clock = FakeClock(T0)
    sleeping, woken = threading.Event(), threading.Event()

    def held(seconds: float) -> None:
        sleeping.set()
        woken.wait(PROMPTLY_S)

    gen = IdGenerator(GeneratorSettings(), clock=clock, sleep=held)
    gen.next_id()
    before = gen.counters()
    clock.now -= 2
    holder = threading.Thread(target=gen.next_id)  # sleeps out the step, holding the lock
    holder.start()
    try:
        assert sleeping.wait(PROMPTLY_S), "the holder did not sleep out the step"
        clock.now += 3  # the clock is fine again: only the holder stands in the way
        assert isinstance(_on_a_thread_that_must_not_wait(gen.next_id), WouldBlock)
        assert isinstance(_on_a_thread_that_must_not_wait(lambda: gen.next_ids(2)), WouldBlock)
    finally:
        woken.set()
        holder.join(PROMPTLY_S)
    # Only the holder's id and its wait were counted.
    assert gen.counters() == replace(
        before,
        ids_generated=before.ids_generated + 1,
        clock_backwards_waited=before.clock_backwards_waited + 1,
        max_backward_step_ms=2,
    )


def test_a_thread_that_must_not_wait_waits_out_one_ms_in_place() -> None:
    clock = FakeClock(T0)
    gen = make(clock)
    first = gen.next_id()
    clock.now -= 1
    second = _on_a_thread_that_must_not_wait(gen.next_id)
    assert isinstance(second, int) and second > first
    assert waiting_forbidden() is False  # the mark belongs to that thread only


def test_a_thread_that_must_not_wait_never_waits_for_a_reservation() -> None:
    clock = FakeClock(T0)
    gen, reserved = _renewing(clock)
    for _ in range(4096):  # all of ms T0
        gen.next_id()
    before = gen.counters()
    # It waits out the exhausted ms in place, then needs a new reservation: refused,
    # and the wait it made is not counted either (the call is made again elsewhere).
    assert isinstance(_on_a_thread_that_must_not_wait(gen.next_id), WouldBlock)
    assert gen.counters() == before and reserved == [] and clock() == T0 + 1
    gen.next_id()  # on a thread that may wait: reserves
    assert reserved == [T0 + 1] and gen.counters().reservation_stalls == 1


def test_clock_refusal_says_why_calls_would_be_refused_now() -> None:
    clock = FakeClock(T0)
    generator = IdGenerator(GeneratorSettings(max_backwards_ms=5), clock=clock, sleep=clock.sleep)
    generator.next_id()
    assert generator.clock_refusal() is None
    clock.now -= 5
    assert generator.clock_refusal() is None, "within --max-backwards-ms: waited out"
    clock.now -= 1
    assert generator.clock_refusal() == (
        "the clock is 6 ms behind the newest id (more than --max-backwards-ms 5): calls "
        "are refused with InvalidSystemClock"
    )
    with pytest.raises(ClockMovedBackwardsError):
        generator.next_id()


# -- the clock sequence: a rollback moves to another value ----------------------------

# Two clock-sequence bits carved out of the datacenter field: 41 + 2 + 3 + 5 + 12 = 63.
LAYOUT = Layout(datacenter_id_bits=3, clock_sequence_bits=2)


class Switches:
    """A ``switch`` that records what was persisted, and may be told to fail."""

    def __init__(self, ahead_ms: int = 1000) -> None:
        self.ahead = ahead_ms
        self.calls: list[tuple[int, int]] = []
        self.fail: Exception | None = None

    def __call__(self, value: int, now_ms: int) -> int:
        if self.fail is not None:
            raise self.fail
        self.calls.append((value, now_ms))
        return now_ms + self.ahead


def make_sequenced(
    clock: FakeClock, *, layout: Layout = LAYOUT, tolerance: int = 5, **kwargs: object
) -> IdGenerator:
    if "switch" in kwargs:
        kwargs.setdefault("reserve", lambda ms: ms + 1000)  # the ceilings a store would keep
    return IdGenerator(
        GeneratorSettings(datacenter_id=5, worker_id=9, layout=layout, max_backwards_ms=tolerance),
        clock=clock,
        sleep=clock.sleep,
        **kwargs,  # type: ignore[arg-type]
    )


def parts(gen: IdGenerator, id_: int) -> tuple[int, int, int]:
    decoded = gen.settings.layout.decompose(id_)
    assert (decoded.datacenter_id, decoded.worker_id) == (5, 9)
    return decoded.timestamp_ms, decoded.clock_sequence, decoded.sequence


def test_pick_looks_from_the_first_value_on_and_wraps() -> None:
    assert pick_clock_sequence([10, 5, 20, 30], 1, 8) == 1
    assert pick_clock_sequence([10, 5, 20, 30], 2, 8) == 1  # 2, 3, 0 are ahead; 1 is past
    assert pick_clock_sequence([10, 5, 20, 30], 2, 11) == 0
    assert pick_clock_sequence([10, 5, 20, 30], 0, 5) is None  # 5 itself was used


def test_a_rollback_beyond_the_tolerance_moves_to_the_next_value() -> None:
    clock = FakeClock(T0)
    switches = Switches()
    gen = make_sequenced(clock, switch=switches)
    before = gen.next_id()
    clock.now -= 2000
    assert gen.clock_refusal() is None, "a value is free: /readyz stays ready"
    after = gen.next_id()
    assert parts(gen, before) == (T0, 0, 0)
    assert parts(gen, after) == (T0 - 2000, 1, 0)
    assert after < before, "ids are no longer increasing across a move"
    assert switches.calls == [(1, T0 - 2000)]
    counts = gen.counters()
    assert (counts.clock_sequence_switches, counts.clock_backwards_refused) == (1, 0)
    assert counts.ids_generated == 2
    assert gen.clock_sequence == 1


def test_a_generator_without_stores_moves_in_memory() -> None:
    # The decode vectors' generator, and any use without a state: nothing to persist.
    clock = FakeClock(T0)
    gen = make_sequenced(clock)
    gen.next_id()
    clock.now -= 2000
    assert parts(gen, gen.next_id()) == (T0 - 2000, 1, 0)
    clock.now += 5000
    assert parts(gen, gen.next_id()) == (T0 + 3000, 1, 0), "no ceiling to pass"


def test_a_step_within_the_tolerance_is_still_waited_out() -> None:
    clock = FakeClock(T0)
    gen = make_sequenced(clock, switch=Switches())
    before = gen.next_id()
    clock.now -= 3
    assert parts(gen, gen.next_id()) == (T0, 0, 1)
    assert gen.next_id() > before
    assert (gen.clock_backwards_waited, gen.clock_sequence_switches) == (1, 0)


def test_several_rollbacks_use_each_value_once_then_refuse() -> None:
    clock = FakeClock(T0)
    gen = make_sequenced(clock, switch=Switches())
    seen = {gen.next_id()}
    for value in (1, 2, 3):
        clock.now -= 1000
        id_ = gen.next_id()
        assert parts(gen, id_) == (int(clock.now), value, 0)
        seen.add(id_)
    clock.now -= 1000  # every value was used at a later time than now
    with pytest.raises(ClockMovedBackwardsError, match="every clock-sequence value") as refused:
        gen.next_id()
    assert refused.value.behind_ms == 1000
    assert gen.clock_refusal() is not None and "every clock-sequence value" in (
        gen.clock_refusal() or ""
    )
    assert (gen.clock_sequence_switches, gen.clock_backwards_refused) == (3, 1)
    clock.now += 1001  # past value 3's last time: it goes on
    assert parts(gen, gen.next_id()) == (T0 - 2999, 3, 0)
    assert len(seen) == 4


def test_the_values_wrap_once_the_clock_is_past_a_value_s_times() -> None:
    clock = FakeClock(T0)
    gen = make_sequenced(clock, tolerance=1, switch=Switches())
    gen.next_id()  # value 0 used at T0
    for _ in range(3):
        clock.now -= 1000
        gen.next_id()  # values 1, 2, 3
    clock.now = T0 + 10
    assert parts(gen, gen.next_id()) == (T0 + 10, 3, 0)  # forward again: value 3 goes on
    clock.now = T0 + 2  # behind value 3 by 8 ms, past value 0's T0
    assert parts(gen, gen.next_id()) == (T0 + 2, 0, 0)
    assert gen.clock_sequence_switches == 4


def test_a_value_is_persisted_before_any_id_uses_it() -> None:
    clock = FakeClock(T0)
    switches = Switches()
    gen = make_sequenced(clock, switch=switches)
    gen.next_id()
    clock.now -= 2000
    switches.fail = ReservationError("cannot write the high-water mark to disk")
    with pytest.raises(ReservationError, match="cannot write"):
        gen.next_id()
    assert (gen.clock_sequence, gen.clock_sequence_switches) == (0, 0)
    assert gen.counters().ids_generated == 1
    switches.fail = None
    assert parts(gen, gen.next_id()) == (T0 - 2000, 1, 0)
    assert switches.calls == [(1, T0 - 2000)]


def test_a_switch_that_persists_too_little_is_an_error() -> None:
    clock = FakeClock(T0)
    gen = make_sequenced(clock, switch=Switches(ahead_ms=-1))
    gen.next_id()
    clock.now -= 2000
    with pytest.raises(ReservationError, match="before the ms asked for"):
        gen.next_id()
    assert gen.clock_sequence == 0


def test_a_restart_continues_from_the_stored_marks() -> None:
    clock = FakeClock(T0)
    # The last run used value 0 up to T0 + 500 and value 1 up to T0 - 10.
    gen = make_sequenced(
        clock,
        switch=Switches(),
        clock_sequence=1,
        resume_after_ms=T0 - 10,
        used_until_ms=[T0 + 500, T0 - 10],
    )
    assert parts(gen, gen.next_id()) == (T0, 1, 0)
    clock.now -= 100
    assert parts(gen, gen.next_id()) == (T0 - 100, 2, 0)  # 0 is still ahead: skipped


def test_a_thread_that_must_not_wait_leaves_the_switch_to_another() -> None:
    clock = FakeClock(T0)
    switches = Switches()
    gen = make_sequenced(clock, switch=switches)
    gen.next_id()
    clock.now -= 2000
    forbid_waiting()
    try:
        with pytest.raises(WouldBlock, match="clock-sequence switch"):
            gen.next_id()
    finally:
        forbid_waiting(False)
    assert (switches.calls, gen.clock_sequence_switches) == ([], 0)
    assert parts(gen, gen.next_id())[1] == 1


def test_a_batch_across_a_switch_is_sorted_and_unique() -> None:
    # Reads: construction, next_id, the batch's first ms; then the clock is 2 s back.
    readings = [T0, T0, T0, T0 - 2000]
    clock = FakeClock(T0)

    def scripted() -> int:
        return readings.pop(0) if len(readings) > 1 else readings[0]

    layout = Layout(datacenter_id_bits=3, clock_sequence_bits=2, sequence_bits=2)
    gen = IdGenerator(
        GeneratorSettings(datacenter_id=5, worker_id=9, layout=layout),
        clock=scripted,
        sleep=clock.sleep,
        switch=Switches(),
        reserve=lambda ms: ms + 1000,
    )
    first = gen.next_id()
    batch = gen.next_ids(4)  # sequences 1..3 at T0, then one at T0 - 2000 under value 1
    assert [parts(gen, i) for i in batch] == [
        (T0 - 2000, 1, 0), (T0, 0, 1), (T0, 0, 2), (T0, 0, 3)
    ]  # fmt: skip
    assert batch == sorted(batch) and first not in batch


def test_a_ceiling_asked_for_before_a_move_away_and_back_is_not_taken() -> None:
    # A call past the ceiling releases the lock to reserve; meanwhile other calls move
    # to value 1 and back to 0. What the reservation returns then is no ceiling of the
    # value 0 of now (its mark was written by the move back): taking it would let ids
    # pass the stored mark, and a crash repeat them.
    clock = FakeClock(T0)
    switches = Switches()
    gen: IdGenerator

    def slow_reserve(ms: int) -> int:
        clock.now = T0 + 900
        gen.next_id()  # to value 1, marked T0 + 1900
        clock.now = T0 + 1500
        gen.next_id()
        clock.now = T0 + 1200
        gen.next_id()  # behind value 1's T0 + 1500 by more than 5 ms: back to value 0
        return T0 + 2500  # what the reservation holds: value 1's renewed mark

    one_bit = Layout(datacenter_id_bits=4, clock_sequence_bits=1)
    gen = make_sequenced(
        clock,
        layout=one_bit,
        tolerance=5,
        switch=switches,
        reserve=slow_reserve,
        ceiling_ms=T0 + 1000,
    )
    clock.now = T0 + 990
    gen.next_id()
    clock.now = T0 + 1001
    gen.next_id()
    assert switches.calls == [(1, T0 + 900), (0, T0 + 1200)]
    assert gen.ceiling_ms == T0 + 2200, "the mark the move back stored, not T0 + 2500"


def test_sealed_generator_does_not_switch() -> None:
    clock = FakeClock(T0)
    switches = Switches()
    gen = make_sequenced(clock, switch=switches, ceiling_ms=T0 + 1000)
    gen.next_id()
    gen.seal()
    clock.now -= 2000
    with pytest.raises(ReservationError, match="shut down"):
        gen.next_id()
    assert switches.calls == []


def test_a_mark_of_another_value_does_not_raise_the_ceiling() -> None:
    clock = FakeClock(T0)
    gen = make_sequenced(clock, switch=Switches(), ceiling_ms=T0 + 1000)
    gen.next_id()
    clock.now -= 2000
    gen.next_id()  # value 1, ceiling T0 - 1000
    gen.raise_ceiling(T0 + 5000, clock_sequence=0)  # a renewal of value 0, written before
    assert gen.ceiling_ms == T0 - 1000
    gen.raise_ceiling(T0, clock_sequence=1)
    assert gen.ceiling_ms == T0


def test_a_reservation_needs_a_switch_with_a_clock_sequence() -> None:
    with pytest.raises(ConfigurationError, match="needs switch"):
        make_sequenced(FakeClock(T0), reserve=lambda ms: ms)
    with pytest.raises(ConfigurationError, match="5 clock-sequence marks for 4 values"):
        make_sequenced(FakeClock(T0), used_until_ms=[0] * 5)


def test_without_a_clock_sequence_a_rollback_is_refused_as_before() -> None:
    clock = FakeClock(T0)
    gen = make_sequenced(clock, layout=Layout())
    gen.next_id()
    clock.now -= 2000
    with pytest.raises(ClockMovedBackwardsError, match="Refusing to generate id for 2000"):
        gen.next_id()


class MemoryStore:
    """Marks per clock-sequence value as a store keeps them: reserved ahead by each
    ``reserve`` (the value in use) and ``switch`` (the new value), exact at a clean stop,
    and never lowered otherwise; and the value in use, as the last switch named it."""

    def __init__(self, values: int, ahead_ms: int = 1000) -> None:
        self.marks = [-1] * values
        self.in_use = 0
        self.ahead = ahead_ms

    def reserve(self, ms: int) -> int:
        self.marks[self.in_use] = max(self.marks[self.in_use], ms + self.ahead)
        return self.marks[self.in_use]

    def switch(self, value: int, ms: int) -> int:
        self.in_use = value
        return self.reserve(ms)


# Any walk of the clock, with steps back of any size, single calls and batches, and
# restarts (clean, or crashes) that start from what the store holds: no id twice.
_walk = st.lists(
    st.tuples(
        st.integers(min_value=-3000, max_value=3000),
        st.integers(min_value=0, max_value=300),
        st.sampled_from(["serve", "stop", "crash"]),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(walk=_walk, tolerance=st.integers(min_value=0, max_value=10))
def test_no_id_is_issued_twice_whatever_the_clock_does(
    walk: list[tuple[int, int, str]], tolerance: int
) -> None:
    clock = FakeClock(T0)
    layout = Layout(datacenter_id_bits=3, clock_sequence_bits=2, sequence_bits=4)
    store = MemoryStore(4)

    def start() -> IdGenerator:
        # As Worker.open chooses: the value in use unless the clock is behind its mark
        # by more than the tolerance; then one the clock is past, else wait for the lowest.
        used, value = store.marks, store.in_use
        if used[value] - clock() > tolerance:
            found = pick_clock_sequence(used, value, clock())
            if found is None:
                found = used.index(min(used))
            value = found
        if used[value] >= clock():
            clock.now = used[value] + 1  # the start-up wait
        store.in_use = value
        generator = make_sequenced(
            clock,
            layout=layout,
            tolerance=tolerance,
            switch=store.switch,
            reserve=store.reserve,
            ceiling_ms=used[value],
            clock_sequence=value,
            resume_after_ms=used[value],
            used_until_ms=[*used],
        )
        generator.raise_ceiling(store.reserve(clock()), value)
        return generator

    gen = start()
    issued: list[int] = []
    for move, n, event in walk:
        clock.now += move
        if event == "stop":  # a clean stop writes the exact mark of the value in use
            store.marks[gen.clock_sequence] = max(gen.seal(), 0)
        if event != "serve":  # a crash leaves the marks as they were reserved
            gen = start()
        try:
            issued.extend(gen.next_ids(n % 16 + 1) if n % 2 else [gen.next_id()])
        except ClockMovedBackwardsError as e:
            assert e.behind_ms > tolerance
    assert len(set(issued)) == len(issued)


def test_the_largest_step_back_seen_is_kept() -> None:
    clock = FakeClock(T0)
    gen = make(clock)  # --max-backwards-ms 5 by default
    gen.next_id()
    assert gen.counters().max_backward_step_ms == 0
    clock.now -= 3  # waited out
    gen.next_id()
    assert gen.counters().max_backward_step_ms == 3
    clock.now -= 2000  # refused
    with pytest.raises(ClockMovedBackwardsError):
        gen.next_id()
    clock.now += 1997  # still behind, by less (waited out): the largest stays
    gen.next_id()
    assert gen.counters().max_backward_step_ms == 2000


def test_adding_counters_sums_the_counts_and_keeps_the_largest_step() -> None:
    first = GeneratorCounters(ids_generated=3, max_backward_step_ms=40)
    second = GeneratorCounters(ids_generated=4, clock_backwards_waited=1, max_backward_step_ms=7)
    assert first + second == GeneratorCounters(
        ids_generated=7, clock_backwards_waited=1, max_backward_step_ms=40
    )
