"""A real ZooKeeper (Debian's libzookeeper-java) for the tests: one server on a free
loopback port, or an ensemble of three in network namespaces of their own."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import trustme
from cryptography.hazmat.primitives import serialization
from kazoo.client import KazooClient
from kazoo.security import ACL, make_acl, make_digest_acl_credential

from tests.support.endpoints import free_port
from tests.support.netns import Host, Portal
from tests.support.waiting import wait_until

JAR = Path("/usr/share/java/zookeeper.jar")  # its manifest names the jars it needs
# Its logs through log4j 1.2: libslf4j-java's binding and liblog4j1.2-java, both
# dependencies of libzookeeper-java.
LOGGING = "/usr/share/java/slf4j-log4j12.jar:/usr/share/java/log4j-1.2.jar"
# Netty's codec: installed by libzookeeper-java's dependencies but not in zookeeper.jar's
# manifest; without it every TLS (Netty) connection fails, and kazoo only times out.
NETTY_CODEC = "/usr/share/java/netty-codec.jar"
# Small and quick to start: three of these share two cores with the servers under test.
ENSEMBLE_JVM = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
LOG4J = """\
log4j.rootLogger=INFO, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p [%t:%C{1}@%L] - %m%n
"""


SECURITY = ("plain", "sasl+tls")
"""How the tests that run once more secured may run their ZooKeeper: as it is, or with
auth and TLS on together (SASL DIGEST-MD5 users, ACLs of the service's identity on
every znode it makes, clients over TLS with certificates required);
:func:`secured_zookeeper` builds each."""

SERVICE_USER = "snowflake"

# kazoo leaves the TLS socket of a failed connection attempt (refused, or a failed
# handshake) to the garbage collector (kazoo/handlers/utils.py, create_tcp_connection):
# CPython closes it at once, with a ResourceWarning. Modules whose own clients meet a
# TLS ZooKeeper that is down, or that refuses them, expect it (pytest.mark.filterwarnings).
KAZOO_TLS_SOCKETS = (
    "ignore:Exception ignored in. <ssl.SSLSocket:pytest.PytestUnraisableExceptionWarning",
    "ignore:unclosed <ssl.SSLSocket:ResourceWarning",
)


def secured_zookeeper(directory: Path, security: str, **kwargs: Any) -> ZooKeeper:
    """A ZooKeeper (not started) in ``directory``, secured as ``security`` (one of
    :data:`SECURITY`) says; its :meth:`~ZooKeeper.client`, :meth:`~ZooKeeper.node_flags`,
    :meth:`~ZooKeeper.access_flags` and :meth:`~ZooKeeper.discovery_options` follow."""
    assert security in SECURITY, security
    if security == "plain":
        return ZooKeeper(directory / "zk", **kwargs)
    return ZooKeeper(
        directory / "zk",
        tls=ZkTls.make(directory / "tls"),
        service=ServiceIdentity.make(directory / "service"),
        **kwargs,
    )


@dataclass(frozen=True)
class ServiceIdentity:
    """The service's SASL (DIGEST-MD5) identity in a secured ZooKeeper: a user of its
    JAAS file with a random password, and the credentials file a node reads it from
    (mode 600, as a node demands)."""

    user: str
    password: str = field(repr=False)
    credentials_file: Path

    @classmethod
    def make(cls, directory: Path, user: str = SERVICE_USER) -> ServiceIdentity:
        directory.mkdir(parents=True, exist_ok=True)
        identity = cls(user, secrets.token_urlsafe(18), directory / f"{user}.cred")
        # Created 600, never open to others even for an instant.
        fd = os.open(identity.credentials_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(f"user = {user}\npassword = {identity.password}\n")
        return identity

    def node_flags(self) -> tuple[str, ...]:
        return ("--zk-auth", "sasl", "--zk-credentials-file", str(self.credentials_file))

    def discovery_options(self) -> dict[str, Any]:
        return {"auth": "sasl", "credentials_file": str(self.credentials_file)}

    def acl(self) -> list[ACL]:
        """The ACL a node gives its znodes by default (``--zk-read-acl world``)."""
        return [make_acl("sasl", self.user, all=True), make_acl("world", "anyone", read=True)]

    def client_options(self) -> dict[str, Any]:
        """kazoo's arguments to act as the service: its SASL login, and its ACL on every
        znode made (a znode open to anyone would make the next node refuse to start)."""
        return {
            "sasl_options": {
                "mechanism": "DIGEST-MD5", "username": self.user, "password": self.password,
            },
            "default_acl": self.acl(),
        }  # fmt: skip


ClientAuth = Literal["need", "want", "none"]


@dataclass(frozen=True)
class ZkTls:
    """Certificates for a TLS ZooKeeper, made by the test (trustme) in ``directory``.

    The servers' certificate names ``hosts``; one CA signs it and the client's, and the
    servers trust that CA for client certificates (``client_auth``: ZooKeeper's
    ``ssl.clientAuth``; ``need`` refuses a client without one). ``trusted_ca`` is the
    CA file clients trust: the signing one unless the test made another.
    """

    directory: Path
    client_auth: ClientAuth
    ca: Path
    server_keystore: Path
    server_truststore: Path
    client_cert: Path
    client_key: Path
    authority: trustme.CA = field(compare=False)
    """The CA that signed the certificates (to issue more)."""

    @classmethod
    def make(
        cls,
        directory: Path,
        hosts: Sequence[str] = ("127.0.0.1",),
        client_auth: ClientAuth = "need",
        client_hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    ) -> ZkTls:
        directory.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        server = ca.issue_cert(*hosts)
        client = ca.issue_cert(*client_hosts)
        tls = cls(
            directory=directory,
            client_auth=client_auth,
            ca=directory / "ca.pem",
            server_keystore=directory / "server.pem",
            server_truststore=directory / "server-trust.pem",
            client_cert=directory / "client.pem",
            client_key=directory / "client-key.pem",
            authority=ca,
        )
        ca.cert_pem.write_to_path(str(tls.ca))
        ca.cert_pem.write_to_path(str(tls.server_truststore))
        # ZooKeeper's PEM keystore: the chain and a PKCS#8 key (a PKCS#1 or SEC1 key,
        # as trustme writes them, fails to load).
        chain = b"".join(blob.bytes() for blob in server.cert_chain_pems)
        tls.server_keystore.write_bytes(chain + pkcs8(server.private_key_pem.bytes()))
        write_client(tls, client)
        return tls

    def with_ca(self, ca: Path) -> ZkTls:
        """The same, with clients trusting ``ca`` instead (an untrusted server)."""
        return replace(self, ca=ca)

    def without_client_cert(self) -> ZkTls:
        return replace(self, client_cert=Path(), client_key=Path())

    @property
    def presents_cert(self) -> bool:
        return self.client_cert != Path()

    def client_options(self) -> dict[str, Any]:
        """kazoo's TLS arguments as the server passes them (hostname verification on)."""
        return {
            "use_ssl": True, "ca": str(self.ca), "verify_certs": True, "check_hostname": True,
            "certfile": str(self.client_cert) if self.presents_cert else None,
            "keyfile": str(self.client_key) if self.presents_cert else None,
        }  # fmt: skip

    def node_flags(self) -> tuple[str, ...]:
        cert = ("--zk-tls-cert", str(self.client_cert), "--zk-tls-key", str(self.client_key))
        return ("--zk-tls-ca", str(self.ca), *(cert if self.presents_cert else ()))

    def ssl_context(self) -> ssl.SSLContext:
        """A client context of these certificates (for 4-letter words on the TLS port)."""
        context = ssl.create_default_context(cafile=str(self.ca))
        if self.presents_cert:
            context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def pkcs8(key_pem: bytes) -> bytes:
    key = serialization.load_pem_private_key(key_pem, password=None)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_client(tls: ZkTls, cert: trustme.LeafCert) -> None:
    """Put ``cert`` in ``tls``'s client certificate files (replaced whole, each at once:
    a reconnection in between reads one or the other, never half a file)."""
    for path, blob in (
        (tls.client_cert, b"".join(b.bytes() for b in cert.cert_chain_pems)),
        (tls.client_key, pkcs8(cert.private_key_pem.bytes())),
    ):
        partial = path.with_suffix(".new")
        partial.write_bytes(blob)
        partial.replace(path)


