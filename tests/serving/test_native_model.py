"""The C connection machine (``_core.Listener`` in step mode) diffed against its Python
model (tests/support/native_model.py), which is small enough to be read as the contract.

A hypothesis state machine drives both with the same operations on twin socketpairs:
a peer sends bytes (pipelined get_id calls of known and unknown agents, other methods,
mutations, garbage, cut anywhere) or half-closes; the machines step; "Python" takes the
events, consumes, writes, grants (with or without a kept frame prefix, with a right or
a wrong count), revokes, pauses reading, closes, aborts, frees, registers an agent and
takes the generator state away and back; a peer reads. After every step both must have
posted the same events per connection, and the peers must read the same bytes.

The model issues C's own ids: the C machine steps first, its ids come back through
``take_audit`` in issue order, and the model's id source hands out exactly those, so a
frame one serves and the other does not shows as a SLOW give-back on one side only. Within
a step C serves connections in epoll's order and the model in slot order, so the peers'
bytes are compared with each reply's id masked, and each connection's ids must rise.
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from snowflake_server import GeneratorSettings
from snowflake_server._ids.generator import NativeStateIdGenerator
from snowflake_server._native import native_core
from tests.server.test_fastpath import get_id_frame
from tests.server.test_native_parser import frames
from tests.support import native_model
from tests.support.native_model import ModelListener, ModelRegistry

core: Any = native_core()
pytestmark = pytest.mark.skipif(core is None, reason="the native core is not built")

LIMIT = 64 * 1024
# Small marks so that back-pressure, the forwarding stop and their events happen within a
# few rules; a small send buffer so that the sockets fill.
HIGH, LOW, FORWARD_HIGH = 512, 128, 2048
SNDBUF = 4096
MAX_CONNS = 4
AGENTS = [b"svc-a", b"svc-b", b"", b"x" * 200]
KNOWN = AGENTS[:1]
EVENT_NAMES = ("EV_DATA", "EV_WRITABLE", "EV_LOST", "EV_THREAD_DIED", "EV_EOF")


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """Mostly get_id calls of the agents this test may register, sometimes anything the
    parser tests generate."""
    if draw(st.integers(0, 3)) == 0:
        return draw(frames())
    return get_id_frame(draw(st.sampled_from(AGENTS)), draw(st.integers(-(2**31), 2**31 - 1)))


@dataclass(eq=False)
class Side:
    """One machine's end of a twin connection, and what "Python" has seen of it."""

    handle: int
    peer: socket.socket
    taken: int = 0  # EV_DATA bytes taken
    events: list[tuple[Any, ...]] = field(default_factory=list)
    received: bytearray = field(default_factory=bytearray)


@dataclass(eq=False)
class Twin:
    c: Side
    m: Side
    lost: bool = False
    freed: bool = False
    half_closed: bool = False
    peer_closed: bool = False
    unsent: bytes = b""  # what the peer wrote but has not sent yet


def _pair() -> tuple[socket.socket, socket.socket]:
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
    peer.setblocking(False)
    return ours, peer


_REPLY_HEAD = b"\x00\x00\x00\x1e\x80\x01\x00\x02\x00\x00\x00\x06get_id"
_ID_AT, _REPLY = 25, 34


def _replies(stream: bytes | bytearray) -> tuple[bytes, list[int]]:
    """``stream`` with each get_id reply's id zeroed, and those ids in order. Python's
    writes here are runs of one byte value, which never hold a reply's head."""
    masked, ids, at = bytearray(stream), [], stream.find(_REPLY_HEAD)
    while at >= 0 and at + _REPLY <= len(stream):
        ids.append(int.from_bytes(stream[at + _ID_AT : at + _ID_AT + 8], "big", signed=True))
        masked[at + _ID_AT : at + _ID_AT + 8] = bytes(8)
        at = stream.find(_REPLY_HEAD, at + _REPLY)
    return bytes(masked), ids


