"""The server as an installed process: its console script, and every method of the
Snowflake service over each Thrift transport against a real server process (the
serving core itself is tested in this process in tests/serving)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from snowflake_server import decompose
from snowflake_server._ids.clocks import wall_clock_ms
from tests.support.processes import start_server


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_every_method_over_each_transport(transport: Any) -> None:
    server = start_server("--worker-id", "9", "--datacenter-id", "4", transport=transport)
    try:
        client = server.raw_client()
        before = wall_clock_ms()
        id_ = client.get_id("infra-dm")
        parts = decompose(id_)
        assert (parts.worker_id, parts.datacenter_id) == (9, 4)
        assert before <= parts.timestamp_ms <= wall_clock_ms()
        assert (client.get_worker_id(), client.get_datacenter_id()) == (9, 4)
        assert abs(client.get_timestamp() - wall_clock_ms()) < 1000
        ids = client.get_ids("infra-dm", 4096)
        assert len(ids) == 4096 and ids == sorted(ids) and ids[0] > id_
        layout = client.get_layout()
        assert (layout.epoch_ms, layout.timestamp_bits, layout.sequence_bits) == (
            1288834974657,
            41,
            12,
        )
        assert (layout.datacenter_id, layout.worker_id) == (4, 9)
    finally:
        assert server.stop() == 0


def test_server_runs_as_the_console_script(tmp_path: Any) -> None:
    script = shutil.which("snowflake-server", path=os.path.dirname(sys.executable))
    assert script, "the console script is installed"
    out = subprocess.run([script, "--help"], capture_output=True, text=True, check=True).stdout
    assert "SNOWFLAKE_WORKER_ID" in out and "--metrics-port" in out