class ZooKeeper:
    """A standalone ZooKeeper in ``directory``; :meth:`stop` and :meth:`start` again
    keep its data (sessions survive), :meth:`wipe` makes it come back empty.

    ``sasl_users`` ({name: password}) turns SASL DIGEST-MD5 on (a JAAS file of these
    users; not required of clients, so anonymous and digest clients connect too);
    ``super_password`` makes ``super`` a digest superuser (the break-glass identity).
    Both are read at each :meth:`start`: change them and restart to rotate. ``service``
    adds its user to ``sasl_users``; :meth:`client`, :meth:`access_flags` and
    :meth:`discovery_options` then authenticate as it."""

    def __init__(
        self,
        directory: Path,
        tick_ms: int = 200,
        max_session_timeout_ms: int = 60000,
        *,
        sasl_users: dict[str, str] | None = None,
        super_password: str | None = None,
        tls: ZkTls | None = None,
        service: ServiceIdentity | None = None,
    ) -> None:
        """``tls``: serve clients over TLS only (``secureClientPort``, Netty) with its
        certificates; :meth:`client` and :meth:`node_flags` then use them too."""
        _installed()
        self.sasl_users = dict(sasl_users or {})
        self.service = service
        if service is not None:
            self.sasl_users[service.user] = service.password
        self.super_password = super_password
        self.directory = directory
        self.port = free_port()
        self.hosts = f"127.0.0.1:{self.port}"
        self.tls = tls
        self._tick_ms = tick_ms
        self._max_session_timeout_ms = max_session_timeout_ms
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        config = _config(
            self.directory, self._tick_ms, "127.0.0.1", self.port,
            max_session_ms=self._max_session_timeout_ms, tls=self.tls,
        )  # fmt: skip
        lines, jvm = _auth_config(self.directory, self.sasl_users, self.super_password)
        self._process = _launch(self.directory, config + lines, jvm=jvm, tls=self.tls is not None)
        if self.tls is not None:
            # kazoo leaves the socket of a refused TLS attempt to the garbage collector
            # (a ResourceWarning in the test): dial only once the port listens.
            wait_until(lambda: _listens(self.port), "ZooKeeper's TLS port listens", timeout_s)
        # Ready when a client gets a session: kazoo retries until then. (Whatever
        # host its certificate names: some tests give it another host's.)
        client = self.client(check_hostname=False) if self.tls is not None else self.client()
        try:
            client.start(timeout=timeout_s)
        finally:
            client.stop()
            client.close()

    def client(self, *, authenticated: bool = True, **options: Any) -> KazooClient:
        """A client of this ZooKeeper (not started): TLS with the test's client certificate
        if the server speaks TLS; as the service (its login and ACL) if it has one, unless
        not ``authenticated`` (anonymous); ``options`` go to ``KazooClient`` (over those)."""
        tls = self.tls.client_options() if self.tls is not None else {}
        auth = self.service.client_options() if self.service and authenticated else {}
        return KazooClient(hosts=self.hosts, timeout=10.0, **{**tls, **auth, **options})

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
            "--advertise-host", "127.0.0.1", *self.access_flags(),
        )  # fmt: skip

    def access_flags(self) -> tuple[str, ...]:
        """The flags a node (or ``snowflake get``) needs to reach this ZooKeeper as it is
        secured: none for a plain one, ``--zk-tls-*`` for TLS, ``--zk-auth`` and
        ``--zk-credentials-file`` for the service's identity."""
        return _access_flags(self.tls, self.service)

    def discovery_options(self) -> dict[str, Any]:
        """``ZooKeeperDiscovery``'s keyword arguments to reach this ZooKeeper."""
        options = self.service.discovery_options() if self.service is not None else {}
        if self.tls is None:
            return options
        options["tls_ca"] = str(self.tls.ca)
        if self.tls.presents_cert:
            options |= {"tls_cert": str(self.tls.client_cert), "tls_key": str(self.tls.client_key)}
        return options

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(10)
        self._process = None

    def wipe(self) -> None:
        """Forget everything: the next start is an empty ZooKeeper on the same port."""
        assert self._process is None, "stop() first"
        shutil.rmtree(self.directory / "data")


