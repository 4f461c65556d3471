"""The native listener's parser, agent registry, counters and audit budget (_listener.h)
against their Python references.

The parser must be the pure fast path bit for bit: ``_core.match_get_id`` is
``fastpath.match_get_id`` and ``_core.get_id_reply`` is ``fastpath.get_id_reply`` on
generated frames (valid, mutated, other methods, truncated, oversize, empty); and
``scan_prefix``, which decides on a connection's unparsed bytes, says NEED_MORE exactly
when some completion of the bytes is a frame native serves (a reference model enumerates
them), so a frame that matches said NEED_MORE at every prefix and a HANDOVER is final.
The registry is bounded (full: a miss, Python serves) and its lock-free lookups stay
right while Python adds; the per-thread counters sum at snapshot; the audit budget decides
as AuditLog's locked check does.
"""

from __future__ import annotations

import bisect
import struct
import threading
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from snowflake_server._native import native_core
from snowflake_server._observability.metrics import LATENCY_BUCKETS_S
from snowflake_server._service import MAX_USER_AGENT_LENGTH
from snowflake_server._thrift import fastpath
from tests.server.test_fastpath import agents, get_id_frame, mutated_requests, seqids

core: Any = native_core()
pytestmark = pytest.mark.skipif(core is None, reason="the native core is not built")

LIMIT = 64 * 1024
MAX_FRAME = 30 + MAX_USER_AGENT_LENGTH

limits = st.one_of(
    st.just(LIMIT),
    st.integers(-3, MAX_FRAME + 3),
    st.sampled_from([-(2**70), 2**31, 2**63, 2**70]),
)


def _other_method(seqid: int) -> bytes:
    body = struct.pack(">Ii", 0x80010001, 7) + b"get_ids" + struct.pack(">i", seqid)
    body += b"\x0b\x00\x01" + struct.pack(">I", 1) + b"a" + b"\x08\x00\x02" + b"\x00\x00\x00\x02"
    return struct.pack(">I", len(body) + 1) + body + b"\x00"


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """One frame: a common get_id, a mutation of one, another method, random bytes, a
    truncation, an oversize or a zero length."""
    kind = draw(st.sampled_from(["get_id", "mutated", "other", "random", "zero", "oversize"]))
    if kind == "get_id":
        return get_id_frame(draw(agents), draw(seqids))
    if kind == "mutated":
        return draw(mutated_requests())
    if kind == "other":
        return _other_method(draw(seqids))
    if kind == "random":
        return draw(st.binary(max_size=64))
    if kind == "zero":
        return b"\x00\x00\x00\x00"
    return get_id_frame("a" * draw(st.integers(MAX_USER_AGENT_LENGTH + 1, 400)), 1)


# --- match_get_id and get_id_reply: the fast path's, byte for byte -----------------------


@given(frame=frames(), limit=limits)
@settings(max_examples=600, deadline=None)
@example(frame=b"", limit=LIMIT)
@example(frame=get_id_frame("", 0), limit=26)
@example(frame=get_id_frame("", 0), limit=25)
@example(frame=get_id_frame("x" * 129, 7), limit=LIMIT)
def test_the_native_match_is_the_fast_paths(frame: bytes, limit: int) -> None:
    assert core.match_get_id(frame, limit) == fastpath.match_get_id(frame, limit)


@given(agent=agents, seqid=seqids, limit=limits)
@settings(max_examples=100, deadline=None)
def test_every_byte_of_a_request_changed_is_judged_as_the_fast_path_judges_it(
    agent: str | bytes, seqid: int, limit: int
) -> None:
    frame = get_id_frame(agent, seqid)
    for at in range(len(frame)):
        for flip in (0x01, 0x80, 0xFF):
            edit = bytearray(frame)
            edit[at] ^= flip
            changed = bytes(edit)
            assert core.match_get_id(changed, limit) == fastpath.match_get_id(changed, limit)
            for cut in (at, at + 1):
                assert core.match_get_id(changed[:cut], limit) == fastpath.match_get_id(
                    changed[:cut], limit
                )


@given(agent=agents, seqid=seqids, limit=limits)
@settings(max_examples=300, deadline=None)
def test_every_common_request_matches_natively_as_in_python(
    agent: str | bytes, seqid: int, limit: int
) -> None:
    frame = get_id_frame(agent, seqid)
    assert core.match_get_id(frame, limit) == fastpath.match_get_id(frame, limit)


