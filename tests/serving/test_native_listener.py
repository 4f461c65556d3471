"""The native connection machine (``_core.Listener``) against its contract,
notes/issue-27/native-api.md.

Step mode (``threads=0``) runs one iteration of "thread 0"'s loop per ``step()`` on the
test's thread, so every test here but the threaded ones is deterministic: real sockets
(``socketpair()``, or a TCP pair on 127.0.0.1 where a reset matters) are adopted, the test
plays the peer on the other end and Python's side through the listener's commands and
events. Replies are compared byte for byte with ``fastpath.get_id_reply``, the Python fast
path's.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from snowflake_server import GeneratorSettings
from snowflake_server._ids.generator import NativeStateIdGenerator
from snowflake_server._native import native_core
from snowflake_server._thrift import fastpath
from tests.support.forking import in_a_child
from tests.support.waiting import wait_until

core: Any = native_core()
pytestmark = pytest.mark.skipif(core is None, reason="the native core is not built")

AGENT = b"native-test"
LIMIT = 16 * 1024 * 1024
PROMPTLY_S = 10.0
REPLY = 34


def frame(seqid: int, agent: bytes = AGENT) -> bytes:
    """A framed strict-binary get_id call, as a client sends it."""
    body = (
        struct.pack(">II", 0x80010001, 6)
        + b"get_id"
        + struct.pack(">i", seqid)
        + b"\x0b\x00\x01"
        + struct.pack(">I", len(agent))
        + agent
        + b"\x00"
    )
    return struct.pack(">I", len(body)) + body


def call(name: bytes, seqid: int) -> bytes:
    """A framed call of another method with an empty argument struct."""
    body = struct.pack(">II", 0x80010001, len(name)) + name + struct.pack(">i", seqid) + b"\x00"
    return struct.pack(">I", len(body)) + body


def reply_ids(data: bytes, seqids: list[int]) -> list[int]:
    """The ids of back-to-back get_id replies, each checked byte for byte against the
    Python fast path's reply to its seqid."""
    assert len(data) == REPLY * len(seqids), (len(data), len(seqids))
    ids = []
    for k, seqid in enumerate(seqids):
        one = data[k * REPLY : (k + 1) * REPLY]
        (id_,) = struct.unpack(">q", one[25:33])
        assert one == fastpath.get_id_reply(struct.pack(">i", seqid), id_)
        ids.append(id_)
    return ids


def recv_exactly(peer: socket.socket, n: int) -> bytes:
    data = b""
    peer.settimeout(PROMPTLY_S)
    while len(data) < n:
        chunk = peer.recv(n - len(data))
        assert chunk, f"EOF after {len(data)} of {n} bytes"
        data += chunk
    return data


def pending(peer: socket.socket) -> bytes:
    """Whatever the peer can read right now (its blocking mode untouched: a writer thread
    may be sending on it)."""
    data = b""
    while select.select([peer], [], [], 0)[0] and (chunk := peer.recv(65536)):
        data += chunk
    return data


class Rig:
    """A step-mode listener with a registered agent and an open generator state."""

    def __init__(self, budget: Any = None, **kwargs: Any) -> None:
        self.generator = NativeStateIdGenerator(GeneratorSettings(worker_id=1))
        self.state = self.generator.native_state
        self.state.set_gate(float("inf"))
        self.registry = core.AgentRegistry()
        self.agent_index = self.registry.add(AGENT, 0)
        threads = kwargs.pop("threads", 0)
        self.stats = core.NativeStats(max(1, threads))
        self.listener = core.Listener(
            threads, self.registry, self.stats, kwargs.pop("limit", LIMIT), budget=budget, **kwargs
        )
        self.listener.set_state(self.state)
        self.peers: list[socket.socket] = []

    def adopt(self, *, lease: bool = True, tcp: bool = False) -> tuple[int, socket.socket]:
        if tcp:
            with socket.create_server(("127.0.0.1", 0)) as server:
                peer = socket.create_connection(server.getsockname())
                ours, _ = server.accept()
        else:
            ours, peer = socket.socketpair()
        self.peers.append(peer)
        handle = self.listener.adopt(ours.detach())
        self.listener.reading(handle, True)
        if lease:
            assert self.listener.grant(handle, 0)
        return handle, peer

    def step(self, times: int = 1) -> None:
        for _ in range(times):
            self.listener.step(0)

    def events(self) -> list[tuple[Any, ...]]:
        events: list[tuple[Any, ...]] = self.listener.take_events()
        return events

    def handoffs(self) -> dict[str, int]:
        snapshot: dict[str, Any] = self.stats.snapshot()
        return {k: v for k, v in snapshot["handoffs"].items() if v}

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.listener.stop()


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    yield made
    made.close()