def _drain(peer: socket.socket) -> bytes:
    """What the (non-blocking) peer can read now."""
    data = b""
    while True:
        try:
            chunk = peer.recv(65536)
        except (BlockingIOError, ConnectionResetError):
            return data
        if not chunk:
            return data
        data += chunk


def _outcome(command: Callable[..., Any], *args: Any) -> Any:
    try:
        return command(*args)
    except (ValueError, OSError) as e:
        return type(e)


def _probe(name: str) -> Callable[[Any, Side], Any]:
    return lambda machine, side: getattr(machine, name)(side.handle)


class ListenerDiff(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        assert all(getattr(core, n) == getattr(native_model, n) for n in EVENT_NAMES)
        self.names = {getattr(core, n): n for n in EVENT_NAMES}
        self.generator = NativeStateIdGenerator(GeneratorSettings(worker_id=3))
        self.generator.native_state.set_gate(math.inf)
        self.c_registry = core.AgentRegistry()
        self.m_registry = ModelRegistry()
        for agent in KNOWN:
            assert self.c_registry.add(agent, 0) == self.m_registry.add(agent, 0)
        self.stats = core.NativeStats(1)
        self.budget = core.AuditBudget(1 << 20)
        marks = {"high": HIGH, "low": LOW, "forward_high": FORWARD_HIGH, "max_conns": MAX_CONNS}
        self.c = core.Listener(0, self.c_registry, self.stats, LIMIT, budget=self.budget, **marks)
        self.m = ModelListener(0, self.m_registry, None, LIMIT, **marks)
        self.m.strict = False  # the C listener takes a write under the lease too: diff it
        self.issued: deque[int] = deque()  # C's ids, not yet handed out by the model
        self.c_ids: list[int] = []
        self.state_on = True
        self._set_state(on=True)
        self.twins: list[Twin] = []
        self.peers: list[socket.socket] = []

    # -- helpers -----------------------------------------------------------------------

    def _model_ids(self) -> int | None:
        return self.issued.popleft() if self.issued else None

    def _set_state(self, *, on: bool) -> None:
        self.c.set_state(self.generator.native_state if on else None)
        self.m.set_state(self._model_ids if on else None)
        self.state_on = on

    def _both(self, twin: Twin, command: Callable[[Any, Side], Any]) -> Any:
        """Run a command on both machines; they must answer (or refuse) alike."""
        answer = _outcome(command, self.c, twin.c)
        assert _outcome(command, self.m, twin.m) == answer
        return answer

    def _take_events(self) -> None:
        by_handle: dict[tuple[str, int], Side] = {}
        for twin in self.twins:
            if not twin.freed:
                by_handle["c", twin.c.handle] = twin.c
                by_handle["m", twin.m.handle] = twin.m
        for key, machine in (("c", self.c), ("m", self.m)):
            for event in machine.take_events():
                kind, handle, value = event
                side = by_handle[key, handle]
                side.events.append((self.names[kind], value))
                if kind == core.EV_DATA:
                    side.taken += len(value)
        for twin in self.twins:
            assert twin.c.events == twin.m.events
            twin.lost = any(name == "EV_LOST" for name, _ in twin.c.events)

    # -- the peers -----------------------------------------------------------------------

    @precondition(lambda self: len([t for t in self.twins if not t.freed]) < MAX_CONNS)
    @rule(reading=st.booleans(), lease=st.booleans())
    def adopt(self, reading: bool, lease: bool) -> None:
        sides = []
        for machine in (self.c, self.m):
            ours, peer = _pair()
            self.peers.append(peer)
            handle = machine.adopt(ours.detach())
            machine.reading(handle, reading)
            sides.append(Side(handle, peer))
        twin = Twin(sides[0], sides[1])
        self.twins.append(twin)
        if lease:
            assert self._both(twin, lambda machine, side: machine.grant(side.handle, 0))

    def _send(self, twin: Twin, size: int) -> None:
        """The first ``size`` bytes the peer wrote, sent alike on both; what a full socket
        does not take stays for later."""
        stream, sent = twin.unsent[:size], []
        for side in (twin.c, twin.m):
            try:
                sent.append(side.peer.send(stream))
            except BlockingIOError:
                sent.append(0)
            except OSError as e:  # the machine closed its end first: the same on both
                sent.append(-(e.errno or 1))
        assert sent[0] == sent[1]
        twin.unsent = twin.unsent[max(sent[0], 0) :]

    @precondition(lambda self: any(not t.half_closed for t in self.twins))
    @rule(data=st.data(), more=st.lists(requests(), max_size=6))
    def peer_sends(self, data: st.DataObject, more: list[bytes]) -> None:
        """A few requests back to back, cut anywhere: the rest goes with a later send."""
        twin = data.draw(st.sampled_from([t for t in self.twins if not t.half_closed]))
        twin.unsent += b"".join(more)
        self._send(twin, data.draw(st.integers(0, len(twin.unsent))))
        if data.draw(st.booleans()):
            self.step(1)  # most often the machines read what came before more comes

    @precondition(lambda self: any(not t.half_closed for t in self.twins))
    @rule(data=st.data(), count=st.integers(50, 400))
    def peer_floods(self, data: st.DataObject, count: int) -> None:
        """Enough known calls back to back for several native reads and a full socket."""
        twin = data.draw(st.sampled_from([t for t in self.twins if not t.half_closed]))
        twin.unsent += b"".join(get_id_frame(KNOWN[0], k) for k in range(count))
        self._send(twin, len(twin.unsent))

    @precondition(lambda self: any(not t.half_closed for t in self.twins))
    @rule(data=st.data())
    def peer_half_closes(self, data: st.DataObject) -> None:
        twin = data.draw(st.sampled_from([t for t in self.twins if not t.half_closed]))
        for side in (twin.c, twin.m):
            with contextlib.suppress(OSError):  # the machine closed its end: on both
                side.peer.shutdown(socket.SHUT_WR)
        twin.half_closed = True

    @precondition(lambda self: any(not t.peer_closed for t in self.twins))
    @rule(data=st.data(), reset=st.booleans())
    def peer_closes(self, data: st.DataObject, reset: bool) -> None:
        """A peer gone: with unread replies a unix socket's close resets the other end."""
        twin = data.draw(st.sampled_from([t for t in self.twins if not t.peer_closed]))
        if not reset:
            self.peers_read()  # nothing left unread: a plain EOF
        for side in (twin.c, twin.m):
            side.peer.close()
        twin.half_closed = twin.peer_closed = True

    @precondition(lambda self: bool(self.twins))
    @rule()
    def peers_read(self) -> None:
        for twin in self.twins:
            if twin.peer_closed:
                continue
            for side in (twin.c, twin.m):
                side.received += _drain(side.peer)
            # Replies byte for byte but their ids: when several connections have frames in
            # one step, C serves them in epoll's order and the model in slot order, so an
            # id may go to another connection. Each connection's ids rise, on both.
            c_bytes, c_ids = _replies(twin.c.received)
            m_bytes, m_ids = _replies(twin.m.received)
            assert c_bytes == m_bytes
            assert c_ids == sorted(set(c_ids)) and m_ids == sorted(set(m_ids))

    # -- the machines --------------------------------------------------------------------

    @rule(times=st.integers(1, 3))
    def step(self, times: int) -> None:
        for _ in range(times):
            self.c.step(0)
            entries = self.c.take_audit()
            self.budget.release(len(entries))
            ids = [entry[0] for entry in entries]
            self.issued.extend(ids)
            self.c_ids += ids
            self.m.step(0)
            assert not self.issued, "the C machine served a frame the model did not"
        self._take_events()

    # -- Python's commands ---------------------------------------------------------------

    def _live(self) -> list[Twin]:
        return [t for t in self.twins if not t.freed]

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data(), off_by=st.sampled_from([0, 0, 0, 1, -1]), prefix=st.binary(max_size=40))
    def grant(self, data: st.DataObject, off_by: int, prefix: bytes) -> None:
        twin = data.draw(st.sampled_from(self.twins))  # freed ones too: stale handles
        kind = data.draw(st.sampled_from(["none", "none", "none", "frame", "random"]))
        if kind == "frame":
            whole = get_id_frame(data.draw(st.sampled_from(AGENTS)), 7)
            prefix = whole[: data.draw(st.integers(1, len(whole)))]
        elif kind == "none":
            prefix = b""
        self._both(
            twin,
            lambda machine, side: machine.grant(side.handle, max(0, side.taken + off_by), prefix),
        )

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:
        self._both(data.draw(st.sampled_from(self.twins)), lambda m, s: m.revoke(s.handle))

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data())
    def consume(self, data: st.DataObject) -> None:
        twin = data.draw(st.sampled_from(self.twins))
        self._both(twin, lambda m, s: m.consume(s.handle, s.taken))

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data(), on=st.booleans())
    def reading(self, data: st.DataObject, on: bool) -> None:
        self._both(data.draw(st.sampled_from(self.twins)), lambda m, s: m.reading(s.handle, on))

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data(), size=st.sampled_from([1, 34, 600, 5000]))
    def python_writes(self, data: st.DataObject, size: int) -> None:
        twin = data.draw(st.sampled_from(self.twins))
        blob = bytes([len(self.c_ids) % 251]) * size
        self._both(twin, lambda m, s: m.write(s.handle, blob))

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data(), how=st.sampled_from(["close", "abort"]))
    def python_closes(self, data: st.DataObject, how: str) -> None:
        twin = data.draw(st.sampled_from(self.twins))
        self._both(twin, lambda m, s: getattr(m, how)(s.handle))
        if how == "abort":
            self._take_events()

    @precondition(lambda self: any(t.lost and not t.freed for t in self.twins))
    @rule(data=st.data())
    def python_frees(self, data: st.DataObject) -> None:
        twin = data.draw(st.sampled_from([t for t in self.twins if t.lost and not t.freed]))
        self._both(twin, lambda m, s: m.free(s.handle))
        twin.freed = True

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data())
    def python_asks_whether_native_read(self, data: st.DataObject) -> None:
        self._both(data.draw(st.sampled_from(self.twins)), lambda m, s: m.take_read_seen(s.handle))

    @rule(agent=st.sampled_from(AGENTS[1:]))
    def python_registers(self, agent: bytes) -> None:
        assert _outcome(self.c_registry.add, agent, 1) == _outcome(self.m_registry.add, agent, 1)

    @rule(on=st.booleans())
    def gate(self, on: bool) -> None:
        self._set_state(on=on)

    # -- what must hold after every rule -------------------------------------------------

    @invariant()
    def probes_agree(self) -> None:
        for twin in self.twins:
            for probe in ("served", "partial", "out_len", "forwarded"):
                self._both(twin, _probe(probe))
        handoffs = {k: v for k, v in self.stats.snapshot()["handoffs"].items() if v}
        assert handoffs == dict(self.m.handoffs)
        assert self.stats.snapshot()["calls"] == self.m.calls == len(self.c_ids)
        assert self.c_ids == sorted(set(self.c_ids))  # strictly increasing, none twice

    def teardown(self) -> None:
        try:  # what the last rules posted and sent is compared too
            self._take_events()
            self.peers_read()
        finally:
            self.c.stop()
            self.m.stop()
            # Hypothesis keeps the machine a while: the C listener's epoll and eventfds
            # are closed when it is freed, so free it now.
            del self.c
            for peer in self.peers:
                peer.close()


ListenerDiff.TestCase.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
test_the_c_machine_does_what_its_model_does = ListenerDiff.TestCase