@given(seqid=st.binary(min_size=4, max_size=4), id_=st.integers(-(2**63), 2**63 - 1))
@settings(max_examples=300, deadline=None)
@example(seqid=b"\xff\xff\xff\xff", id_=2**63 - 1)
@example(seqid=b"\x00\x00\x00\x00", id_=0)
def test_the_native_reply_is_the_fast_paths(seqid: bytes, id_: int) -> None:
    reply = core.get_id_reply(seqid, id_)
    assert reply == fastpath.get_id_reply(seqid, id_)
    assert len(reply) == 34


# --- scan_prefix: a connection's bytes, frame by frame -----------------------------------


def _reference_scan(buf: bytes, limit: int) -> int:
    """scan_prefix's contract, computed the slow way: MATCH if the first frame is whole and
    native's (the fast path's match, at most NATIVE_MAX_FRAME long); else NEED_MORE if some
    completion of ``buf`` would be (every candidate length tried, the free bytes, seqid and
    agent, taken from ``buf``); else HANDOVER."""
    if not buf:
        return int(core.SCAN_NEED_MORE)
    if len(buf) >= 4:
        n = int.from_bytes(buf[:4], "big") + 4
        if len(buf) >= n:
            whole = fastpath.match_get_id(buf[:n], limit) is not None and n <= MAX_FRAME
            return int(core.SCAN_MATCH if whole else core.SCAN_HANDOVER)
    for n in range(30, MAX_FRAME + 1):
        candidate = bytearray(get_id_frame("a" * (n - 30), 0))
        for i in [*range(18, 22), *range(29, n - 1)]:
            if i < len(buf):
                candidate[i] = buf[i]
        if (
            len(buf) < n
            and bytes(candidate[: len(buf)]) == buf
            and fastpath.match_get_id(bytes(candidate), limit) is not None
        ):
            return int(core.SCAN_NEED_MORE)
    return int(core.SCAN_HANDOVER)


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """What a pipelining client sends: a few frames back to back, maybe a cut-off tail."""
    stream = b"".join(draw(st.lists(frames(), min_size=1, max_size=4)))
    if draw(st.booleans()):
        stream = stream[: draw(st.integers(0, len(stream)))]
    return stream


@given(stream=streams(), limit=limits)
@settings(max_examples=250, deadline=None)
@example(stream=get_id_frame("a" * MAX_USER_AGENT_LENGTH, 1), limit=LIMIT)
@example(stream=get_id_frame("a" * (MAX_USER_AGENT_LENGTH + 1), 1), limit=LIMIT)
def test_scan_prefix_says_need_more_exactly_when_a_completion_is_native(
    stream: bytes, limit: int
) -> None:
    results = []
    for k in range(min(len(stream), MAX_FRAME + 8) + 1):
        result, why, frame_len, seqid, agent_at, agent_len = core.scan_prefix(stream[:k], limit)
        assert result == _reference_scan(stream[:k], limit), (k, stream[:k])
        if result == core.SCAN_MATCH:
            frame = stream[:frame_len]
            assert (seqid, stream[agent_at : agent_at + agent_len]) == fastpath.match_get_id(
                frame, limit
            )
            assert agent_at + agent_len == frame_len - 1
        elif result == core.SCAN_HANDOVER:
            assert why in (core.WHY_LENGTH, core.WHY_REQUEST)
        results.append(result)
    # A HANDOVER is final; a MATCH was NEED_MORE at every shorter prefix.
    if core.SCAN_HANDOVER in results:
        first = results.index(core.SCAN_HANDOVER)
        assert set(results[first:]) == {core.SCAN_HANDOVER}
    if core.SCAN_MATCH in results:
        first = results.index(core.SCAN_MATCH)
        assert set(results[:first]) == {core.SCAN_NEED_MORE}


@given(stream=streams(), limit=limits)
@settings(max_examples=300, deadline=None)
def test_a_pipelined_stream_is_served_frame_by_frame_until_the_first_that_is_not_native(
    stream: bytes, limit: int
) -> None:
    """As a leased connection walks its buffer: each MATCH is the fast path's frame, and
    the walk stops at the first frame that is not (or is not whole yet)."""
    pos = 0
    while True:
        result, _, frame_len, seqid, _, _ = core.scan_prefix(stream[pos:], limit)
        if result != core.SCAN_MATCH:
            break
        call = fastpath.match_get_id(stream[pos : pos + frame_len], limit)
        assert call is not None and call[0] == seqid
        pos += frame_len
    rest = stream[pos:]
    if result == core.SCAN_HANDOVER:
        n = int.from_bytes(rest[:4], "big") + 4 if len(rest) >= 4 else None
        if n is not None and len(rest) >= n:
            assert n > MAX_FRAME or fastpath.match_get_id(rest[:n], limit) is None
    else:
        assert len(rest) < 4 or len(rest) < int.from_bytes(rest[:4], "big") + 4