def make_rig(request: pytest.FixtureRequest, **kwargs: Any) -> Rig:
    made = Rig(**kwargs)
    request.addfinalizer(made.close)
    return made


# -- answered natively ----------------------------------------------------------------


def test_pipelined_get_ids_are_answered_byte_for_byte_many_per_read(rig: Rig) -> None:
    handle, peer = rig.adopt()
    seqids = [7, -1, 0, 2**31 - 1, *range(100, 140)]
    peer.sendall(b"".join(frame(s) for s in seqids))
    assert rig.listener.step(0) == 1  # one readiness, one read, every frame in it
    ids = reply_ids(recv_exactly(peer, REPLY * len(seqids)), seqids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert rig.listener.served(handle) == len(seqids)
    assert rig.stats.snapshot()["calls"] == len(seqids)
    assert rig.stats.snapshot(rig.registry)["ids"] == {0: len(seqids)}
    assert rig.listener.take_read_seen(handle) is True
    assert rig.listener.take_read_seen(handle) is False
    assert rig.events() == [] and rig.handoffs() == {}
    assert rig.listener.forwarded(handle) == 0


def test_a_partial_frame_is_kept_natively_then_completed(rig: Rig) -> None:
    handle, peer = rig.adopt()
    whole = frame(5)
    peer.sendall(whole[:17])
    rig.step()
    assert (rig.listener.partial(handle), rig.listener.served(handle)) == (17, 0)
    peer.sendall(whole[17:] + frame(6)[:3])
    rig.step()
    reply_ids(recv_exactly(peer, REPLY), [5])
    assert (rig.listener.partial(handle), rig.listener.served(handle)) == (3, 1)
    assert rig.events() == []


def test_a_grant_may_hand_native_the_start_of_a_frame_python_held(rig: Rig) -> None:
    """Python received a frame's start (the client's write ended mid-frame): it goes with
    the lease, kept as native's partial frame, if it can lead to a frame native serves."""
    handle, peer = rig.adopt(lease=False)
    peer.sendall(frame(1)[:9])
    rig.step()
    assert rig.events() == [(core.EV_DATA, handle, frame(1)[:9])]
    for prefix in (frame(1)[:12] + b"xet_id", b"\x00\x00\x00\x05hello"[:6], b"\xff\xff"):
        assert not rig.listener.grant(handle, 9, prefix), "one native could never serve"
    assert rig.listener.partial(handle) == 0
    long = frame(1, AGENT * 60)  # past the largest frame native serves
    assert not rig.listener.grant(handle, 9, long[:200])
    assert rig.listener.grant(handle, 9, frame(1)[:9])
    assert not rig.listener.grant(handle, 9, frame(1)[:9]), "leased already: no second prefix"
    assert rig.listener.partial(handle) == 9
    peer.sendall(frame(1)[9:] + frame(2))
    rig.step()
    reply_ids(recv_exactly(peer, 2 * REPLY), [1, 2])
    assert rig.events() == [] and rig.listener.forwarded(handle) == 9
    # Given back, its bytes are forwarded again (Python took them once already).
    peer.sendall(frame(3)[:12])
    rig.step()
    rig.listener.revoke(handle)
    assert rig.events() == [(core.EV_DATA, handle, frame(3)[:12])]
    assert rig.listener.forwarded(handle) == 21


def test_an_unknown_agent_gives_the_lease_back_at_its_frame(rig: Rig) -> None:
    handle, peer = rig.adopt()
    unknown = frame(3, b"stranger")
    rest = unknown + frame(4) + frame(5)[:9]
    peer.sendall(frame(1) + frame(2) + rest)
    rig.step()
    # Replies to the frames before it are already out; everything from it on is Python's.
    reply_ids(recv_exactly(peer, 2 * REPLY), [1, 2])
    assert rig.events() == [(core.EV_DATA, handle, rest)]
    assert rig.listener.forwarded(handle) == len(rest)
    assert rig.listener.partial(handle) == 0
    assert rig.handoffs() == {"agent": 1}
    # Leaseless now: what comes next is forwarded as read, parsed by nobody natively.
    peer.sendall(frame(5)[9:])
    rig.step()
    assert rig.events() == [(core.EV_DATA, handle, frame(5)[9:])]
    forwarded = len(rest) + len(frame(5)) - 9
    assert rig.listener.forwarded(handle) == forwarded
    # The grant waits for every forwarded byte to have reached Python.
    assert not rig.listener.grant(handle, len(rest))
    assert rig.listener.grant(handle, forwarded)
    peer.sendall(frame(6))
    rig.step()
    reply_ids(recv_exactly(peer, REPLY), [6])


def test_python_writes_go_out_after_native_replies_and_before_later_ones(rig: Rig) -> None:
    handle, peer = rig.adopt()
    handed = call(b"get_worker_id", 2)
    peer.sendall(frame(1) + handed)
    rig.step()
    assert rig.events() == [(core.EV_DATA, handle, handed)]
    assert rig.handoffs() == {"request": 1}
    assert rig.listener.write(handle, b"python's reply") == (0, False)
    assert rig.listener.grant(handle, len(handed))
    peer.sendall(frame(3))
    rig.step()
    data = recv_exactly(peer, 2 * REPLY + len(b"python's reply"))
    reply_ids(data[:REPLY], [1])
    assert data[REPLY:-REPLY] == b"python's reply"
    reply_ids(data[-REPLY:], [3])


@pytest.mark.parametrize(
    ("limit", "sent", "reason"),
    [
        # Another method: seen from its name's length, before its body.
        (LIMIT, call(b"get_worker_id", 1)[:12], "request"),
        # A length past the limit, or past what native serves: from the prefix alone.
        (100, struct.pack(">I", 120), "length"),
        (LIMIT, struct.pack(">I", 1_000_000), "length"),
        (LIMIT, struct.pack(">I", 0), "length"),
        # A get_id whose agent is longer than any native one.
        (LIMIT, frame(1, b"a" * 200)[:4], "length"),
        # Not even the strict header.
        (LIMIT, b"\x00\x00\x00\x20\x00\x01", "request"),
    ],
)
def test_anything_but_a_get_id_is_handed_over_before_its_body(
    request: pytest.FixtureRequest, limit: int, sent: bytes, reason: str
) -> None:
    rig = make_rig(request, limit=limit)
    handle, peer = rig.adopt()
    peer.sendall(frame(1) + sent)
    rig.step()
    reply_ids(recv_exactly(peer, REPLY), [1])
    assert rig.events() == [(core.EV_DATA, handle, sent)]
    assert rig.handoffs() == {reason: 1}
    assert rig.listener.partial(handle) == 0


def test_revoke_posts_the_kept_partial_frame_and_grant_is_refused_while_bytes_are_out(
    rig: Rig,
) -> None:
    handle, peer = rig.adopt()
    peer.sendall(frame(1)[:20])
    rig.step()
    assert rig.listener.partial(handle) == 20
    rig.listener.revoke(handle)
    rig.listener.revoke(handle)  # idempotent
    assert rig.events() == [(core.EV_DATA, handle, frame(1)[:20])]
    assert rig.listener.partial(handle) == 0 and rig.listener.forwarded(handle) == 20
    assert rig.handoffs() == {}  # a revoke is Python's decision, not a handoff
    assert not rig.listener.grant(handle, 0)
    assert not rig.listener.grant(handle, 19)
    # Refused means refused: the next bytes are still Python's.
    peer.sendall(frame(2))
    rig.step()
    assert rig.events() == [(core.EV_DATA, handle, frame(2))]
    assert rig.listener.served(handle) == 0
    forwarded = 20 + len(frame(2))
    assert rig.listener.grant(handle, forwarded)
    assert rig.listener.grant(handle, forwarded)  # already leased
    rig.listener.close(handle)
    assert not rig.listener.grant(handle, forwarded)


def test_leaseless_bytes_are_forwarded_as_read_and_reading_off_stops_reads(rig: Rig) -> None:
    handle, peer = rig.adopt(lease=False)
    peer.sendall(frame(1))
    rig.step()
    assert rig.events() == [(core.EV_DATA, handle, frame(1))]
    assert rig.listener.served(handle) == 0 and pending(peer) == b""
    rig.listener.reading(handle, False)
    peer.sendall(b"more")
    assert rig.listener.step(0) == 0
    assert rig.events() == [] and rig.listener.take_read_seen(handle) is True
    rig.listener.reading(handle, True)
    rig.step()
    assert rig.events() == [(core.EV_DATA, handle, b"more")]
    assert rig.listener.take_read_seen(handle) is True


def test_a_leaseless_connection_is_not_read_past_forward_high_until_python_consumes(
    request: pytest.FixtureRequest,
) -> None:
    rig = make_rig(request, forward_high=100)
    handle, peer = rig.adopt(lease=False)
    peer.sendall(b"x" * (core.NATIVE_READ + 1000))
    rig.step()
    assert rig.events() == [(core.EV_DATA, handle, b"x" * core.NATIVE_READ)]
    assert rig.listener.step(0) == 0 and rig.events() == []
    rig.listener.consume(handle, core.NATIVE_READ - 100)  # 100 left unconsumed: at the bound
    rig.step()
    assert rig.events() == [(core.EV_DATA, handle, b"x" * 1000)]


def test_a_refused_grant_still_counts_what_python_consumed(request: pytest.FixtureRequest) -> None:
    rig = make_rig(request, forward_high=100)
    handle, peer = rig.adopt(lease=False)
    peer.sendall(b"x" * (core.NATIVE_READ + 10))
    rig.step()
    assert rig.events() == [(core.EV_DATA, handle, b"x" * core.NATIVE_READ)]
    # A prefix native would never serve: refused, but the count holds, as consume()'s.
    assert not rig.listener.grant(handle, core.NATIVE_READ, b"\x00\x00\x00\x00")
    rig.step()
    assert rig.events() == [(core.EV_DATA, handle, b"x" * 10)]


class PythonSide:
    """The part of the Python shim these tests need: serves what native hands over (with
    the same generator, from Python: a native SLOW, an exhausted ms, is a handover too) and
    grants the lease back once it has caught up."""

    def __init__(self, rig: Rig, handles: list[int]) -> None:
        self.rig = rig
        self.buffers = dict.fromkeys(handles, b"")
        self.consumed = dict.fromkeys(handles, 0)
        self.lost: set[int] = set()
        self.served = 0

    def grant(self, handle: int) -> None:
        """The lease back if Python holds no bytes of it (native refuses it otherwise while
        bytes are on their way)."""
        if not self.buffers[handle]:
            self.rig.listener.grant(handle, self.consumed[handle])

    def serve(self) -> list[tuple[Any, ...]]:
        """Serves what was handed over; returns every other event."""
        listener = self.rig.listener
        others = []
        for kind, handle, value in listener.take_events():
            if kind == core.EV_DATA:
                self.consumed[handle] += len(value)
                buffer = self.buffers[handle] + value
                while len(buffer) >= 4 and len(buffer) >= 4 + int.from_bytes(buffer[:4], "big"):
                    n = 4 + int.from_bytes(buffer[:4], "big")
                    match = fastpath.match_get_id(buffer[:n], LIMIT)
                    assert match is not None, buffer[:n]
                    listener.write(
                        handle, fastpath.get_id_reply(match[0], self.rig.generator.next_id())
                    )
                    self.served += 1
                    buffer = buffer[n:]
                self.buffers[handle] = buffer
                listener.consume(handle, self.consumed[handle])
                self.grant(handle)
            else:
                others.append((kind, handle, value))
                if kind == core.EV_LOST:
                    self.lost.add(handle)
        return others


# -- back-pressure ---------------------------------------------------------------------


def small_buffers(rig: Rig, *, lease: bool) -> tuple[int, socket.socket]:
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)  # the kernel's minimum
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    rig.peers.append(peer)
    handle = rig.listener.adopt(ours.detach())
    rig.listener.reading(handle, True)
    if lease:
        assert rig.listener.grant(handle, 0)
    return handle, peer


