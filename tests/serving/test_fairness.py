"""The turn queue (snowflake_server/_serving/fairness.py) with fake connections and a
fake clock: deficit round robin, a budget per turn of the loop, one round per turn."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from snowflake_server._serving.fairness import TurnQueue
from tests.support.fakes import SecondsClock
from tests.support.serving import one_turn


class _Conn:
    """A connection as the queue sees it: each turn costs ``cost`` seconds of the clock
    (and of its credit); it asks for another turn while it has ``left`` of them."""

    def __init__(
        self, name: str, queue: TurnQueue, clock: SecondsClock, served: list[str], *,
        credit: float = 0.0, cost: float = 0.0, left: int = 0,
    ) -> None:  # fmt: skip
        self.name = name
        self.credit = credit
        self.credits_seen: list[float] = []
        self._queue, self._clock, self._served = queue, clock, served
        self._cost, self._left = cost, left

    def take_turn(self) -> None:
        self.credits_seen.append(self.credit)
        self._served.append(self.name)
        self._clock.advance(self._cost)
        self.credit -= self._cost
        self._queue.charge(self._cost)
        if self._left:
            self._left -= 1
            self._queue.wait(self)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    made = asyncio.new_event_loop()  # asyncio's: one_turn runs exactly one turn of it
    yield made
    made.close()


def _turn(loop: asyncio.AbstractEventLoop, served: list[str]) -> list[str]:
    """Who was served in one turn of the loop."""
    served.clear()
    one_turn(loop)
    return list(served)


def test_a_connection_overdrawn_by_k_quanta_skips_k_rounds(
    loop: asyncio.AbstractEventLoop,
) -> None:
    clock, served = SecondsClock(), list[str]()
    queue = TurnQueue(loop, quantum_s=1.0, budget_s=100.0, clock=clock)
    heavy = _Conn("heavy", queue, clock, served, credit=-3.0, left=10)
    light = _Conn("light", queue, clock, served, credit=0.0, left=10)
    queue.wait(heavy)
    queue.wait(light)
    rounds = [_turn(loop, served) for _ in range(5)]
    # Its credit climbs a quantum a round (-2, -1, 0): served once it is above zero,
    # after the connections with credit (served first in each turn).
    assert rounds == [["light"], ["light"], ["light"], ["light", "heavy"], ["light", "heavy"]]
    assert heavy.credits_seen == [1.0, 1.0]  # a quantum each turn, never more
    assert light.credits_seen == [1.0] * 5


def test_credit_left_over_never_adds_up_past_a_quantum(loop: asyncio.AbstractEventLoop) -> None:
    clock, served = SecondsClock(), list[str]()
    queue = TurnQueue(loop, quantum_s=1.0, budget_s=100.0, clock=clock)
    thrifty = _Conn("thrifty", queue, clock, served, credit=0.75, cost=0.25, left=1)
    queue.wait(thrifty)
    one_turn(loop)
    one_turn(loop)
    assert thrifty.credits_seen == [1.0, 1.0]


def test_a_turn_of_the_loop_spends_at_most_the_budget_then_the_rest_go_next_turn(
    loop: asyncio.AbstractEventLoop,
) -> None:
    clock, served = SecondsClock(), list[str]()
    queue = TurnQueue(loop, quantum_s=1.0, budget_s=3.0, clock=clock)
    for name in "abcde":
        queue.wait(_Conn(name, queue, clock, served, cost=1.0))
    assert queue.waits == 5 and len(queue) == 5
    assert _turn(loop, served) == ["a", "b", "c"]  # 3 s spent: the loop turns
    assert len(queue) == 2
    assert _turn(loop, served) == ["d", "e"]  # continued in the next turn
    assert len(queue) == 0
    assert _turn(loop, served) == []  # nothing waits: nothing runs


def test_a_connection_forgotten_while_it_waits_gets_no_turn(
    loop: asyncio.AbstractEventLoop,
) -> None:
    clock, served = SecondsClock(), list[str]()
    queue = TurnQueue(loop, quantum_s=1.0, budget_s=100.0, clock=clock)
    closed = _Conn("closed", queue, clock, served)
    open_ = _Conn("open", queue, clock, served)
    queue.wait(closed)
    queue.wait(open_)
    queue.forget(closed)  # it closed meanwhile
    assert _turn(loop, served) == ["open"]
    assert len(queue) == 0
    queue.forget(closed)  # again, not waiting: nothing happens
    queue.wait(closed)  # a connection may wait again after it was forgotten
    assert _turn(loop, served) == ["closed"]


def test_one_round_per_turn_of_the_loop_however_often_one_asks(
    loop: asyncio.AbstractEventLoop,
) -> None:
    clock, served = SecondsClock(), list[str]()
    queue = TurnQueue(loop, quantum_s=1.0, budget_s=100.0, clock=clock)
    a = _Conn("a", queue, clock, served, left=100)
    b = _Conn("b", queue, clock, served, left=100)
    for conn in (a, b, a, a):  # asked again while it waits: queued once
        queue.wait(conn)
    assert queue.waits == 2
    for _ in range(3):
        # Each asks for another turn during its own: served once per turn all the same,
        # so the loop turns (timers, new connections, other callbacks) between rounds.
        assert _turn(loop, served) == ["a", "b"]


def test_a_connection_deferred_with_credit_is_served_within_two_turns(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # A cheap client whose request came once the turn's budget was spent waits at most
    # two turns, not behind every connection paying off its costly requests: the
    # lanes take turns at going first.
    clock, served = SecondsClock(), list[str]()
    queue = TurnQueue(loop, quantum_s=1.0, budget_s=2.0, clock=clock)
    for name in ("owing-1", "owing-2", "owing-3", "owing-4", "owing-5"):
        queue.wait(_Conn(name, queue, clock, served, credit=0.0, cost=1.0))
    queue.charge(5.0)  # this turn's budget is spent
    queue.wait(_Conn("cheap", queue, clock, served, credit=0.5))
    assert _turn(loop, served) == ["owing-1", "owing-2"]  # the owing lane's turn first
    assert _turn(loop, served) == ["cheap", "owing-3", "owing-4"]  # then the fresh lane's
    assert _turn(loop, served) == ["owing-5"]


def test_a_flood_of_cheap_clients_does_not_starve_those_paying(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # Cheap clients that always come back with credit fill the fresh lane past the
    # budget; a new connection (no credit yet) is served all the same, every other turn.
    clock, served = SecondsClock(), list[str]()
    queue = TurnQueue(loop, quantum_s=2.0, budget_s=3.0, clock=clock)
    for n in range(6):
        queue.wait(_Conn(f"cheap-{n}", queue, clock, served, credit=1.0, cost=1.0, left=99))
    new = _Conn("new", queue, clock, served, credit=0.0, cost=1.0)
    queue.wait(new)
    turns = [_turn(loop, served) for _ in range(2)]
    assert "new" in turns[0] + turns[1]
    assert all(len(turn) == 3 for turn in turns)  # the budget holds every turn


def test_a_turn_that_fails_leaves_the_others_queued_and_served(
    loop: asyncio.AbstractEventLoop,
) -> None:
    clock, served = SecondsClock(), list[str]()
    queue = TurnQueue(loop, quantum_s=1.0, budget_s=100.0, clock=clock)

    class _Broken(_Conn):
        def take_turn(self) -> None:
            raise RuntimeError("a bug")

    queue.wait(_Broken("broken", queue, clock, served, credit=0.0))  # owing: first this turn
    queue.wait(_Conn("after", queue, clock, served, credit=0.5))
    loop.set_exception_handler(lambda _loop, _context: None)  # the bug, reported
    assert _turn(loop, served) == []  # the failing turn ends this run
    assert _turn(loop, served) == ["after"]  # the queue runs on all the same