def _access_flags(tls: ZkTls | None, service: ServiceIdentity | None) -> tuple[str, ...]:
    return (
        *(tls.node_flags() if tls is not None else ()),
        *(service.node_flags() if service is not None else ()),
    )


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _installed() -> None:
    assert JAR.exists(), "ZooKeeper (Debian's libzookeeper-java) is installed by `make test`"
    assert shutil.which("java"), "java (Debian's default-jdk-headless) is installed by `make test`"


def _config(
    directory: Path,
    tick_ms: int,
    address: str,
    port: int,
    max_session_ms: int,
    tls: ZkTls | None = None,
) -> str:
    """zoo.cfg's lines common to a standalone server and a member of an ensemble: its
    clients on ``address``:``port``, over TLS only with ``tls``."""
    data = directory / "data"
    data.mkdir(parents=True, exist_ok=True)
    clients = (
        f"clientPort={port}\nclientPortAddress={address}\n"
        if tls is None
        else _tls_config(tls, address, port)
    )
    return (
        f"tickTime={tick_ms}\n"
        f"dataDir={data}\n"
        f"{clients}"
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


def _tls_config(tls: ZkTls, address: str, port: int) -> str:
    """zoo.cfg's lines for clients over TLS only: Netty's secure port, PEM stores."""
    return (
        f"secureClientPort={port}\n"
        f"secureClientPortAddress={address}\n"
        "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory\n"
        f"ssl.keyStore.location={tls.server_keystore}\n"
        "ssl.keyStore.type=PEM\n"
        f"ssl.trustStore.location={tls.server_truststore}\n"
        "ssl.trustStore.type=PEM\n"
        f"ssl.clientAuth={tls.client_auth}\n"
        # ACLs of the x509 scheme (a client certificate's subject) are valid only with
        # its provider registered; the secure port authenticates each connection by it.
        "authProvider.x509=org.apache.zookeeper.server.auth.X509AuthenticationProvider\n"
    )


def _launch(
    directory: Path,
    config: str,
    wrapper: Sequence[str] = (),
    jvm: Sequence[str] = (),
    *,
    tls: bool = False,
) -> subprocess.Popen[bytes]:
    """Start the server of ``config`` (zoo.cfg's text) logging to zookeeper.log in
    ``directory``; ``wrapper`` goes before ``java`` (a namespace's), ``jvm`` after it;
    ``tls``: Netty's codec on the class path."""
    path = directory / "zoo.cfg"
    path.write_text(config)
    # Its log configuration, in a directory on the class path: to the log file.
    (directory / "log4j.properties").write_text(LOG4J)
    classpath = f"{directory}:{JAR}:{LOGGING}" + (f":{NETTY_CODEC}" if tls else "")
    with (directory / "zookeeper.log").open("ab") as log:
        return subprocess.Popen(
            [*wrapper, "java", *jvm, "-cp", classpath,
             "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(path)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip


class ZooKeeperEnsemble:
    """Three ZooKeeper servers, each in the network namespace of one of ``hosts``, on
    port 2181 of its address; the test reaches them through ``portal`` (a thread in
    another of the namespaces). Each grants sessions of at most ``max_session_ms``.

    ``tick_ms`` is small so that a lost follower or leader is noticed within about a
    second (``syncLimit`` ticks) and an election takes a few ticks.

    ``security`` (one of :data:`SECURITY`): ``sasl+tls`` serves clients over TLS only
    (a certificate naming every member's address; client certificates required) with
    the service's SASL user; the members' quorum traffic stays plain.
    """

    PORT = 2181

    def __init__(
        self,
        directory: Path,
        hosts: Sequence[Host],
        portal: Portal,
        tick_ms: int = 200,
        max_session_ms: int = 3000,
        security: str = "plain",
    ) -> None:
        _installed()
        assert security in SECURITY, security
        self.security = security
        self.members = list(hosts)
        self.hosts = ",".join(f"{host.address}:{self.PORT}" for host in hosts)
        self.tls: ZkTls | None = None
        self.service: ServiceIdentity | None = None
        if security == "sasl+tls":
            addresses = [host.address for host in hosts]
            self.tls = ZkTls.make(directory / "tls", hosts=addresses, client_hosts=addresses)
            self.service = ServiceIdentity.make(directory / "service")
        self._context = self.tls.ssl_context() if self.tls is not None else None
        self._directory = directory
        self._portal = portal
        self._tick_ms = tick_ms
        self._max_session_ms = max_session_ms
        self._processes: dict[str, subprocess.Popen[bytes]] = {}

    def access_flags(self) -> tuple[str, ...]:
        """The flags a node needs to reach this ensemble as it is secured."""
        return _access_flags(self.tls, self.service)

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
        config = _config(
            directory, self._tick_ms, member.address, self.PORT, self._max_session_ms, self.tls
        )
        (directory / "data" / "myid").write_text(f"{myid}\n")
        config += "initLimit=10\nsyncLimit=5\n4lw.commands.whitelist=srvr\n" + "".join(
            f"server.{n}={host.address}:2888:3888\n" for n, host in enumerate(self.members, start=1)
        )
        users = {self.service.user: self.service.password} if self.service is not None else {}
        lines, jvm = _auth_config(directory, users, None)
        self._processes[member.name] = _launch(
            directory, config + lines, member.command(), (*ENSEMBLE_JVM, *jvm),
            tls=self.tls is not None,
        )  # fmt: skip

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
        """``leader`` or ``follower`` (``srvr``), or None while it serves no client.

        Over TLS it asks through the test's own TLS context (kazoo's ``command()`` cannot),
        checking the member's certificate as the nodes do."""

        def ask() -> str | None:
            try:
                with socket.create_connection((member.address, self.PORT), timeout=1) as raw:
                    sock = (
                        raw if self._context is None
                        else self._context.wrap_socket(raw, server_hostname=member.address)
                    )  # fmt: skip
                    with sock:
                        sock.sendall(b"srvr")
                        # A TLS peer that closes without close_notify reads as the end.
                        answer = b"".join(iter(lambda: sock.recv(4096), b""))
            except OSError:  # ssl.SSLError too: a member not (yet) serving TLS
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
