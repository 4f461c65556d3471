"""The audit trail: one JSON line per id, written off the id path."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from snowflake_server._native import native_core
from snowflake_server._observability.audit import AuditLog
from tests.support.processes import parse_metrics
from tests.support.waiting import wait_until


def test_a_full_queue_drops_and_counts_instead_of_waiting(tmp_path: Path) -> None:
    audit = AuditLog(str(tmp_path / "audit.jsonl"), max_pending=10)  # writer not started
    started = time.perf_counter()
    audit.record(list(range(8)), "a", 0)
    audit.record(list(range(8, 16)), "a", 0)  # would pass the bound: dropped
    audit.record([16, 17], "a", 0)
    assert time.perf_counter() - started < 0.1, "record never waits for the disk"
    assert audit.dropped == 8
    audit.close()  # writes what was queued
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [str(i) for i in [*range(8), 16, 17]]
    assert audit.written == 10


# -- the native listener's entries: one budget, one writer ------------------------------
#
# Native threads queue (id, time_ms, agent_index) in C, each entry reserved in the shared
# AuditBudget first (refused: counted as dropped, no entry); the writer takes them with the
# listener's take_audit. NativeThreads plays that part with the real budget: take_audit is a
# plain function of the listener, so a plain function is a fair stand-in for it.

core: Any = native_core()
needs_core = pytest.mark.skipif(core is None, reason="the native core is not built")

AGENTS = ["alpha", "beta"]  # by native registry index
T0 = 1_700_000_000_123  # 2023-11-14T22:13:20.123Z


class NativeThreads:
    """What the native listener does for the audit trail, with the real budget."""

    def __init__(self, budget: Any) -> None:
        self._budget = budget
        self._lock = threading.Lock()
        self._entries: list[tuple[int, int, int]] = []

    def issue(self, id_: int, time_ms: int = T0, agent_index: int = 1) -> bool:
        if not self._budget.reserve(1):  # sf_audit_reserve: counts what it refuses
            return False
        with self._lock:
            self._entries.append((id_, time_ms, agent_index))
        return True

    def take(self) -> list[tuple[int, int, int]]:
        with self._lock:
            taken, self._entries = self._entries, []
        return taken


def shared_log(path: Path, max_pending: int) -> tuple[AuditLog, NativeThreads]:
    budget = core.AuditBudget(max_pending)
    audit = AuditLog(str(path), max_pending, budget=budget)
    native = NativeThreads(budget)
    audit.add_source(native.take, AGENTS.__getitem__)
    return audit, native


def exported(audit: AuditLog) -> dict[str, float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(audit)
    return parse_metrics(generate_latest(registry).decode())


GOLDEN = (
    '{"id": "5", "useragent": "alpha", "time": "2023-11-14T22:13:20.123Z"}\n'
    '{"id": "6", "useragent": "alpha", "time": "2023-11-14T22:13:20.123Z"}\n'
    '{"id": "7", "useragent": "b-2", "time": "1970-01-01T00:00:00.001Z"}\n'
)


@pytest.mark.parametrize("shared", [False, pytest.param(True, marks=needs_core)])
def test_python_entries_are_written_as_they_always_were(tmp_path: Path, shared: bool) -> None:
    path = tmp_path / "audit.jsonl"
    # The pure path's log is made as it always was (the test holds for the old code too).
    audit = (
        AuditLog(str(path), 10, budget=core.AuditBudget(10)) if shared else AuditLog(str(path), 10)
    )
    audit.record([5, 6], "alpha", T0)
    audit.record([7], "b-2", 1)
    audit.close()
    assert path.read_bytes() == GOLDEN.encode()
    assert (audit.written, audit.dropped) == (3, 0)


@needs_core
def test_native_and_python_entries_share_one_budget(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit, native = shared_log(path, max_pending=10)
    audit.record([1, 2, 3, 4], "alpha", T0)
    assert all(native.issue(i, T0 + 1) for i in range(10, 16))
    assert audit.pending == audit.budget.pending == 10  # type: ignore[union-attr]
    # Full for both: a place one side took is a place the other lacks.
    audit.record([5], "alpha", T0)
    assert not native.issue(16)
    assert audit.dropped == 2
    audit.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["id"], e["useragent"]) for e in lines] == [
        *((str(i), "alpha") for i in range(1, 5)),
        *((str(i), "beta") for i in range(10, 16)),
    ]
    assert {e["time"] for e in lines[4:]} == {"2023-11-14T22:13:20.124Z"}
    assert (audit.written, audit.pending) == (10, 0)


@needs_core
def test_python_and_native_entries_are_written_in_id_order(tmp_path: Path) -> None:
    """Each side queues its own entries; a round's lines read as one server's, ids rising
    (the acceptance test's calls, one after another: Python's first, native's, Python's)."""
    path = tmp_path / "audit.jsonl"
    audit, native = shared_log(path, max_pending=100)
    audit.record([1], "alpha", T0)
    assert native.issue(2) and native.issue(3)
    audit.record([4, 5, 6], "beta", T0)
    assert native.issue(7)
    audit.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [int(e["id"]) for e in lines] == [1, 2, 3, 4, 5, 6, 7]
    assert [e["useragent"] for e in lines] == [
        "alpha",
        "beta",
        "beta",
        "beta",
        "beta",
        "beta",
        "beta",
    ]


@needs_core
def test_a_full_budget_drops_and_counts_from_both_until_the_writer_frees_it(
    tmp_path: Path,
) -> None:
    audit, native = shared_log(tmp_path / "audit.jsonl", max_pending=3)
    audit.record([1, 2], "alpha", T0)
    native.issue(3)
    audit.record([4, 5], "alpha", T0)  # both dropped: a batch fits whole or not at all
    native.issue(6)
    native.issue(7)
    counts = exported(audit)
    assert counts["snowflake_audit_entries_dropped_total"] == 4
    assert counts["snowflake_audit_queue_entries"] == 3
    audit.start()
    wait_until(lambda: audit.written == 3, "the writer's round")  # the places are free again
    assert native.issue(8)
    audit.record([9, 10], "alpha", T0)
    audit.close()
    counts = exported(audit)
    assert counts["snowflake_audit_entries_written_total"] == 6
    assert counts["snowflake_audit_entries_dropped_total"] == 4
    assert counts["snowflake_audit_queue_entries"] == 0


@needs_core
def test_close_writes_every_native_entry_queued_before_it(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit, native = shared_log(path, max_pending=100_000)
    audit.start()
    issuer = threading.Thread(
        target=lambda: [native.issue(i, T0 + i // 1000) for i in range(20_000)]
    )
    issuer.start()
    for i in range(20_000, 20_500):
        audit.record([i], "alpha", T0)
    issuer.join()
    audit.close()
    ids = [int(json.loads(line)["id"]) for line in path.read_text().splitlines()]
    assert sorted(ids) == list(range(20_500))
    assert (audit.written, audit.dropped, audit.pending) == (20_500, 0, 0)


@needs_core
def test_python_and_native_threads_under_one_budget_count_every_id_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    audit, native = shared_log(path, max_pending=500)
    audit.start()
    per_thread = 20_000

    def python(base: int) -> None:
        for i in range(base, base + per_thread):
            audit.record([i], "alpha", T0)

    def native_thread(base: int) -> None:
        for i in range(base, base + per_thread):
            native.issue(i)

    threads = [
        threading.Thread(target=work, args=(n * per_thread,))
        for n, work in enumerate([python, python, native_thread, native_thread])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    audit.close()
    ids = [int(json.loads(line)["id"]) for line in path.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == audit.written
    assert audit.written + audit.dropped == 4 * per_thread
    assert audit.pending == 0


@needs_core
def test_a_failed_write_counts_native_entries_as_dropped() -> None:
    audit, native = shared_log(Path("/dev/full"), max_pending=10)  # a disk that is full
    audit.record([1, 2], "alpha", T0)
    native.issue(3)
    native.issue(4)
    audit.close()  # the failed write is logged, counted, and does not fail the stop
    assert (audit.written, audit.dropped, audit.pending, audit.write_errors) == (0, 4, 0, 1)


@needs_core
def test_a_failing_source_loses_only_its_own_entries(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit, native = shared_log(path, max_pending=10)

    def gone() -> list[tuple[int, int, int]]:
        raise RuntimeError("the listener is gone")

    audit.add_source(gone, AGENTS.__getitem__)
    audit.record([1], "alpha", T0)
    native.issue(2, agent_index=7)  # an index nobody can name: dropped, its place freed
    audit.close()
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["1"]
    assert (audit.written, audit.dropped, audit.pending) == (1, 1, 0)


def test_native_entries_need_the_shared_budget(tmp_path: Path) -> None:
    audit = AuditLog(str(tmp_path / "audit.jsonl"))
    try:
        with pytest.raises(ValueError, match="budget"):
            audit.add_source(list, str)
    finally:
        audit.close()
