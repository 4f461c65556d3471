"""The load generator (``python -m bench.loadgen``) on a real server: sane figures, never speed."""

from __future__ import annotations

import json

import pytest

from bench import loadgen as bench
from bench.loadgen import Histogram
from tests.support.processes import start_server


def test_bench_reports_sane_json(capsys: pytest.CaptureFixture[str]) -> None:
    server = start_server()
    try:
        code = bench.main(
            [
                "--host", server.host, "--port", str(server.port), "--connections", "2",
                "--batch-sizes", "1,4096", "--seconds", "0.5", "--json",
            ]
        )  # fmt: skip
    finally:
        server.stop()
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["worker_limit_ids_per_s"] == 4_096_000 and report["layout_known"]
    [get_id] = report["get_id"]
    assert get_id["connections"] == 2 and get_id["errors"] == []
    assert get_id["calls"] > 0 and get_id["ids"] == get_id["calls"]
    assert get_id["calls_per_s"] > 0 and 0.3 < get_id["seconds"] < 5
    assert 0 < get_id["p50_ms"] <= get_id["p99_ms"] <= get_id["p999_ms"] <= get_id["max_ms"]
    assert [row["batch"] for row in report["get_ids"]] == [1, 4096]
    for row in report["get_ids"]:
        assert row["errors"] == [] and row["calls"] > 0
        assert row["ids"] == row["calls"] * row["batch"]
        assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["p999_ms"] <= row["max_ms"]
        assert row["of_worker_limit"] == pytest.approx(row["ids_per_s"] / 4_096_000, abs=1e-4)


def test_bench_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    server = start_server()
    port = server.port
    server.stop()
    assert bench.main(["--port", str(port), "--seconds", "0.5"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_histogram_percentiles() -> None:
    h = Histogram.of([i / 1e6 for i in range(1, 1001)])  # 1..1000 µs
    other = Histogram.of([0.5])  # one 500 ms outlier
    h.merge(other)
    assert h.count == 1001 and h.max_ns == 500_000_000
    assert h.percentile(0.5) / 1e3 == pytest.approx(501, rel=0.005)
    assert h.percentile(0.99) / 1e3 == pytest.approx(991, rel=0.005)
    assert h.percentile(1.0) == 500_000_000
    assert Histogram.from_json(json.loads(json.dumps(h.to_json()))) == h
