"""A real ZooKeeper (Debian's libzookeeper-java) for the tests, on a free loopback port."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kazoo.client import KazooClient

from tests.support.endpoints import free_port

JAR = Path("/usr/share/java/zookeeper.jar")  # its manifest names the jars it needs
# Its logs through log4j 1.2: libslf4j-java's binding and liblog4j1.2-java, both
# dependencies of libzookeeper-java.
LOGGING = "/usr/share/java/slf4j-log4j12.jar:/usr/share/java/log4j-1.2.jar"
LOG4J = """\
log4j.rootLogger=INFO, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p [%t:%C{1}@%L] - %m%n
"""


class ZooKeeper:
    """A standalone ZooKeeper in ``directory``; :meth:`stop` and :meth:`start` again
    keep its data (sessions survive), :meth:`wipe` makes it come back empty."""

    def __init__(
        self, directory: Path, tick_ms: int = 200, max_session_timeout_ms: int = 60000
    ) -> None:
        assert JAR.exists(), "ZooKeeper (Debian's libzookeeper-java) is installed by `make test`"
        assert shutil.which("java"), (
            "java (Debian's default-jdk-headless) is installed by `make test`"
        )
        self.directory = directory
        self.port = free_port()
        self.hosts = f"127.0.0.1:{self.port}"
        self._tick_ms = tick_ms
        self._max_session_timeout_ms = max_session_timeout_ms
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
            f"maxSessionTimeout={self._max_session_timeout_ms}\n"
        )
        # Its log configuration, in a directory on the class path: to the log file.
        (self.directory / "log4j.properties").write_text(LOG4J)
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(
                ["java", "-cp", f"{self.directory}:{JAR}:{LOGGING}",
                 "org.apache.zookeeper.server.quorum.QuorumPeerMain",
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