def test_native_frames_stop_at_the_longest_agent_python_accepts() -> None:
    assert core.NATIVE_MAX_FRAME == MAX_FRAME
    longest = get_id_frame("a" * MAX_USER_AGENT_LENGTH, 1)
    assert core.scan_prefix(longest, LIMIT)[0] == core.SCAN_MATCH
    # The fast path matches a longer one (Python then refuses the agent); native hands it
    # over from its length prefix alone, so a leased connection never buffers it.
    longer = get_id_frame("a" * (MAX_USER_AGENT_LENGTH + 1), 1)
    assert fastpath.match_get_id(longer, LIMIT) is not None
    assert core.scan_prefix(longer[:4], LIMIT)[:2] == (core.SCAN_HANDOVER, core.WHY_LENGTH)
    # Past the server's frame limit, the same.
    assert core.scan_prefix(longest[:4], MAX_FRAME - 5)[:2] == (
        core.SCAN_HANDOVER,
        core.WHY_LENGTH,
    )
    assert core.scan_prefix(_other_method(1)[:16], LIMIT)[:2] == (
        core.SCAN_HANDOVER,
        core.WHY_REQUEST,
    )


# --- the agent registry ------------------------------------------------------------------


def test_the_registry_gives_each_agent_one_index_and_label() -> None:
    registry = core.AgentRegistry()
    assert registry.lookup(b"alpha") == -1
    assert registry.add(b"alpha", 5) == 0
    assert registry.add(b"beta", 5) == 1
    assert registry.add(b"alpha", 5) == 0  # again: the same index
    assert (registry.lookup(b"alpha"), registry.lookup(b"beta")) == (0, 1)
    assert (registry.label(0), registry.label(1), len(registry)) == (5, 5, 2)
    assert registry.lookup(b"alph") == registry.lookup(b"alphaa") == -1
    with pytest.raises(ValueError, match="another label"):
        registry.add(b"alpha", 6)
    with pytest.raises(ValueError, match="at most 128"):
        registry.add(b"a" * (MAX_USER_AGENT_LENGTH + 1), 1)
    with pytest.raises(IndexError):
        registry.label(2)
    assert (registry.agent(0), registry.agent(1)) == (b"alpha", b"beta"), "for the audit trail"
    for index in (2, -1):
        with pytest.raises(IndexError):
            registry.agent(index)
    assert registry.lookup(b"a" * 4000) == -1


def test_a_full_registry_refuses_new_agents_which_python_then_serves() -> None:
    registry = core.AgentRegistry()
    agents_ = [f"agent-{i}".encode() for i in range(core.NATIVE_AGENTS_MAX)]
    assert [registry.add(a, i % 7) for i, a in enumerate(agents_)] == list(range(len(agents_)))
    assert registry.add(b"one-too-many", 0) == -1
    assert registry.lookup(b"one-too-many") == -1
    assert registry.add(agents_[17], 17 % 7) == 17  # known agents still register
    assert [registry.lookup(a) for a in agents_] == list(range(len(agents_)))
    assert len(registry) == core.NATIVE_AGENTS_MAX


def test_lookups_without_the_gil_stay_right_while_python_adds() -> None:
    registry = core.AgentRegistry()
    early = [f"early-{i}".encode() for i in range(64)]
    late = [f"late-{i}".encode() for i in range(2000)]
    for i, agent in enumerate(early):
        registry.add(agent, i)
    rounds = 300
    results: list[tuple[list[int], int]] = []
    go = threading.Barrier(4)

    def look() -> None:
        go.wait()
        results.append(registry.lookup_spin(early + late, rounds))

    threads = [threading.Thread(target=look) for _ in range(3)]
    for thread in threads:
        thread.start()
    go.wait()
    for i, agent in enumerate(late):
        assert registry.add(agent, 1000 + i) == len(early) + i
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 3
    for hits, violations in results:
        assert violations == 0
        assert hits[: len(early)] == [rounds] * len(early)
    assert [registry.lookup(a) for a in late] == list(range(len(early), len(early) + len(late)))


# --- per-thread counters -----------------------------------------------------------------