def test_native_replies_past_high_stop_reading_and_below_low_resume(
    request: pytest.FixtureRequest,
) -> None:
    rig = make_rig(request, high=2000, low=500)
    handle, peer = small_buffers(rig, lease=True)
    side = PythonSide(rig, [handle])
    seqids = list(range(1000))
    writer = threading.Thread(target=peer.sendall, args=(b"".join(frame(s) for s in seqids),))
    writer.start()
    events: list[tuple[Any, ...]] = []
    # The peer reads nothing: native fills the socket, then out, then stops reading.
    wait_until(lambda: rig.listener.step(0) >= 0 and rig.listener.out_len(handle) > 2000, "high")
    events += side.serve()
    assert events == [(core.EV_WRITABLE, handle, False)]
    served = rig.listener.served(handle)
    assert rig.listener.step(0) == 0 and rig.listener.served(handle) == served
    received = b""
    while len(received) < REPLY * len(seqids):
        received += pending(peer)
        rig.listener.step(10)
        events += side.serve()
    writer.join(PROMPTLY_S)
    ids = reply_ids(received, seqids)
    assert ids == sorted(ids)
    assert events[:2] == [(core.EV_WRITABLE, handle, False), (core.EV_WRITABLE, handle, True)]
    flips = [e[2] for e in events]
    assert flips == [k % 2 == 1 for k in range(len(flips))], "False then True, in turn"


