"""Cluster faults an adversarial review found (issue 15), with real server processes
and a real ZooKeeper: ZooKeeper losing its data, and a clock that ran far ahead.

A partitioned node and a ZooKeeper granting a shorter session than asked are in the
nemesis (``tests/nemesis``) and in-process (``tests/server/test_membership.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from snowflake_server import decompose
from tests.support.processes import FakeTime, Load, ServerProcess, parse_metrics, start_server
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

pytestmark = [pytest.mark.zookeeper, pytest.mark.slow]

Start = Callable[..., ServerProcess]


@pytest.fixture
def nodes(zk_path: str) -> Iterator[Callable[[ZooKeeper], Start]]:
    """``nodes(zk)(*flags, **kwargs)`` starts a cluster node; all stopped after the test."""
    started: list[ServerProcess] = []

    def on(zk: ZooKeeper) -> Start:
        def start(*flags: str, **kwargs: object) -> ServerProcess:
            server = start_server(
                "--zookeeper", zk.hosts, "--zk-path", zk_path, "--zk-connect-timeout", "5",
                "--advertise-host", "127.0.0.1", *flags, **kwargs,  # type: ignore[arg-type]
            )  # fmt: skip
            started.append(server)
            return server

        return start

    yield on
    for server in started:
        if server.process.poll() is None:
            server.stop()


def test_a_node_on_an_id_zookeeper_forgot_does_not_repeat_its_holders_ids(
    own_zk: ZooKeeper, nodes: Callable[[ZooKeeper], Start], tmp_path: Path
) -> None:
    # Seen: ZooKeeper came back empty; B, whose clock is behind A's, leased A's worker
    # id before A registered again, and both handed out the same ids (6,600 of them).
    start = nodes(own_zk)
    # A's longer session keeps it away for 8 s: B leases worker 0 first.
    a = start("--worker-id", "auto", "--zk-session-timeout", "8")
    assert a.raw_client().get_worker_id() == 0
    behind = FakeTime(tmp_path)
    behind.set("-12")  # within B's --max-peer-skew
    with Load([a]) as load_a:
        # A serves for longer than B's clock is behind: B's ids would fall among A's.
        first = decompose(a.raw_client().get_id("first")).timestamp_ms
        wait_until(
            lambda: decompose(a.raw_client().get_id("last")).timestamp_ms - first > 13_000,
            "A serving for 13 s",
            40,
        )
        own_zk.stop()
        own_zk.wipe()
        own_zk.start()
        # No --first-start-wait: the default, the session timeout + --max-peer-skew.
        b = start(
            "--worker-id", "auto", "--zk-session-timeout", "3", "--max-peer-skew", "15",
            env=behind.env, first_start_wait=None, timeout_s=60,
        )  # fmt: skip
        with Load([b]) as load_b:
            wait_until(lambda: load_b.count() > 5000, "ids from B", 30)
    from_a, from_b = set(load_a.ids), set(load_b.ids)
    repeated = from_a & from_b
    print(
        f"ZK-DATA-LOSS ids from A {len(from_a)}, from B {len(from_b)}, repeated {len(repeated)}, "
        f"errors A {load_a.errors} B {load_b.errors}"
    )
    assert not repeated
    assert b.raw_client().get_worker_id() == 0, "B leased A's id while A was away"
    assert "no high-water mark of worker id 0 in ZooKeeper" in b.log()
    wait_until(lambda: "put the high-water mark of worker id 0 back" in a.log(), "A's mark", 30)
    assert a.raw_client().get_worker_id() == 1, "A came back on another id"
    assert len(load_a.ids) == len(from_a) and len(load_b.ids) == len(from_b)
    newest_a = max(decompose(i).timestamp_ms for i in from_a if decompose(i).worker_id == 0)
    oldest_b = min(decompose(i).timestamp_ms for i in from_b)
    assert oldest_b > newest_a, "B's ids of worker 0 come after A's"


def test_auto_passes_over_an_id_that_a_clock_far_ahead_used(
    zookeeper: ZooKeeper, nodes: Callable[[ZooKeeper], Start], tmp_path: Path
) -> None:
    # Seen: a node's clock stepped an hour ahead and back; the mark of its worker id
    # stayed an hour ahead and every new auto node refused to start (exit 3).
    start = nodes(zookeeper)
    ahead = FakeTime(tmp_path)
    ahead.set("+3600")
    jumped = start("--worker-id", "auto", env=ahead.env)
    assert jumped.raw_client().get_worker_id() == 0
    jumped.raw_client().get_id("ahead")
    assert jumped.stop() == 0  # its final mark, an hour ahead, stays in ZooKeeper
    node = start("--worker-id", "auto")
    assert node.raw_client().get_worker_id() == 1
    assert "skipping worker id 0: its high-water mark in zookeeper:" in node.log()
    counts = parse_metrics(node.metrics())
    assert counts['snowflake_zookeeper_worker_ids_skipped_total{reason="mark_ahead"}'] == 1
    assert decompose(node.raw_client().get_id("after")).worker_id == 1
