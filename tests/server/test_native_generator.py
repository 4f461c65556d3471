"""The native generator state against the pure-Python generator, its reference.

The differential test drives a pure ``IdGenerator`` and the hybrid as production runs it
(the C fast call first; on SLOW, the gate check and the Python slow path on the same
state) with the same clocks, calls, ceilings and gate, and requires the same ids, the
same errors and the same counters. The concurrent test runs native threads on the fast
path (no GIL) beside Python on the slow path, sharing one state while ceilings are
raised and the gate opens, expires and closes: no id twice, each thread's increasing,
and none from the fast path once the gate closed.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from snowflake_server import GeneratorSettings, IdGenerator, Layout
from snowflake_server._errors import SnowflakeError
from snowflake_server._ids.clocks import boot_clock
from snowflake_server._ids.generator import NativeStateIdGenerator
from snowflake_server._native import native_core, native_disabled
from tests.support.fakes import FakeClock, SecondsClock
from tests.support.forking import in_a_child
from tests.support.waiting import run_in_thread, wait_until

core = native_core()
needs_core = pytest.mark.skipif(core is None, reason="the native core is not built")

T0 = 1_700_000_000_000
LAYOUTS = [
    Layout(sequence_bits=4),  # a ms runs out after 16 ids: exhaustion is common
    Layout(sequence_bits=12),
    Layout(datacenter_id_bits=3, clock_sequence_bits=1, sequence_bits=4),
]


class Store:
    """High-water marks as a store keeps them: ``reserve`` writes ``ahead`` ms past what is
    asked, ``switch`` moves to another clock-sequence value (as tests/server/test_generator.py's
    MemoryStore)."""

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        self.marks = [-1, -1]
        self.in_use = 0

    def reserve(self, ms: int) -> int:
        self.marks[self.in_use] = max(self.marks[self.in_use], ms + self.ahead)
        return self.marks[self.in_use]

    def switch(self, value: int, ms: int) -> int:
        self.in_use = value
        return self.reserve(ms)


@dataclass
class Side:
    """One generator with its own clock and store (the two sides move them alike)."""

    clock: FakeClock
    store: Store
    generator: IdGenerator


Outcome = tuple[str, object]


def outcome(call: Callable[[], object]) -> Outcome:
    try:
        return ("ok", call())
    except SnowflakeError as e:
        return (type(e).__name__, str(e))


# What the runs covered, summed over every example (checked after the run).
TOTALS = {"fast": 0, "slow": 0, "ids": 0, "examples": 0}


class Differential(RuleBasedStateMachine):
    """The pure generator and the hybrid (fast call in C, slow path in Python, one state)."""

    def __init__(self) -> None:
        super().__init__()
        self.boot = SecondsClock(1000.0)
        self.gate_open = False
        self.gate_until = float("-inf")

    @initialize(
        layout=st.sampled_from(LAYOUTS),
        tolerance=st.integers(0, 6),
        start=st.sampled_from(["zero", "zero", "random"]),
        ahead=st.integers(0, 40),
        seed=st.integers(0, 2**16),
        gate=st.sampled_from([float("inf"), float("inf"), 2.0, None]),
    )
    def make(
        self, layout: Layout, tolerance: int, start: str, ahead: int, seed: int, gate: float | None
    ) -> None:
        config = GeneratorSettings(
            worker_id=1,
            layout=layout,
            max_backwards_ms=tolerance,
            sequence_start=start,  # type: ignore[arg-type]
        )

        def side(cls: type[IdGenerator]) -> Side:
            clock, store = FakeClock(T0), Store(ahead)
            values = layout.max_clock_sequence + 1
            generator = cls(
                config,
                clock=clock,
                sleep=clock.sleep,
                randbelow=random.Random(seed).randrange,
                resume_after_ms=T0 - 1,
                ceiling_ms=T0 + ahead,
                reserve=store.reserve,
                switch=store.switch if values > 1 else None,
            )
            return Side(clock, store, generator)

        self.pure = side(IdGenerator)
        self.hybrid = side(NativeStateIdGenerator)
        native = self.hybrid.generator
        assert isinstance(native, NativeStateIdGenerator)
        self.state = native.native_state
        if gate is not None:
            self.open_gate(gate)
        TOTALS["examples"] += 1

    # -- the clocks, the gate, the ceiling --------------------------------------------

    @rule(step=st.one_of(st.integers(0, 3), st.integers(-12, -1), st.integers(4, 100)))
    def move_clock(self, step: int) -> None:
        self.pure.clock.now += step
        self.hybrid.clock.now += step

    @rule(offset=st.integers(-1, 2))
    def move_clock_to_the_ceiling(self, offset: int) -> None:
        # The boundary a fast call must not pass: a new ms just at or past the ceiling.
        target = self.pure.generator.ceiling_ms + offset
        self.pure.clock.now = self.hybrid.clock.now = target

    @rule(offset=st.sampled_from([-1e-6, 0.0, 1e-6]))
    def move_boot_clock_to_the_deadline(self, offset: float) -> None:
        if self.gate_until > self.boot.now and self.gate_until != float("inf"):
            self.boot.now = self.gate_until + offset

    @rule(seconds=st.floats(0, 1))
    def move_boot_clock(self, seconds: float) -> None:
        self.boot.advance(seconds)

    @rule(seconds=st.floats(0, 10))
    def open_gate(self, seconds: float) -> None:
        self.gate_open, self.gate_until = True, self.boot.now + seconds
        self.state.set_gate(self.gate_until)

    @rule(really=st.integers(0, 3))  # less often than the other rules
    def close_gate(self, really: int) -> None:
        if really:
            return
        self.gate_open, self.gate_until = False, float("-inf")
        self.state.close()

    @rule(ahead=st.integers(-5, 60), other_value=st.booleans())
    def raise_ceiling(self, ahead: int, other_value: bool) -> None:
        for side in (self.pure, self.hybrid):
            value = side.generator.clock_sequence ^ other_value
            side.generator.raise_ceiling(side.clock() + ahead, value)

    @rule(really=st.integers(0, 3))  # less often than the other rules: sealed is for good
    def seal(self, really: int) -> None:
        if really:
            return
        assert self.pure.generator.seal() == self.hybrid.generator.seal()

    # -- the calls ----------------------------------------------------------------------

    def gate_passes(self) -> bool:
        return self.gate_open and self.boot.now <= self.gate_until

    def pure_call(self) -> Outcome:
        if not self.gate_passes():
            return ("closed", None)
        return outcome(self.pure.generator.next_id)

    def hybrid_call(self) -> Outcome:
        fast = self.state.next_id(self.hybrid.clock(), self.boot.now)
        if fast is not None:
            TOTALS["fast"] += 1
            return ("ok", fast)
        TOTALS["slow"] += 1
        if not self.gate_passes():  # what the slot checks before the slow path
            return ("closed", None)
        return outcome(self.hybrid.generator.next_id)

    @rule(times=st.integers(1, 60))
    def next_id(self, times: int) -> None:
        for _ in range(times):
            expected, got = self.pure_call(), self.hybrid_call()
            assert got == expected
            TOTALS["ids"] += expected[0] == "ok"

    @rule(times=st.integers(1, 30), step=st.integers(1, 2))
    def next_id_each_ms(self, times: int, step: int) -> None:
        # Low traffic: each call in a new ms (the fast path's other case).
        for _ in range(times):
            self.move_clock(step)
            self.next_id(1)

    @rule()
    def next_id_from_python(self) -> None:
        # Python's own calls on the native home take the slow path whatever the case.
        expected = outcome(self.pure.generator.next_id)
        assert outcome(self.hybrid.generator.next_id) == expected

    @rule(count=st.integers(1, 40))
    def next_ids(self, count: int) -> None:
        expected = outcome(lambda: self.pure.generator.next_ids(count))
        assert outcome(lambda: self.hybrid.generator.next_ids(count)) == expected
        if expected[0] == "ok":
            TOTALS["ids"] += count

    @invariant()
    def same_state(self) -> None:
        pure, hybrid = self.pure.generator, self.hybrid.generator
        assert pure.counters() == hybrid.counters()
        assert self.pure.clock.now == self.hybrid.clock.now  # slept alike
        assert (pure.ceiling_ms, pure.clock_sequence) == (hybrid.ceiling_ms, hybrid.clock_sequence)


@needs_core
def test_the_hybrid_issues_what_the_pure_generator_does() -> None:
    for key in TOTALS:
        TOTALS[key] = 0
    run_state_machine_as_test(
        Differential, settings=settings(max_examples=500, stateful_step_count=40, deadline=None)
    )
    # The runs reached both paths and compared many ids.
    assert TOTALS["fast"] > 1000 and TOTALS["slow"] > 100 and TOTALS["ids"] > 5000, TOTALS


# -- the fast call's own cases -----------------------------------------------------------


def fresh_state() -> NativeStateIdGenerator:
    clock = FakeClock(T0)
    return NativeStateIdGenerator(
        GeneratorSettings(layout=Layout(sequence_bits=2)),
        clock=clock,
        sleep=clock.sleep,
        ceiling_ms=T0 + 1,
        reserve=lambda ms: ms,
    )


def fields(state: object) -> tuple[object, ...]:
    names = "last_ts sequence base first_sequence ids_before_this_ms ceiling node sealed"
    return tuple(getattr(state, name) for name in names.split())


@needs_core
def test_the_fast_call_serves_only_the_common_cases_and_touches_nothing_otherwise() -> None:
    state = fresh_state().native_state
    assert state.next_id(T0, 0.0) is None  # the gate starts closed
    state.set_gate(10.0)
    first = state.next_id(T0, 0.0)  # a new ms under the ceiling
    assert first is not None
    assert [state.next_id(T0, 0.0) for _ in range(3)] == [first + 1, first + 2, first + 3]
    before = fields(state)
    assert state.next_id(T0, 0.0) is None  # the ms ran out
    assert state.next_id(T0 - 1, 0.0) is None  # a step back
    assert state.next_id(T0 + 2, 0.0) is None  # past the ceiling
    assert state.next_id(T0 + 1, 10.5) is None  # past the gate's deadline
    assert state.next_id(T0 + 1, float("nan")) is None  # a reading that is no time
    assert fields(state) == before
    state.close()
    assert state.next_id(T0 + 1, 0.0) is None  # closed
    assert (state.gate_open, state.gate_until) == (False, float("-inf"))
    state.set_gate(10.0)
    assert state.next_id(T0 + 1, 0.0) == first + (1 << state.ts_shift)


@needs_core
def test_a_sealed_state_serves_nothing_fast() -> None:
    generator = fresh_state()
    state = generator.native_state
    state.set_gate(float("inf"))
    assert state.next_id(T0, 0.0) is not None
    generator.seal()
    assert state.sealed and state.next_id(T0, 0.0) is None and state.next_id(T0 + 1, 0.0) is None


@needs_core
def test_a_random_sequence_start_leaves_new_ms_to_python() -> None:
    clock = FakeClock(T0)
    generator = NativeStateIdGenerator(
        GeneratorSettings(sequence_start="random"), clock=clock, sleep=clock.sleep
    )
    state = generator.native_state
    state.set_gate(float("inf"))
    assert not state.zero_start and state.next_id(T0, 0.0) is None
    first = generator.next_id()
    assert state.next_id(T0, 0.0) == first + 1  # the same ms: fast


@needs_core
def test_the_mutex_behaves_as_a_lock() -> None:
    state = fresh_state().native_state
    with pytest.raises(RuntimeError):
        state.release()  # not held
    assert state.acquire()
    assert not state.acquire(False)  # held by this very thread: not again
    with pytest.raises(RuntimeError):
        state.acquire()  # would deadlock: refused
    assert state.held()
    # The gate's writes from the holder write in place (a refused switch write closes it).
    state.set_gate(1.0)
    assert (state.gate_open, state.gate_until) == (True, 1.0)
    state.close()
    assert (state.gate_open, state.gate_until) == (False, float("-inf"))
    took = []
    thread = threading.Thread(target=lambda: took.append(state.acquire(timeout=0.01)))
    thread.start()
    thread.join()
    assert took == [False]  # timed out: another thread holds it
    state.release()
    assert not state.held()
    with state:
        pass
    with pytest.raises(ValueError, match="NaN"):
        state.set_gate(float("nan"))
    with pytest.raises(TypeError):
        state.next_id(T0)  # type: ignore[call-arg]


def test_the_native_core_is_off_with_snowflake_no_native(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SNOWFLAKE_NO_NATIVE", "1")
    assert native_disabled()
    with caplog.at_level(logging.INFO, logger="snowflake_server._native"):
        assert native_core.__wrapped__() is None
    assert [r.getMessage() for r in caplog.records] == [
        "native fast path off (SNOWFLAKE_NO_NATIVE): serving on the pure-Python path"
    ]
    assert not native_disabled({"SNOWFLAKE_NO_NATIVE": "0"})


def test_without_the_native_core_the_server_says_so_once_and_a_native_state_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("SNOWFLAKE_NO_NATIVE", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "snowflake_server._native._core", None)
    with caplog.at_level(logging.INFO, logger="snowflake_server._native"):
        assert native_core.__wrapped__() is None
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith("native fast path not built")
    monkeypatch.setattr("snowflake_server._native.native_core", lambda: None)
    with pytest.raises(SnowflakeError, match="native core is not available"):
        NativeStateIdGenerator(GeneratorSettings())


# -- a held mutex: native threads never wait long, and never behind a long hold ---------

SLOW, CONTENDED = -1, -2  # the fast call's answers that are not ids (core.SLOW, core.CONTENDED)
PROMPTLY_S = 10.0
FOREVER_S = 3600.0  # a fast call's tries that only a long hold (or the test) can cut short


@needs_core
def test_a_fast_call_gives_up_at_once_while_python_waits_out_a_clock_step() -> None:
    """A Python call sleeping out a backwards step holds the mutex with long_hold set: a
    native fast call, even one allowed to try for an hour, returns CONTENDED while the
    mutex is still held (the holder lets go only after that call returned)."""
    clock = FakeClock(T0)
    sleeping, woken = threading.Event(), threading.Event()

    def held(seconds: float) -> None:
        sleeping.set()
        woken.wait(PROMPTLY_S)
        clock.sleep(seconds)  # the step is waited out

    generator = NativeStateIdGenerator(GeneratorSettings(), clock=clock, sleep=held)
    state = generator.native_state
    state.set_gate(float("inf"))
    first = generator.next_id()
    clock.now -= 2
    holder, made = run_in_thread(generator.next_id)  # sleeps out the step, holding the mutex
    try:
        assert sleeping.wait(PROMPTLY_S), "the holder did not sleep out the step"
        assert state.long_hold
        caller, got = run_in_thread(lambda: state.fast_call(FOREVER_S))
        caller.join(PROMPTLY_S)
        assert got == [CONTENDED], "the fast call waited for a long hold"
        assert holder.is_alive() and not made, "the mutex was held throughout"
    finally:
        woken.set()
        holder.join(PROMPTLY_S)
        caller.join(PROMPTLY_S)
    assert not state.long_hold and made and made[0] > first
    assert generator.counters().clock_backwards_waited == 1


@needs_core
def test_a_fast_call_waits_out_a_short_hold_and_gives_up_when_it_turns_long() -> None:
    state = NativeStateIdGenerator(GeneratorSettings()).native_state  # the real clock
    state.set_gate(float("inf"))
    first = state.fast_call()
    assert first >= 0
    # Held without long_hold (a slow-path call, a scrape): the call tries until it is free.
    assert state.acquire()
    try:
        caller, got = run_in_thread(lambda: state.fast_call(FOREVER_S))
        wait_until(lambda: state.spinning == 1, "the fast call trying the held mutex")
        assert not got
    finally:
        state.release()
    caller.join(PROMPTLY_S)
    assert len(got) == 1 and isinstance(got[0], int) and got[0] > first, got
    assert state.spinning == 0
    # The hold turns long while the call tries: it gives up with the mutex still held.
    assert state.acquire()
    try:
        caller, got = run_in_thread(lambda: state.fast_call(FOREVER_S))
        wait_until(lambda: state.spinning == 1, "the fast call trying the held mutex")
        state.long_hold = True
        caller.join(PROMPTLY_S)
        assert got == [CONTENDED] and state.held()
        # The production bound: a hold that is not long is tried for SPIN_NS only.
        state.long_hold = False
        caller, got = run_in_thread(state.fast_call)
        caller.join(PROMPTLY_S)
        assert got == [CONTENDED], "a short hold is tried for SPIN_NS, then given up"
    finally:
        state.long_hold = False
        state.release()
    assert core is not None and (core.SLOW, core.CONTENDED, core.SPIN_NS) == (
        SLOW,
        CONTENDED,
        20_000,
    )
    assert state.spinning == 0
    with pytest.raises(ValueError, match="spin_s"):
        state.fast_call(-1.0)
    with state, pytest.raises(RuntimeError, match="holds the generator state"):
        state.fast_call()


# -- fork: a child never issues from its parent's state ----------------------------------


@needs_core
def test_a_forked_child_gets_slow_from_an_inherited_state_even_one_held_at_the_fork() -> None:
    generator = NativeStateIdGenerator(GeneratorSettings(worker_id=3))
    state = generator.native_state
    state.set_gate(float("inf"))
    assert state.fast_call() >= 0
    # Another thread holds the mutex when the fork is made: in the child nobody ever will
    # let go of it.
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with state:
            holding.set()
            done.wait(PROMPTLY_S)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(PROMPTLY_S)

    def child() -> dict[str, object]:
        report: dict[str, object] = {"forked": state.forked, "fast": state.fast_call(FOREVER_S)}
        ids, slow_calls = state.spin(3, lambda: None)
        report["spin"] = [ids, slow_calls]
        for name, call in [
            ("next_id", generator.next_id),
            ("acquire", state.acquire),
            ("close", state.close),
            ("set_gate", lambda: state.set_gate(1.0)),
        ]:
            try:
                call()
                report[name] = "no error"
            except RuntimeError as e:
                report[name] = str(e)
        fresh = NativeStateIdGenerator(GeneratorSettings(worker_id=4))
        fresh.native_state.set_gate(float("inf"))
        report["fresh"] = [fresh.native_state.forked, fresh.native_state.fast_call()]
        return report

    try:
        report = in_a_child(child)
    finally:
        done.set()
        holder.join(PROMPTLY_S)
    assert report["forked"] is True
    assert report["fast"] == SLOW, "not CONTENDED, and no wait for a vanished holder"
    assert report["spin"] == [[], 0]
    for name in ("next_id", "acquire", "close", "set_gate"):
        assert "inherited across a fork" in str(report[name]), (name, report[name])
    fresh = report["fresh"]  # a state made in the child serves
    assert isinstance(fresh, list) and fresh[0] is False and fresh[1] >= 0, fresh
    # The parent is unaffected.
    assert not state.forked and state.fast_call() >= 0 and generator.next_id() >= 0


# -- the hybrid under threads ------------------------------------------------------------


@needs_core
def test_native_threads_and_python_share_one_state_without_a_repeated_id() -> None:
    """Native threads loop the fast call without the GIL (a SLOW call goes to Python's slow
    path, as in production) beside a Python thread calling the slow path, while the
    ceiling keeps being passed (each reservation reaches 1 ms ahead) and raised, the gate
    expires and reopens, and finally closes: after 600,000 ids."""
    store = Store(ahead=1)
    generator = NativeStateIdGenerator(
        GeneratorSettings(worker_id=1), ceiling_ms=-1, reserve=store.reserve
    )
    state = generator.native_state
    closed = threading.Event()
    from_python: list[int] = []  # ids the slow path made (list.append: atomic under the GIL)

    def slow() -> int | None:
        if closed.is_set():
            return None  # what the slot says once the gate closed: stop
        made = generator.next_id()
        from_python.append(made)
        return made

    state.set_gate(float("inf"))
    native_runs: list[list[int]] = [[] for _ in range(2)]

    def native(out: list[int]) -> None:
        while not closed.is_set():
            ids, _slow_calls = state.spin(5_000, slow)
            out.extend(ids)

    python_ids: list[int] = []
    threads = [threading.Thread(target=native, args=(out,)) for out in native_runs]
    for thread in threads:
        thread.start()
    expiries = 0
    while generator.counters().ids_generated < 600_000:
        python_ids.extend(generator.next_ids(16))
        python_ids.append(generator.next_id())
        if len(python_ids) % 7 == 0:
            generator.raise_ceiling(store.reserve(generator.ceiling_ms))
        if len(python_ids) % 11 == 0:
            state.set_gate(boot_clock() + 0.0005)  # expires within half a ms: SLOW after
            expiries += 1
        elif len(python_ids) % 13 == 0:
            state.set_gate(float("inf"))
    closed.set()
    state.close()
    with state:  # the newest id at the close: no fast call may go past it
        newest = state.base | state.sequence
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)

    everything = python_ids + [i for out in native_runs for i in out]
    assert len(set(everything)) == len(everything)
    assert generator.counters().ids_generated == len(everything)
    for out in [python_ids, *native_runs]:
        assert out == sorted(out), "each thread's ids increase"
    python_made = set(from_python)
    fast = [i for out in native_runs for i in out if i not in python_made]
    assert fast and max(fast) <= newest
    # The run went through what it is about: ceilings passed, gate expiries.
    assert generator.counters().reservation_stalls > 0 and from_python and expiries > 0