def test_a_write_past_high_says_it_paused_and_no_event_is_posted_for_it(
    request: pytest.FixtureRequest,
) -> None:
    rig = make_rig(request, high=100, low=10)
    handle, peer = small_buffers(rig, lease=False)
    blob = bytes(range(256)) * 4096  # 1 MiB: more than the socket takes
    unsent, paused = rig.listener.write(handle, blob)
    assert unsent > 100 and paused is True
    assert rig.listener.out_len(handle) == unsent
    # The peer makes room, but what is in out goes first: "end" waits behind it.
    received = pending(peer)
    assert received
    unsent2, paused2 = rig.listener.write(handle, b"end")
    assert (unsent2, paused2) == (unsent + 3, False)  # paused already
    events: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + PROMPTLY_S
    while len(received) < len(blob) + 3 and time.monotonic() < deadline:
        received += pending(peer)
        rig.listener.step(10)
        events += rig.events()
    assert received == blob + b"end"
    assert events == [(core.EV_WRITABLE, handle, True)]  # drained: resume, and only that
    assert rig.listener.out_len(handle) == 0


# -- closing ---------------------------------------------------------------------------


def test_close_flushes_what_is_out_then_closes_and_posts_lost(rig: Rig) -> None:
    handle, peer = small_buffers(rig, lease=True)
    peer.sendall(frame(1)[:10])
    rig.step()
    blob = b"z" * 300_000
    rig.listener.write(handle, blob)
    assert rig.listener.out_len(handle) > 0
    rig.listener.close(handle)
    rig.listener.close(handle)  # idempotent
    assert rig.listener.write(handle, b"late") == (0, False)
    assert rig.events() == []  # not before out is flushed
    received = b""
    events: list[tuple[Any, ...]] = []
    peer.settimeout(PROMPTLY_S)
    while (core.EV_LOST, handle, 0) not in events:
        received += pending(peer)
        rig.listener.step(10)
        events += rig.events()
    # The write paused (past high): draining resumes it, as asyncio's transport does while
    # it closes; the kept partial frame is dropped, not posted.
    assert events == [(core.EV_WRITABLE, handle, True), (core.EV_LOST, handle, 0)]
    while chunk := peer.recv(65536):
        received += chunk
    assert received == blob  # then EOF


