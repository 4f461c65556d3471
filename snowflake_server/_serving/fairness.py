"""Fair by work: each connection's share of the event loop, priced by what its requests
cost rather than by how many it sends.

Every connection serves on the loop's one thread, so a connection's turn is time
that every other client waits. A count of requests per turn is no price: a valid
1 KB Thrift call can cost twenty plain ones to decode, a ``get_ids(4096)`` a
whole ms of the ids the generator can make, a TLS handshake a signature. So each
request is priced by the loop time it actually took (decoding, TLS, answering: the
clock read once per request), less the generator's waits for the next ms (the ids
it waited for were taken by others) and plus a batch's share of a ms of ids (see
:data:`~snowflake_server._ids.clocks.METER`), and each connection spends a credit:

- a connection with credit serves what it has received at once (most clients:
  one call at a time, well under a quantum), until its credit is spent;
- one whose credit is spent (a flood, or one expensive request that overdrew it)
  stops being read and waits in :class:`TurnQueue`, which gives each waiting
  connection a quantum per visit (deficit round robin);
- all serving, at once or from the queue, spends at most a budget of loop time per
  turn of the loop; what arrives once it is spent waits for the next turn.

So a client paying for costly requests waits in proportion to what it took, a turn of
the loop serves at most about twice the ``budget`` plus one request (besides the
protocols' fast paths: one plain call per read, never charged), and a cheap client
deferred by a spent budget waits in a lane that goes first every other turn, served
in order within it. The lane of those
paying goes first every other turn, so it is never starved by a flood of cheap
clients. On an idle loop the queue runs every turn: a lone heavy client still gets
all of it. New connections start with no credit: the first request of each (one
costly call per connection, a TLS handshake: a signature) is paced by the queue,
not served as fast as connections arrive. The turn's budget is charged the loop
time itself, waits for the next ms included; only a connection's own price gives
those waits back.

Hand-written: asyncio has no scheduling by cost (its callbacks run in order,
each as long as it likes), and uvicorn's flow control is by bytes buffered.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["QUANTUM_S", "TURN_BUDGET_S", "TurnQueue", "Turns"]

QUANTUM_S = 0.0001
"""Loop time a connection may spend per turn (about 20 plain ``get_id`` calls)."""
TURN_BUDGET_S = 0.002
"""Loop time serving may spend per turn of the loop (about twice that at most) before
what arrives waits for the next turn."""


class Turns(Protocol):
    """A connection as the queue sees it."""

    credit: float
    """Loop time (s) it may still spend; at most one quantum, below zero when overdrawn."""

    def take_turn(self) -> None:
        """Serve what it can with its credit; wait in the queue again if more is left."""


class TurnQueue:
    """The loop's turns: what serving has cost in this turn of the loop, and the
    connections waiting for a later one, served within a budget per turn.

    Connections charge what each request cost (:meth:`charge`); once a turn has
    spent ``budget_s``, what arrives waits for the next turn. Two lanes wait:
    connections with credit, deferred only because the turn's budget was spent
    (served first, with a fresh quantum: a cheap client is answered in the next
    turn), and connections that overspent, given a quantum per round until their
    credit is positive again (deficit round robin). ``clock`` reads seconds
    (``time.perf_counter``; a fake one in tests).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        quantum_s: float = QUANTUM_S,
        budget_s: float = TURN_BUDGET_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._loop = loop
        self.quantum_s = quantum_s
        self.budget_s = budget_s
        self.clock = clock
        self.spent = 0.0
        """Loop time (s) serving has cost since this turn of the loop began."""
        self._turn_pending = False
        self._turn = 0
        self._owing_first = False
        self._fresh: collections.deque[Turns] = collections.deque()
        self._owing: collections.deque[Turns] = collections.deque()
        self._queued: set[Turns] = set()
        self._scheduled = False
        self.waits = 0  # times a connection was put in the queue

    def __len__(self) -> int:
        return len(self._queued)

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of serving against this turn of the loop."""
        self.spent += seconds
        if not self._turn_pending:
            self._turn_pending = True
            self._loop.call_soon(self._next_turn, self._turn)

    def _next_turn(self, turn: int | None = None) -> None:
        """A new turn of the loop: nothing spent in it yet (``turn``: the one it ends;
        a turn already ended by :meth:`_run` is not ended twice)."""
        if turn is None or turn == self._turn:
            self._turn += 1
            self._turn_pending = False
            self.spent = 0.0

    def wait(self, connection: Turns) -> None:
        """Queue ``connection`` for a later turn (once, however often it is asked)."""
        if connection in self._queued:
            return
        self._queued.add(connection)
        (self._fresh if connection.credit > 0 else self._owing).append(connection)
        self.waits += 1
        self._schedule()

    def forget(self, connection: Turns) -> None:
        """Drop a connection that closed (it stays in its lane until its visit)."""
        self._queued.discard(connection)

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        if self._turn_pending:
            # What was charged is from an earlier turn, or from this one before the
            # queue's own run: either way a turn spends at most about twice the budget.
            self._next_turn()
        # The lanes take turns at going first: a flood of cheap clients cannot keep
        # those paying off (a new connection among them) from ever being served.
        self._owing_first = not self._owing_first
        # One round per turn: those that join a lane during this run wait for the next.
        fresh, owing = len(self._fresh), len(self._owing)
        try:
            if self._owing_first:
                self._round_of_owing(owing)
                self._round_of_fresh(fresh)
            else:
                self._round_of_fresh(fresh)
                self._round_of_owing(owing)
        finally:
            if self._fresh or self._owing:
                self._schedule()

    def _round_of_fresh(self, count: int) -> None:
        """The first ``count`` connections deferred with credit: a fresh quantum and
        their turn each."""
        fresh, queued = self._fresh, self._queued
        for _ in range(count):
            if self.spent >= self.budget_s:
                return
            connection = fresh.popleft()
            if connection in queued:
                queued.discard(connection)
                connection.credit = self.quantum_s
                connection.take_turn()

    def _round_of_owing(self, count: int) -> None:
        """The first ``count`` overdrawn connections: a quantum each, and their turn
        once above zero."""
        owing, queued, quantum = self._owing, self._queued, self.quantum_s
        for _ in range(count):
            if self.spent >= self.budget_s:
                return
            connection = owing.popleft()
            if connection not in queued:
                continue  # closed while it waited
            connection.credit = min(quantum, connection.credit + quantum)
            if connection.credit > 0:
                queued.discard(connection)
                connection.take_turn()
            else:
                owing.append(connection)  # still overdrawn: its next quantum next round
