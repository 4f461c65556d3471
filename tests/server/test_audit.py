"""The audit trail: one JSON line per id, written off the id path."""

from __future__ import annotations

import json
import time
from pathlib import Path

from snowflake_server._observability.audit import AuditLog


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