def test_close_with_nothing_out_is_done_at_once(rig: Rig) -> None:
    handle, peer = rig.adopt()
    rig.listener.close(handle)
    assert rig.events() == [(core.EV_LOST, handle, 0)]
    peer.settimeout(PROMPTLY_S)
    assert peer.recv(10) == b""
    rig.listener.abort(handle)  # after the close: nothing more
    assert rig.events() == []


def test_abort_with_unsent_bytes_resets_the_peer(rig: Rig) -> None:
    handle, peer = rig.adopt(tcp=True)
    rig.listener.write(handle, b"q" * 10_000_000)
    assert rig.listener.out_len(handle) > 0
    rig.listener.abort(handle)
    rig.listener.abort(handle)
    assert rig.events() == [(core.EV_LOST, handle, 0)]
    peer.settimeout(PROMPTLY_S)

    def read_to_the_end() -> None:
        while peer.recv(1 << 20):
            pass

    with pytest.raises(ConnectionResetError):
        read_to_the_end()


def test_peer_eof_while_leased_posts_the_partial_frame_then_eof_and_stays_open(rig: Rig) -> None:
    """A half-close is told (EV_EOF) after the kept bytes; the connection stays open, as an
    asyncio transport until its protocol answers: Python may still write (a refusal of
    what came before the end), then closes."""
    handle, peer = rig.adopt()
    peer.sendall(frame(1) + frame(2)[:11])
    peer.shutdown(socket.SHUT_WR)
    rig.step()
    rig.step()
    reply_ids(recv_exactly(peer, REPLY), [1])
    assert rig.events() == [(core.EV_DATA, handle, frame(2)[:11]), (core.EV_EOF, handle, 0)]
    assert rig.listener.grant(handle, rig.listener.forwarded(handle)) is False, "nothing to read"
    rig.step()
    assert rig.events() == [], "told once; nothing more is read"
    assert rig.listener.write(handle, b"why")[0] == 0
    assert recv_exactly(peer, 3) == b"why"
    rig.listener.close(handle)
    rig.step()
    assert rig.events() == [(core.EV_LOST, handle, 0)]
    assert peer.recv(10) == b""


def test_peer_gone_while_leaseless_posts_eof_then_lost_once_closed(rig: Rig) -> None:
    handle, peer = rig.adopt(lease=False)
    peer.close()
    rig.step()
    assert rig.events() == [(core.EV_EOF, handle, 0)]
    rig.listener.close(handle)
    rig.step()
    assert rig.events() == [(core.EV_LOST, handle, 0)]


