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
  connection a quantum per visit (deficit round robin) and spends at most a
  budget of loop time per turn of the loop, then lets the loop turn.

So a client paying for costly requests waits in proportion to what it took, the
loop turns at least every ``budget`` plus one request, and a cheap client is
answered in the next turn whatever the others send. On an idle loop the queue
runs every turn: a lone heavy client still gets all of it. New TLS connections
start with no credit: their handshakes (a signature each) are paced by the
queue, not served as fast as they arrive.

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
"""Loop time the queue spends per turn of the loop before letting it turn."""


class Turns(Protocol):
    """A connection as the queue sees it."""

    credit: float
    """Loop time (s) it may still spend; at most one quantum, below zero when overdrawn."""

    def take_turn(self) -> None:
        """Serve what it can with its credit; wait in the queue again if more is left."""


class TurnQueue:
    """Connections waiting for credit, served in turn within a budget per loop turn.

    ``clock`` reads seconds (``time.perf_counter``; a fake one in tests).
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
        self._budget_s = budget_s
        self.clock = clock
        self._waiting: collections.deque[Turns] = collections.deque()
        self._queued: set[Turns] = set()
        self._scheduled = False
        self.waits = 0  # times a connection was put in the queue

    def __len__(self) -> int:
        return len(self._waiting)

    def wait(self, connection: Turns) -> None:
        """Queue ``connection`` for a later turn (once, however often it is asked)."""
        if connection in self._queued:
            return
        self._queued.add(connection)
        self._waiting.append(connection)
        self.waits += 1
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)

    def forget(self, connection: Turns) -> None:
        """Drop a connection that closed (it stays in the deque until its visit)."""
        self._queued.discard(connection)

    def _run(self) -> None:
        self._scheduled = False
        clock, quantum = self.clock, self.quantum_s
        deadline = clock() + self._budget_s
        # One round at most per loop turn: each waiting connection gets its quantum once.
        for _ in range(len(self._waiting)):
            connection = self._waiting.popleft()
            if connection not in self._queued:
                continue  # closed while it waited
            self._queued.discard(connection)
            connection.credit = min(quantum, connection.credit + quantum)
            if connection.credit > 0:
                connection.take_turn()
            else:
                self._queued.add(connection)  # still overdrawn: its next quantum next round
                self._waiting.append(connection)
            if clock() >= deadline:
                break
        if self._waiting and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)
