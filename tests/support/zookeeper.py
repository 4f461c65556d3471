"""A real ZooKeeper (Debian's libzookeeper-java) for the tests: one server on a free
loopback port, or an ensemble of three in network namespaces of their own."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient
from kazoo.security import make_digest_acl_credential

from tests.support.endpoints import free_port
from tests.support.netns import Host, Portal
from tests.support.waiting import wait_until

JAR = Path("/usr/share/java/zookeeper.jar")  # its manifest names the jars it needs
# Its logs through log4j 1.2: libslf4j-java's binding and liblog4j1.2-java, both
# dependencies of libzookeeper-java.
LOGGING = "/usr/share/java/slf4j-log4j12.jar:/usr/share/java/log4j-1.2.jar"
# Small and quick to start: three of these share two cores with the servers under test.
ENSEMBLE_JVM = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
LOG4J = """\
log4j.rootLogger=INFO, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p [%t:%C{1}@%L] - %m%n
"""


class ZooKeeper:
    """A standalone ZooKeeper in ``directory``; :meth:`stop` and :meth:`start` again
    keep its data (sessions survive), :meth:`wipe` makes it come back empty.

    ``sasl_users`` ({name: password}) turns SASL DIGEST-MD5 on (a JAAS file of these
    users; not required of clients, so anonymous and digest clients connect too);
    ``super_password`` makes ``super`` a digest superuser (the break-glass identity).
    Both are read at each :meth:`start`: change them and restart to rotate."""

    def __init__(
        self,
        directory: Path,
        tick_ms: int = 200,
        max_session_timeout_ms: int = 60000,
        *,
        sasl_users: dict[str, str] | None = None,
        super_password: str | None = None,
    ) -> None:
        _installed()
        self.sasl_users = dict(sasl_users or {})
        self.super_password = super_password
        self.directory = directory
        self.port = free_port()
        self.hosts = f"127.0.0.1:{self.port}"
        self._tick_ms = tick_ms
        self._max_session_timeout_ms = max_session_timeout_ms
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        config = _config(
            self.directory, self._tick_ms, "127.0.0.1", self.port,
            max_session_ms=self._max_session_timeout_ms,
        )  # fmt: skip
        lines, jvm = _auth_config(self.directory, self.sasl_users, self.super_password)
        self._process = _launch(self.directory, config + lines, jvm=jvm)
        # Ready when a client gets a session: kazoo retries until then.
        client = self.client()
        try:
            client.start(timeout=timeout_s)
        finally:
            client.stop()
            client.close()

    def client(self, **options: Any) -> KazooClient:
        """A client of this ZooKeeper (not started); ``options`` go to ``KazooClient``."""
        return KazooClient(hosts=self.hosts, timeout=10.0, **options)

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (started, not stopped), else None."""
        return None if self._process is None else self._process.pid

    def node_flags(self, zk_path: str, session_timeout: str = "3") -> tuple[str, ...]:
        """A server's flags to join this ZooKeeper's cluster under ``zk_path``, on
        loopback, failing fast (a 5 s connect timeout)."""
        return (
            "--zookeeper", self.hosts, "--zk-path", zk_path,
            "--zk-session-timeout", session_timeout, "--zk-connect-timeout", "5",
            "--advertise-host", "127.0.0.1",
        )  # fmt: skip

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(10)
        self._process = None

    def wipe(self) -> None:
        """Forget everything: the next start is an empty ZooKeeper on the same port."""
        assert self._process is None, "stop() first"
        shutil.rmtree(self.directory / "data")


def _installed() -> None:
    assert JAR.exists(), "ZooKeeper (Debian's libzookeeper-java) is installed by `make test`"
    assert shutil.which("java"), "java (Debian's default-jdk-headless) is installed by `make test`"


def _config(directory: Path, tick_ms: int, address: str, port: int, max_session_ms: int) -> str:
    """zoo.cfg's lines common to a standalone server and a member of an ensemble."""
    data = directory / "data"
    data.mkdir(parents=True, exist_ok=True)
    return (
        f"tickTime={tick_ms}\n"
        f"dataDir={data}\n"
        f"clientPort={port}\n"
        f"clientPortAddress={address}\n"
        "admin.enableServer=false\n"
        f"maxSessionTimeout={max_session_ms}\n"
    )


def _auth_config(
    directory: Path, sasl_users: dict[str, str], super_password: str | None
) -> tuple[str, tuple[str, ...]]:
    """zoo.cfg's lines and the JVM's flags for SASL users and a digest superuser.

    The JAAS file can only be named by a system property (no zoo.cfg key sets it).
    """
    lines, jvm = "", []
    if sasl_users:
        users = "".join(f'    user_{name}="{password}"\n' for name, password in sasl_users.items())
        jaas = directory / "jaas.conf"
        jaas.write_text(
            "Server {\n    org.apache.zookeeper.server.auth.DigestLoginModule required\n"
            f"{users};\n}};\n"
        )
        jvm.append(f"-Djava.security.auth.login.config={jaas}")
        lines += "authProvider.1=org.apache.zookeeper.server.auth.SASLAuthenticationProvider\n"
    if super_password is not None:
        digest = make_digest_acl_credential("super", super_password)
        jvm.append(f"-Dzookeeper.DigestAuthenticationProvider.superDigest={digest}")
    return lines, tuple(jvm)