def test_a_stale_handle_after_free_and_reuse_does_nothing(request: pytest.FixtureRequest) -> None:
    rig = make_rig(request, max_conns=1)
    old, _ = rig.adopt()
    rig.listener.close(old)
    assert rig.events() == [(core.EV_LOST, old, 0)]
    rig.listener.free(old)
    new, peer = rig.adopt()
    assert new & 0xFFFFFFFF == old & 0xFFFFFFFF and new != old  # the slot, a new generation
    listener = rig.listener
    assert listener.write(old, b"x") == (0, False)
    assert listener.grant(old, 0) is False
    for command in (listener.revoke, listener.close, listener.abort, listener.free):
        assert command(old) is None
    listener.consume(old, 5)
    listener.reading(old, False)
    assert [listener.served(old), listener.partial(old), listener.out_len(old)] == [0, 0, 0]
    assert listener.forwarded(old) == 0 and listener.take_read_seen(old) is False
    assert listener.served(2**70) == 0  # no slot's at all
    peer.sendall(frame(9))
    rig.step()
    reply_ids(recv_exactly(peer, REPLY), [9])
    assert rig.events() == []
    # Every slot is taken: adopt refuses, and the fd it was given is closed.
    ours, other = socket.socketpair()
    rig.peers.append(other)
    fd = ours.detach()
    with pytest.raises(OSError, match="Too many open files") as refused:
        listener.adopt(fd)
    assert refused.value.errno == errno.EMFILE
    with pytest.raises(OSError, match="Bad file descriptor") as closed:
        os.fstat(fd)
    assert closed.value.errno == errno.EBADF


# -- the generator's answers -----------------------------------------------------------


@pytest.mark.parametrize("how", ["no state", "gate closed", "sealed", "contended"])
def test_a_frame_native_cannot_issue_for_is_given_back_with_its_reason(rig: Rig, how: str) -> None:
    handle, peer = rig.adopt()
    reason = "gate"
    if how == "no state":
        rig.listener.set_state(None)
    elif how == "gate closed":
        rig.state.close()
    elif how == "sealed":
        rig.generator.seal()
    else:
        reason = "contended"
        assert rig.state.acquire()
        rig.state.long_hold = True
    try:
        peer.sendall(frame(1) + frame(2))
        rig.step()
    finally:
        if how == "contended":
            rig.state.long_hold = False
            rig.state.release()
    assert rig.events() == [(core.EV_DATA, handle, frame(1) + frame(2))]
    assert rig.handoffs() == {reason: 1}
    assert rig.listener.served(handle) == 0 and pending(peer) == b""


def test_one_connection_pipelining_does_not_hold_back_another(rig: Rig) -> None:
    flood, flooder = rig.adopt()
    victim, peer = rig.adopt()
    side = PythonSide(rig, [flood, victim])
    frames = b"".join(frame(s) for s in range(10_000))
    flooder.setblocking(False)
    sent = flooder.send(frames)  # what the socket takes now: far more than one read
    flooder.setblocking(True)
    assert sent > 4 * core.NATIVE_READ
    writer = threading.Thread(target=flooder.sendall, args=(frames[sent:],))
    writer.start()
    peer.sendall(frame(77))
    rig.step()  # one round: one read per ready connection
    reply_ids(pending(peer), [77])
    assert rig.listener.served(flood) < 200  # one 4 KiB read of the flood
    received = b""
    deadline = time.monotonic() + 30
    while len(received) < REPLY * 10_000 and time.monotonic() < deadline:
        rig.listener.step(10)
        assert side.serve() == []
        received += pending(flooder)
    writer.join(PROMPTLY_S)
    ids = reply_ids(received, list(range(10_000)))
    assert ids == sorted(ids)


def test_take_audit_within_the_budget_counts_the_rest_dropped(
    request: pytest.FixtureRequest,
) -> None:
    budget = core.AuditBudget(3)
    rig = make_rig(request, budget=budget)
    _, peer = rig.adopt()
    peer.sendall(b"".join(frame(s) for s in range(5)))
    rig.step()
    ids = reply_ids(recv_exactly(peer, 5 * REPLY), list(range(5)))
    audit = rig.listener.take_audit()
    shift, epoch = rig.state.ts_shift, rig.state.epoch
    assert audit == [(i, (i >> shift) + epoch, rig.agent_index) for i in ids[:3]]
    assert (budget.pending, budget.dropped) == (3, 2)
    assert rig.listener.take_audit() == []
    budget.release(3)
    peer.sendall(frame(5))
    rig.step()
    (last,) = reply_ids(recv_exactly(peer, REPLY), [5])
    assert [entry[0] for entry in rig.listener.take_audit()] == [last]


