"""The audit trail of a real server process: every id written once; a log it cannot
open fails its start."""

from __future__ import annotations

import json
from pathlib import Path

from snowflake_server import decompose
from tests.support.processes import parse_metrics, start_server
from tests.support.waiting import wait_until


def test_every_issued_id_is_written_once(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    server = start_server("--audit-log", str(path))
    client = server.raw_client()
    issued = [client.get_id("alpha") for _ in range(3)] + client.get_ids("beta", 100)
    wait_until(
        lambda: parse_metrics(server.metrics())["snowflake_audit_entries_written_total"] >= 103,
        "all 103 entries written",
        timeout_s=5,
    )
    assert server.stop() == 0
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    assert [int(e["id"]) for e in entries] == issued
    assert all(isinstance(e["id"], str) for e in entries), "ids as strings for JSON readers"
    assert [e["useragent"] for e in entries] == ["alpha"] * 3 + ["beta"] * 100
    for entry in entries:
        issued_ms = decompose(int(entry["id"])).timestamp_ms
        logged = entry["time"]
        assert logged.endswith("Z")
        assert abs(_ms(logged) - issued_ms) < 1000


def _ms(iso: str) -> int:
    from datetime import datetime

    return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000)


def test_an_unwritable_audit_log_is_a_start_up_error(tmp_path: Path) -> None:
    from tests.support.processes import ServerDidNotStart

    try:
        start_server("--audit-log", str(tmp_path / "no-such-dir" / "audit.jsonl"))
    except ServerDidNotStart as e:
        assert e.returncode == 2 and "--audit-log" in e.log
    else:
        raise AssertionError("the server started without its audit log")