def _launch(
    directory: Path, config: str, wrapper: Sequence[str] = (), jvm: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """Start the server of ``config`` (zoo.cfg's text) logging to zookeeper.log in
    ``directory``; ``wrapper`` goes before ``java`` (a namespace's), ``jvm`` after it."""
    path = directory / "zoo.cfg"
    path.write_text(config)
    # Its log configuration, in a directory on the class path: to the log file.
    (directory / "log4j.properties").write_text(LOG4J)
    with (directory / "zookeeper.log").open("ab") as log:
        return subprocess.Popen(
            [*wrapper, "java", *jvm, "-cp", f"{directory}:{JAR}:{LOGGING}",
             "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(path)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip


class ZooKeeperEnsemble:
    """Three ZooKeeper servers, each in the network namespace of one of ``hosts``, on
    port 2181 of its address; the test reaches them through ``portal`` (a thread in
    another of the namespaces). Each grants sessions of at most ``max_session_ms``.

    ``tick_ms`` is small so that a lost follower or leader is noticed within about a
    second (``syncLimit`` ticks) and an election takes a few ticks.
    """

    PORT = 2181

    def __init__(
        self,
        directory: Path,
        hosts: Sequence[Host],
        portal: Portal,
        tick_ms: int = 200,
        max_session_ms: int = 3000,
    ) -> None:
        _installed()
        self.members = list(hosts)
        self.hosts = ",".join(f"{host.address}:{self.PORT}" for host in hosts)
        self._directory = directory
        self._portal = portal
        self._tick_ms = tick_ms
        self._max_session_ms = max_session_ms
        self._processes: dict[str, subprocess.Popen[bytes]] = {}

    def directory(self, member: Host) -> Path:
        return self._directory / member.name

    def log(self, member: Host) -> str:
        return (self.directory(member) / "zookeeper.log").read_text(errors="replace")

    def start(self, timeout_s: float = 60.0) -> None:
        for member in self.members:
            self.start_member(member)
        self.wait_whole(timeout_s)

    def start_member(self, member: Host) -> None:
        assert member.name not in self._processes, f"{member.name} runs already"
        directory = self.directory(member)
        myid = self.members.index(member) + 1
        config = _config(directory, self._tick_ms, member.address, self.PORT, self._max_session_ms)
        (directory / "data" / "myid").write_text(f"{myid}\n")
        config += "initLimit=10\nsyncLimit=5\n4lw.commands.whitelist=srvr\n" + "".join(
            f"server.{n}={host.address}:2888:3888\n" for n, host in enumerate(self.members, start=1)
        )
        self._processes[member.name] = _launch(directory, config, member.command(), ENSEMBLE_JVM)

    def kill(self, member: Host) -> None:
        """SIGKILL: a crash, nothing flushed or said to the others."""
        process = self._processes.pop(member.name)
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def restore(self, timeout_s: float = 30.0) -> None:
        """Start the members that are not running, and wait until all serve."""
        for member in self.members:
            if member.name not in self._processes:
                self.start_member(member)
        self.wait_whole(timeout_s)

    def stop(self) -> None:
        for name in list(self._processes):
            process = self._processes.pop(name)
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def mode(self, member: Host) -> str | None:
        """``leader`` or ``follower`` (``srvr``), or None while it serves no client."""

        def ask() -> str | None:
            try:
                with socket.create_connection((member.address, self.PORT), timeout=1) as sock:
                    sock.sendall(b"srvr")
                    answer = b"".join(iter(lambda: sock.recv(4096), b""))
            except OSError:
                return None
            for line in answer.decode(errors="replace").splitlines():
                if line.startswith("Mode: "):
                    return line.removeprefix("Mode: ").strip()
            return None

        return self._portal.run(ask)

    def modes(self) -> dict[str, str | None]:
        return {member.name: self.mode(member) for member in self.members}

    def leader(self, among: Sequence[Host] | None = None) -> Host:
        """The member that is leader now (of ``among``, the members by default)."""
        found = [m for m in among or self.members if self.mode(m) == "leader"]
        assert len(found) == 1, f"not one leader: {self.modes()}"
        return found[0]

    def wait_leader(self, among: Sequence[Host], timeout_s: float = 30.0) -> Host:
        """Wait until one of ``among`` leads and the rest of them follow it."""

        def elected() -> bool:
            modes = sorted(str(self.mode(m)) for m in among)
            return modes == sorted(["leader", *["follower"] * (len(among) - 1)])

        wait_until(elected, f"one of {[m.name for m in among]} leads the others", timeout_s)
        return self.leader(among)

    def wait_whole(self, timeout_s: float = 30.0) -> Host:
        """Wait until every member serves: one leader, the others following it."""
        return self.wait_leader(self.members, timeout_s)
