"""One get_ids call is capped whatever the layout (issue 16, item 6): a real server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from snowflake_thrift_client import InvalidCountError

from tests.support.processes import ServerProcess, start_server


def rss_kib(server: ServerProcess) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


@pytest.fixture(scope="module")
def wide() -> Iterator[ServerProcess]:
    """22 sequence bits: 4,194,304 ids a ms (31 timestamp bits: 24 days from the epoch)."""
    epoch = int(time.time() * 1000) - 86_400_000
    server = start_server(
        "--sequence-bits", "22", "--timestamp-bits", "31", "--epoch", str(epoch)
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def test_a_wide_sequence_field_does_not_widen_one_call(wide: ServerProcess) -> None:
    # Three calls of 4,194,304 ids used to take the server to 1 GiB and stall other
    # connections for 930 ms. Now each is refused at once.
    other = wide.client()
    other.next_id()
    before = rss_kib(wide)
    latencies: list[float] = []
    done = threading.Event()

    def meanwhile() -> None:
        while not done.is_set():
            started = time.perf_counter()
            other.next_id()
            latencies.append(time.perf_counter() - started)

    thread = threading.Thread(target=meanwhile, daemon=True)
    thread.start()
    big = wide.client()
    try:
        for _ in range(3):
            started = time.perf_counter()
            with pytest.raises(InvalidCountError, match=r"1\.\.4096, got 4194304: .*--max-batch"):
                big.next_ids(4_194_304)
            assert time.perf_counter() - started < 1.0, "refused before any id is made"
    finally:
        done.set()
        thread.join(10)
    assert len(big.next_ids(4096)) == 4096, "the connection stays usable"
    assert latencies, "the other connection was served meanwhile"
    # Generous bounds, far from what one uncapped call cost (930 ms, hundreds of MB).
    assert max(latencies) < 0.5
    assert rss_kib(wide) - before < 50_000


def test_max_batch_sets_the_cap() -> None:
    server = start_server("--max-batch", "10")
    try:
        client = server.client()
        assert len(client.next_ids(10)) == 10
        with pytest.raises(InvalidCountError, match=r"1\.\.10, got 11: .*--max-batch 10"):
            client.next_ids(11)
    finally:
        assert server.stop() == 0
