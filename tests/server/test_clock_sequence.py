"""The generator's clock sequence under a fake clock: a rollback moves to another value."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snowflake_server import (
    ClockMovedBackwardsError,
    ConfigurationError,
    GeneratorSettings,
    IdGenerator,
    Layout,
    ReservationError,
)
from snowflake_server._ids.generator import WouldBlock, forbid_waiting, pick_clock_sequence
from tests.support.fakes import FakeClock

T0 = 1_700_000_000_000
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


def make(
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
    gen = make(clock, switch=switches)
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
    gen = make(clock)
    gen.next_id()
    clock.now -= 2000
    assert parts(gen, gen.next_id()) == (T0 - 2000, 1, 0)
    clock.now += 5000
    assert parts(gen, gen.next_id()) == (T0 + 3000, 1, 0), "no ceiling to pass"


def test_a_step_within_the_tolerance_is_still_waited_out() -> None:
    clock = FakeClock(T0)
    gen = make(clock, switch=Switches())
    before = gen.next_id()
    clock.now -= 3
    assert parts(gen, gen.next_id()) == (T0, 0, 1)
    assert gen.next_id() > before
    assert (gen.clock_backwards_waited, gen.clock_sequence_switches) == (1, 0)


def test_several_rollbacks_use_each_value_once_then_refuse() -> None:
    clock = FakeClock(T0)
    gen = make(clock, switch=Switches())
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
    gen = make(clock, tolerance=1, switch=Switches())
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
    gen = make(clock, switch=switches)
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
    gen = make(clock, switch=Switches(ahead_ms=-1))
    gen.next_id()
    clock.now -= 2000
    with pytest.raises(ReservationError, match="before the ms asked for"):
        gen.next_id()
    assert gen.clock_sequence == 0


def test_a_restart_continues_from_the_stored_marks() -> None:
    clock = FakeClock(T0)
    # The last run used value 0 up to T0 + 500 and value 1 up to T0 - 10.
    gen = make(
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
    gen = make(clock, switch=switches)
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
    gen = make(
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
    gen = make(clock, switch=switches, ceiling_ms=T0 + 1000)
    gen.next_id()
    gen.seal()
    clock.now -= 2000
    with pytest.raises(ReservationError, match="shut down"):
        gen.next_id()
    assert switches.calls == []


def test_a_mark_of_another_value_does_not_raise_the_ceiling() -> None:
    clock = FakeClock(T0)
    gen = make(clock, switch=Switches(), ceiling_ms=T0 + 1000)
    gen.next_id()
    clock.now -= 2000
    gen.next_id()  # value 1, ceiling T0 - 1000
    gen.raise_ceiling(T0 + 5000, clock_sequence=0)  # a renewal of value 0, written before
    assert gen.ceiling_ms == T0 - 1000
    gen.raise_ceiling(T0, clock_sequence=1)
    assert gen.ceiling_ms == T0


def test_a_reservation_needs_a_switch_with_a_clock_sequence() -> None:
    with pytest.raises(ConfigurationError, match="needs switch"):
        make(FakeClock(T0), reserve=lambda ms: ms)
    with pytest.raises(ConfigurationError, match="5 clock-sequence marks for 4 values"):
        make(FakeClock(T0), used_until_ms=[0] * 5)


def test_without_a_clock_sequence_a_rollback_is_refused_as_before() -> None:
    clock = FakeClock(T0)
    gen = make(clock, layout=Layout())
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
        generator = make(
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