def test_without_a_budget_nothing_is_audited(rig: Rig) -> None:
    _, peer = rig.adopt()
    peer.sendall(frame(1))
    rig.step()
    recv_exactly(peer, REPLY)
    assert rig.listener.take_audit() == []


def test_the_events_fd_is_readable_exactly_while_events_are_queued(rig: Rig) -> None:
    handle, peer = rig.adopt(lease=False)
    fd = rig.listener.events_fd

    def readable() -> bool:
        return bool(select.select([fd], [], [], 0)[0])

    assert not readable()
    peer.sendall(b"a")
    rig.step()
    peer.sendall(b"b")
    rig.step()
    assert readable()
    assert rig.events() == [(core.EV_DATA, handle, b"a"), (core.EV_DATA, handle, b"b")]
    assert not readable()


def test_events_that_take_events_could_not_hand_over_stay_queued_in_order(rig: Rig) -> None:
    """Out of memory while building the list: a lost EV_DATA would corrupt a stream and a
    lost EV_LOST leave a slot never freed, so every event stays queued, and readable."""
    testcapi = pytest.importorskip("_testcapi")
    handle, peer = rig.adopt(lease=False)
    fd = rig.listener.events_fd
    failures = 0
    for start in range(40):
        sent = [bytes([65 + start % 26]) * (k + 1) for k in range(3)]
        for chunk in sent:
            peer.sendall(chunk)
            rig.step()
        testcapi.set_nomemory(start)
        try:
            events = rig.listener.take_events()
        except MemoryError:
            events = None
        finally:
            testcapi.remove_mem_hooks()
        if events is None:
            failures += 1
            assert select.select([fd], [], [], 0)[0]
            events = rig.events()
        assert events == [(core.EV_DATA, handle, chunk) for chunk in sent]
        if failures and start > failures + 5:
            break
    assert failures


def test_step_mode_and_thread_mode_refuse_each_other(rig: Rig) -> None:
    with pytest.raises(RuntimeError):
        rig.listener.start()
    threaded = core.Listener(1, rig.registry, rig.stats, LIMIT)
    with pytest.raises(RuntimeError):
        threaded.step(0)
    assert threaded.stop() is True
    assert threaded.stop() is True
    with pytest.raises(RuntimeError):
        threaded.adopt(0)
    with pytest.raises(ValueError, match="fewer threads"):
        core.Listener(2, rig.registry, rig.stats, LIMIT)
    with pytest.raises(TypeError):
        rig.listener.set_state(object())


# -- threads ---------------------------------------------------------------------------


class Rounds:
    """Counts the rounds of a test's loop, so that a client can send its next burst only
    after the loop turned (revokes then interleave with the bursts however fast native is)."""

    def __init__(self) -> None:
        self.count = 0
        self.turned = threading.Condition()

    def turn(self) -> None:
        with self.turned:
            self.count += 1
            self.turned.notify_all()

    def wait_past(self, count: int) -> int:
        with self.turned:
            self.turned.wait_for(lambda: self.count > count, PROMPTLY_S)
            return self.count


def client(peer: socket.socket, count: int, out: list[int], rounds: Rounds | None = None) -> None:
    frames = b"".join(frame(s) for s in range(count))
    peer.settimeout(PROMPTLY_S)

    def send() -> None:
        if rounds is None:
            peer.sendall(frames)
            return
        seen = 0
        for at in range(0, len(frames), 20 * len(frame(0))):  # 20 frames a burst
            seen = rounds.wait_past(seen)
            peer.sendall(frames[at : at + 20 * len(frame(0))])

    writer = threading.Thread(target=send)
    writer.start()
    out.extend(reply_ids(recv_exactly(peer, REPLY * count), list(range(count))))
    writer.join(PROMPTLY_S)


