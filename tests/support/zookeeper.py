"""A real ZooKeeper (Debian's package) for the tests, on a free loopback port."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kazoo.client import KazooClient

from tests.support.endpoints import free_port

CLASSPATH = "/etc/zookeeper/conf:/usr/share/java/zookeeper.jar"
JAR = Path("/usr/share/java/zookeeper.jar")


class ZooKeeper:
    """A standalone ZooKeeper in ``directory``; :meth:`stop` and :meth:`start` again
    keep its data (sessions survive), :meth:`wipe` makes it come back empty."""

    def __init__(self, directory: Path, tick_ms: int = 200) -> None:
        assert JAR.exists(), "ZooKeeper (Debian package zookeeper) is installed by `make test`"
        assert shutil.which("java"), "java is installed with the zookeeper package"
        self.directory = directory
        self.port = free_port()
        self.hosts = f"127.0.0.1:{self.port}"
        self._tick_ms = tick_ms
        self._process: subprocess.Popen[bytes] | None = None
        self._log = directory / "zookeeper.log"

    def start(self, timeout_s: float = 30.0) -> None:
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.directory / "zoo.cfg"
        config.write_text(
            f"tickTime={self._tick_ms}\n"
            f"dataDir={data}\n"
            f"clientPort={self.port}\n"
            "clientPortAddress=127.0.0.1\n"
            "admin.enableServer=false\n"
            "maxSessionTimeout=60000\n"
        )
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(
                ["java", "-cp", CLASSPATH, "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                 str(config)],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        # Ready when a client gets a session: kazoo retries until then.
        client = self.client()
        try:
            client.start(timeout=timeout_s)
        finally:
            client.stop()
            client.close()

    def client(self) -> KazooClient:
        return KazooClient(hosts=self.hosts, timeout=10.0)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(10)
        self._process = None

    def wipe(self) -> None:
        """Forget everything: the next start is an empty ZooKeeper on the same port."""
        assert self._process is None, "stop() first"
        shutil.rmtree(self.directory / "data")