calls = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.integers(0, 5),
        st.one_of(
            st.integers(0, 2 * 10**9),
            st.sampled_from(core.LATENCY_BUCKETS_NS if core else (0,)).flatmap(
                lambda b: st.sampled_from([b - 1, b, b + 1])
            ),
        ),
    ),
    max_size=60,
)


@given(
    records=calls,
    handoffs=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(core.HANDOFF_REASONS if core else ("",)))
    ),
    errors=st.lists(st.integers(0, 3)),
)
@settings(max_examples=200, deadline=None)
def test_the_snapshot_sums_every_threads_counters(
    records: list[tuple[int, int, int]], handoffs: list[tuple[int, str]], errors: list[int]
) -> None:
    registry = core.AgentRegistry()
    labels = [0, 1, 1, 2, 0, 3]  # agents sharing a label (as the overflow label) sum
    for i, label in enumerate(labels):
        registry.add(f"agent-{i}".encode(), label)
    stats = core.NativeStats(4)
    counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
    by_index: dict[int, int] = {}
    by_label: dict[int, int] = {}
    for thread, agent, ns in records:
        stats.record_call(thread, agent, ns)
        counts[bisect.bisect_left(LATENCY_BUCKETS_S, ns / 1e9)] += 1
        by_index[agent] = by_index.get(agent, 0) + 1
        by_label[labels[agent]] = by_label.get(labels[agent], 0) + 1
    for thread, reason in handoffs:
        stats.record_handoff(thread, reason)
    for thread in errors:
        stats.record_internal_error(thread)
    snapshot = stats.snapshot()
    assert snapshot["calls"] == len(records)
    assert snapshot["latency_counts"] == counts
    assert snapshot["latency_sum_ns"] == sum(ns for _, _, ns in records)
    assert snapshot["ids"] == by_index
    assert stats.snapshot(registry)["ids"] == by_label
    assert snapshot["handoffs"] == {
        reason: sum(1 for _, r in handoffs if r == reason) for reason in core.HANDOFF_REASONS
    }
    assert snapshot["internal_errors"] == len(errors)


def test_the_latency_buckets_are_the_python_histograms() -> None:
    assert tuple(round(b * 1e9) for b in LATENCY_BUCKETS_S) == core.LATENCY_BUCKETS_NS


def test_a_scrape_while_native_threads_count_sees_totals_only_grow() -> None:
    stats = core.NativeStats(4)
    n = 200_000
    threads = [threading.Thread(target=stats.spin, args=(i, n, i, 30_000)) for i in range(4)]
    for thread in threads:
        thread.start()
    seen = []
    while any(thread.is_alive() for thread in threads):
        seen.append(stats.snapshot()["calls"])
    for thread in threads:
        thread.join(timeout=60)
    assert seen == sorted(seen)
    final = stats.snapshot()
    assert final["calls"] == 4 * n
    assert final["ids"] == dict.fromkeys(range(4), n)
    assert final["latency_counts"][1] == 4 * n  # 30 µs: the 50 µs bucket


# --- the audit budget --------------------------------------------------------------------


class _LockedBudget:
    """AuditLog.record's and _write_all's arithmetic on _pending and dropped."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending, self.pending, self.dropped = max_pending, 0, 0

    def reserve(self, n: int) -> bool:
        if self.pending + n > self.max_pending:
            self.dropped += n
            return False
        self.pending += n
        return True


@given(
    max_pending=st.integers(0, 20),
    ops=st.lists(st.tuples(st.sampled_from(["reserve", "release", "drop"]), st.integers(0, 8))),
)
@settings(max_examples=300, deadline=None)
def test_the_audit_budget_decides_as_the_audit_logs_lock_does(
    max_pending: int, ops: list[tuple[str, int]]
) -> None:
    budget, model = core.AuditBudget(max_pending), _LockedBudget(max_pending)
    for op, n in ops:
        if op == "reserve":
            assert budget.reserve(n) == model.reserve(n)
        else:
            n = min(n, model.pending)  # only what was reserved leaves
            if op == "drop":
                budget.drop(n)
                model.dropped += n
            budget.release(n)
            model.pending -= n
        assert (budget.pending, budget.dropped) == (model.pending, model.dropped)


def test_native_threads_reserving_at_once_take_exactly_the_budget() -> None:
    budget = core.AuditBudget(50_000)
    taken: list[int] = []
    threads = [
        threading.Thread(target=lambda: taken.append(budget.spin(40_000, True))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sum(taken) == budget.pending == 50_000
    assert budget.dropped == 3 * 40_000 - 50_000