def test_native_threads_serve_pipelining_clients_with_unique_increasing_ids(
    request: pytest.FixtureRequest,
) -> None:
    rig = make_rig(request, threads=2)
    rig.listener.start()
    conns = [rig.adopt() for _ in range(4)]
    side = PythonSide(rig, [h for h, _ in conns])
    results: list[list[int]] = [[] for _ in conns]
    threads = [
        threading.Thread(target=client, args=(peer, 5000, out))
        for (_, peer), out in zip(conns, results, strict=True)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        select.select([rig.listener.events_fd], [], [], 0.05)
        side.serve()
    for t in threads:
        t.join(PROMPTLY_S)
    assert all(len(r) == 5000 for r in results)
    for ids in results:
        assert ids == sorted(ids)
    everything = [i for r in results for i in r]
    assert len(set(everything)) == len(everything)
    assert rig.stats.snapshot()["calls"] > 0
    ticks = rig.listener.ticks()
    assert len(ticks) == 2 and all(since < 5.0 for since, _ in ticks)
    assert rig.listener.stop() is True
    assert rig.listener.served(conns[0][0]) == 0  # freed by stop
    assert side.lost == set()  # stop posts nothing
    side.serve()
    assert side.lost == set()


def test_leases_revoked_and_granted_while_native_threads_serve_keep_every_reply_in_order(
    request: pytest.FixtureRequest,
) -> None:
    """Python takes leases back at random moments (mid-read, mid-frame) while native threads
    serve, serves what it was handed and grants again: revokes race give-backs and grants
    race reads, and every client still gets its replies in order, ids unique."""
    rig = make_rig(request, threads=2)
    rig.listener.start()
    conns = [rig.adopt() for _ in range(4)]
    handles = [h for h, _ in conns]
    side = PythonSide(rig, handles)
    results: list[list[int]] = [[] for _ in conns]
    rounds = Rounds()
    threads = [
        threading.Thread(target=client, args=(peer, 3000, out, rounds))
        for (_, peer), out in zip(conns, results, strict=True)
    ]
    for t in threads:
        t.start()
    revokes = 0
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        handle = handles[revokes % len(handles)]
        rig.listener.revoke(handle)
        revokes += 1
        side.serve()
        side.grant(handle)
        rounds.turn()
    for t in threads:
        t.join(PROMPTLY_S)
    assert all(len(r) == 3000 for r in results)
    for ids in results:
        assert ids == sorted(ids)
    everything = [i for r in results for i in r]
    assert len(set(everything)) == len(everything)
    # Each reply came from one side, none from both.
    assert rig.stats.snapshot()["calls"] + side.served == len(everything)
    assert revokes >= 3000 // 20
    assert rig.listener.stop() is True


def test_a_thread_whose_epoll_fails_loses_its_connections_and_says_it_died(
    request: pytest.FixtureRequest,
) -> None:
    rig = make_rig(request, threads=2)
    rig.listener.start()
    (first, _), (second, peer) = rig.adopt(), rig.adopt()  # round robin: threads 0 and 1
    rig.listener.break_epoll(0)
    events: list[tuple[Any, ...]] = []

    def died() -> bool:
        events.extend(rig.events())
        return (core.EV_THREAD_DIED, 0, errno.EINVAL) in events

    wait_until(died, "thread 0 died")
    assert events == [(core.EV_LOST, first, errno.EINVAL), (core.EV_THREAD_DIED, 0, errno.EINVAL)]
    assert rig.listener.write(first, b"x") == (0, False)
    # The other thread serves on, and takes every new connection.
    third, other = rig.adopt()
    for handle, client_end in [(second, peer), (third, other)]:
        client_end.sendall(frame(1))
        reply_ids(recv_exactly(client_end, REPLY), [1])
        assert rig.listener.served(handle) == 1
    assert rig.listener.stop() is True


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_start_that_cannot_start_every_thread_leaves_none_running(rig: Rig) -> None:
    stats = core.NativeStats(3)
    listener = core.Listener(3, rig.registry, stats, LIMIT)
    before = thread_count()
    core.fail_thread_start(2)
    with pytest.raises(OSError, match="Resource temporarily unavailable") as raised:
        listener.start()
    assert raised.value.errno == errno.EAGAIN
    assert thread_count() == before
    listener.start()  # the seam fails once
    assert thread_count() == before + 3
    assert listener.stop(timeout_s=PROMPTLY_S) is True
    assert thread_count() == before


def test_a_forked_child_cannot_use_its_parents_listener(rig: Rig) -> None:
    handle, _ = rig.adopt()

    def child() -> dict[str, object]:
        report: dict[str, object] = {}
        calls: list[tuple[str, Callable[[], object]]] = [
            ("step", lambda: rig.listener.step(0)),
            ("take_events", rig.listener.take_events),
            ("write", lambda: rig.listener.write(handle, b"x")),
            ("adopt", lambda: rig.listener.adopt(0)),
            ("stop", rig.listener.stop),
        ]
        for name, run in calls:
            try:
                run()
                report[name] = "no error"
            except RuntimeError as e:
                report[name] = str(e)
        return report

    report = in_a_child(child)
    for name, said in report.items():
        assert "inherited across a fork" in str(said), (name, said)
    assert rig.listener.write(handle, b"") == (0, False)  # the parent's still works
