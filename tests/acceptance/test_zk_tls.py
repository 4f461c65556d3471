"""A real server process in cluster mode over TLS to ZooKeeper: SIGHUP, under load,
keeps the ZooKeeper session (a new one would lose the worker id's lease and close the
gate), and says whether the TLS files in place now would load at the next reconnection."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from tests.support.processes import ServerProcess, start_server
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

pytestmark = [pytest.mark.zookeeper, pytest.mark.slow]

SIGHUPS = 3


class Load:
    """A client calling get_id back to back until :meth:`stop`, keeping every failure."""

    def __init__(self, server: ServerProcess) -> None:
        self._client = server.client(timeout=5.0)
        self.calls = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._client.next_id("sighup-load")
            except Exception as e:  # noqa: BLE001 - every failure (UnavailableError...) counts
                self.failures.append(f"{type(e).__name__}: {e}")
            self.calls += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_sighup_under_load_keeps_the_zookeeper_session(
    tls_zk: ZooKeeper, zk_path: str, tmp_path: Path
) -> None:
    server = start_server(*tls_zk.node_flags(zk_path), "--worker-id", "6")
    zk = tls_zk.client()
    zk.start(timeout=10)
    node = f"{zk_path}/nodes/0/6"
    load = Load(server)

    def handled() -> int:
        return server.log().count("ZooKeeper TLS files load")

    try:
        owner_before = zk.get(node)[1].ephemeralOwner
        wait_until(lambda: load.calls >= 200, "the load runs")
        for n in range(1, SIGHUPS + 1):
            server.process.send_signal(signal.SIGHUP)
            wait_until(lambda: handled() == n, f"SIGHUP {n} handled")  # noqa: B023
            calls = load.calls
            wait_until(lambda: load.calls >= calls + 200, f"calls after SIGHUP {n}")  # noqa: B023
        owner_after = zk.get(node)[1].ephemeralOwner
        load.stop()
        print(
            f"ZK-TLS SIGHUP: session 0x{owner_before:x} before, 0x{owner_after:x} after "
            f"{SIGHUPS} SIGHUPs; {load.calls} calls, {len(load.failures)} failed"
        )
        assert owner_after == owner_before, "SIGHUP must not replace the ZooKeeper session"
        assert load.failures == []
        log = server.log()
        assert "session LOST" not in log and "session SUSPENDED" not in log, log
        assert "registered again" not in log
    finally:
        load.stop()
        zk.stop()
        zk.close()
        assert server.stop() == 0


def test_sighup_says_when_the_zookeeper_tls_files_would_not_load(
    tls_zk: ZooKeeper, zk_path: str, tmp_path: Path
) -> None:
    assert tls_zk.tls is not None
    key = tmp_path / "client-key.pem"
    key.write_bytes(tls_zk.tls.client_key.read_bytes())
    flags = [f if f != str(tls_zk.tls.client_key) else str(key) for f in tls_zk.node_flags(zk_path)]
    server = start_server(*flags, "--worker-id", "7")
    try:
        key.write_text("not a key\n")
        server.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "ZooKeeper TLS files do not load" in server.log(), "the warning")
        assert f"--zk-tls-key {key}" in server.log()
        assert server.client().next_id("still") > 0  # the session, its connection kept
    finally:
        assert server.stop() == 0
