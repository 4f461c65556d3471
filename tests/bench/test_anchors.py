"""The benchmark's anchors (bench/anchors/): Twitter's IdWorker behind Apache Thrift's
Java TThreadPoolServer and Go TSimpleServer, built by the Makefile with Debian's
libraries only, serve unique increasing ids through the C load generator."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.servers import ServerFailed, start_go_anchor, start_java_anchor
from tests.bench.native import assert_clean, loadgen

pytestmark = pytest.mark.interop

ANCHORS = {"java": start_java_anchor, "go": start_go_anchor}


@pytest.mark.parametrize("language", sorted(ANCHORS))
def test_anchor_serves_ids(
    language: str, anchors_build: Path, loadgen_binary: Path, tmp_path: Path
) -> None:
    anchor = ANCHORS[language](language, tmp_path, anchors_build, 11)
    try:
        assert anchor.host == "127.0.0.1"
        get_id = loadgen(loadgen_binary, anchor.port, "--connections", "4")
        get_ids = loadgen(
            loadgen_binary, anchor.port, "--method", "get_ids", "--count", "4096",
            "--connections", "2",
        )  # fmt: skip
        bad_agent = loadgen(loadgen_binary, anchor.port, "--agent", "no spaces")
        bad_count = loadgen(loadgen_binary, anchor.port, "--method", "get_ids", "--count", "4097")
        assert anchor.alive(), anchor.log_tail()
    finally:
        code = anchor.stop()
    # Ids of worker 11, unique and increasing on every connection, across the calls.
    assert assert_clean(get_id, connections=4)["connections_by_worker"] == {"0/11": 4}
    assert_clean(get_ids, connections=2, count=4096)
    # Twitter's user agent check and our IDL's count check, as declared exceptions.
    assert bad_agent.code == 1 and bad_agent.errors[0].startswith(
        "connection 0, call 1: InvalidUserAgentError: invalid user agent"
    ), bad_agent.errors
    assert bad_count.code == 1 and bad_count.errors[0].startswith(
        "connection 0, call 1: InvalidCountError: count 4097: expected 1..4096"
    ), bad_count.errors
    assert code in (0, 143), anchor.log_tail()  # SIGTERM: Go exits 0, the JVM 143


@pytest.mark.parametrize("language", sorted(ANCHORS))
def test_anchor_refuses_a_worker_id_out_of_range(
    language: str, anchors_build: Path, tmp_path: Path
) -> None:
    with pytest.raises(ServerFailed, match="worker Id can't be greater than 31 or less than 0"):
        ANCHORS[language](language, tmp_path, anchors_build, 32)
