"""Cluster mode over TLS to a real ZooKeeper (``secureClientPort`` only, Netty,
certificates the test makes): nodes register, lease and keep their marks through it;
a server whose certificate names another host, one signed by a CA the node does not
trust, and a node without a client certificate where one is required are refused;
certificate files replaced in place are used at the next reconnection, in the same
session."""

from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path
from typing import Any

import pytest
import trustme
from cryptography import x509
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NoAuthError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.connection import _CONNECTION_DROP
from kazoo.security import ACL, Id, Permissions
from snowflake_thrift_client import ZooKeeperDiscovery
from snowflake_thrift_client._zkkazoo import CaOnlyHandler

from snowflake_server import ServerSettings
from snowflake_server._cluster.zk import client_options, tls_hint
from snowflake_server._config.options import load_settings
from snowflake_server._config.settings import ZooKeeperAccess
from snowflake_server._errors import ConfigurationError, StartupDeferred
from tests.support.inprocess import InProcessServer
from tests.support.waiting import wait_until
from tests.support.zookeeper import KAZOO_TLS_SOCKETS, ZkTls, ZooKeeper, write_client

pytestmark = [pytest.mark.zookeeper, *map(pytest.mark.filterwarnings, KAZOO_TLS_SOCKETS)]


def settings_for(
    zk: ZooKeeper, zk_path: str, tls: ZkTls | None = None, **kw: Any
) -> ServerSettings:
    """A node's settings to join ``zk`` under ``zk_path`` with ``tls``'s files (``zk``'s
    by default), failing fast."""
    tls = tls or zk.tls
    assert tls is not None
    return ServerSettings(
        zookeeper=zk.hosts, zk_path=zk_path, advertise_host="127.0.0.1",
        zk_session_timeout=4, zk_connect_timeout=3, worker_id=kw.pop("worker_id", -1),
        zk_tls_ca=str(tls.ca),
        zk_tls_cert=str(tls.client_cert) if tls.presents_cert else "",
        zk_tls_key=str(tls.client_key) if tls.presents_cert else "",
        **kw,
    )  # fmt: skip


def refusal(settings: ServerSettings, state: Path) -> str:
    """Why a node with ``settings`` does not start (``StartupDeferred``'s words)."""
    with pytest.raises(StartupDeferred) as info:
        InProcessServer(settings, state).start()
    return str(info.value)


def test_nodes_register_lease_and_keep_marks_over_tls(
    tls_zk: ZooKeeper, zk_path: str, tmp_path: Path
) -> None:
    settings = settings_for(tls_zk, zk_path)
    with (
        InProcessServer(settings, tmp_path / "a") as a,
        InProcessServer(settings, tmp_path / "b") as b,
    ):
        ids = [a.raw_client().get_id("tls"), b.raw_client().get_id("tls")]
        assert len(set(ids)) == 2
        zk = tls_zk.client()
        zk.start(timeout=10)
        try:
            assert sorted(zk.get_children(f"{zk_path}/nodes/0")) == ["0", "1"]
            assert sorted(zk.get_children(f"{zk_path}/marks/0")) == ["0", "1"]
        finally:
            zk.stop()
            zk.close()
        assert a.node.mode is not None and a.node.mode.details()["zookeeper"] == "CONNECTED"
    zk = tls_zk.client()
    zk.start(timeout=10)
    try:
        assert zk.get_children(f"{zk_path}/nodes/0") == []  # deregistered on stop
        for worker in ("0", "1"):
            mark, _ = zk.get(f"{zk_path}/marks/0/{worker}")
            assert mark  # the final marks, written over TLS
    finally:
        zk.stop()
        zk.close()


def test_a_server_certificate_for_another_host_is_refused(zk_path: str, tmp_path: Path) -> None:
    tls = ZkTls.make(tmp_path / "tls", hosts=("zookeeper.example",))
    zk = ZooKeeper(tmp_path / "zk", tls=tls)
    zk.start()
    try:
        # The chain is trusted: only the name differs (kazoo's default would connect).
        lax = zk.client(check_hostname=False)
        lax.start(timeout=20)
        lax.stop()
        lax.close()
        why = refusal(settings_for(zk, zk_path), tmp_path / "state")
        assert "over TLS" in why and "hostname verification" in why, why
    finally:
        zk.stop()


def test_a_server_signed_by_an_untrusted_ca_is_refused(
    tls_zk: ZooKeeper, zk_path: str, tmp_path: Path
) -> None:
    assert tls_zk.tls is not None
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    why = refusal(settings_for(tls_zk, zk_path, tls_zk.tls.with_ca(other)), tmp_path / "state")
    assert f"signed by the CA in --zk-tls-ca {other}" in why, why


def test_only_the_given_ca_is_trusted_not_the_system_s(
    tls_zk: ZooKeeper, zk_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose certificate a publicly trusted CA signed is refused unless it is
    --zk-tls-ca's: kazoo's own TLS loads the system's CAs too (a MITM with any public
    certificate for the host would pass). The server's CA is made "public" here by
    pointing OpenSSL's default trust at it."""
    assert tls_zk.tls is not None
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_zk.tls.ca))
    system = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    system.load_default_certs()
    own = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    own.load_verify_locations(str(tls_zk.tls.ca))
    assert own.get_ca_certs()[0] in system.get_ca_certs(), "the server's CA is the system's"
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    untrusting = tls_zk.tls.with_ca(other)
    discovery = ZooKeeperDiscovery(
        tls_zk.hosts, zk_path, timeout=2, tls_ca=str(other),
        tls_cert=str(untrusting.client_cert), tls_key=str(untrusting.client_key),
    )  # fmt: skip
    with discovery, pytest.raises(KazooTimeoutError):
        discovery()
    node = InProcessServer(settings_for(tls_zk, zk_path, untrusting), tmp_path / "state")
    try:
        node.start()
    except StartupDeferred as refused:
        assert f"signed by the CA in --zk-tls-ca {other}" in str(refused)
    else:
        node.stop()
        pytest.fail("a node trusted a ZooKeeper signed by a CA only the system trusts")


def test_no_client_certificate_where_one_is_required_is_refused(
    tls_zk: ZooKeeper, zk_path: str, tmp_path: Path
) -> None:
    assert tls_zk.tls is not None
    settings = settings_for(tls_zk, zk_path, tls_zk.tls.without_client_cert())
    why = refusal(settings, tmp_path / "state")
    assert "no client certificate is presented" in why, why


def test_no_client_certificate_is_needed_where_none_is_asked(zk_path: str, tmp_path: Path) -> None:
    tls = ZkTls.make(tmp_path / "tls", client_auth="none").without_client_cert()
    zk = ZooKeeper(tmp_path / "zk", tls=tls)
    zk.start()
    try:
        with InProcessServer(settings_for(zk, zk_path), tmp_path / "state") as node:
            assert node.raw_client().get_id("tls") > 0
    finally:
        zk.stop()


def test_tls_files_that_do_not_load_are_a_configuration_error(
    tls_zk: ZooKeeper, zk_path: str, tmp_path: Path
) -> None:
    assert tls_zk.tls is not None
    good = settings_for(tls_zk, zk_path)
    missing = str(tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    other_key = tmp_path / "other-key.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    cases = {
        "--zk-tls-ca": dataclasses.replace(good, zk_tls_ca=missing),
        "not PEM": dataclasses.replace(good, zk_tls_ca=str(garbage)),
        "--zk-tls-key": dataclasses.replace(good, zk_tls_key=str(other_key)),
    }
    for words, settings in cases.items():
        with pytest.raises(ConfigurationError, match=words):
            InProcessServer(settings, tmp_path / "state").start()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--zk-tls-ca", "ca.pem", "--zk-tls-cert", "c.pem"], "go together"),
        (["--zk-tls-cert", "c.pem", "--zk-tls-key", "k.pem"], "needs --zk-tls-ca"),
    ],
)
def test_half_given_tls_settings_are_refused(flags: list[str], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        load_settings(["--zookeeper", "zk:2181", *flags])


def test_client_options_verify_the_chain_and_the_host_name() -> None:
    assert client_options(ZooKeeperAccess()) == {}
    assert tls_hint(ZooKeeperAccess()) == ""
    access = load_settings(
        ["--zookeeper", "zk:2281", "--zk-tls-ca", "ca.pem", "--zk-tls-cert", "c.pem",
         "--zk-tls-key", "k.pem"]
    ).cluster.access  # fmt: skip
    options = client_options(access)
    assert isinstance(options.pop("handler"), CaOnlyHandler), "the CA only, not the system's"
    assert options == {
        "use_ssl": True, "ca": "ca.pem", "certfile": "c.pem", "keyfile": "k.pem",
        "verify_certs": True, "check_hostname": True,
    }  # fmt: skip
    assert client_options(access)["handler"] is not client_options(access)["handler"]


def issue(authority: trustme.CA, name: str) -> tuple[trustme.LeafCert, str]:
    """A client certificate for ``name``, and its subject as ZooKeeper's x509 scheme
    names it (RFC 2253, as Java writes it: no characters that it would escape)."""
    cert = authority.issue_cert(
        "127.0.0.1", common_name=name, organization_name="snowflake",
        organization_unit_name="tests",
    )  # fmt: skip
    loaded = x509.load_pem_x509_certificate(cert.cert_chain_pems[0].bytes())
    return cert, loaded.subject.rfc4514_string()


def test_new_client_certificate_files_are_used_at_the_next_reconnection_in_the_same_session(
    tls_zk: ZooKeeper, zk_path: str, tmp_path: Path
) -> None:
    """kazoo loads the files at every connection attempt: a rotation needs neither a
    restart nor a new session (one would lose the worker id's lease)."""
    base = tls_zk.tls
    assert base is not None
    # Files of the node's own, so that rotating them leaves the module's alone.
    tls = dataclasses.replace(
        base, client_cert=tmp_path / "client.pem", client_key=tmp_path / "client-key.pem"
    )
    write_client(tls, issue(base.authority, "node-before")[0])
    after, after_subject = issue(base.authority, "node-after")
    made: list[KazooClient] = []

    def factory(**kwargs: Any) -> KazooClient:
        made.append(KazooClient(**kwargs))
        return made[-1]

    # A znode only the new certificate may write: ZooKeeper's x509 scheme names each
    # connection by its client certificate's subject.
    probe = f"{zk_path}-only-after"
    admin = tls_zk.client()
    admin.start(timeout=10)
    admin.create(probe, b"", acl=[ACL(Permissions.ALL, Id("x509", after_subject))])
    settings = settings_for(tls_zk, zk_path, tls, worker_id=3)
    try:
        with InProcessServer(settings, tmp_path / "state", zk_client_factory=factory) as node:
            client = made[0]
            session = client.client_id[0]
            assert client.retry(client.exists, probe) is not None
            with pytest.raises(NoAuthError):
                client.set(probe, b"before")
            write_client(tls, after)
            states: list[str] = []
            client.add_listener(states.append)
            client._call(_CONNECTION_DROP, None)  # as kazoo's own test harness drops it
            wait_until(
                lambda: states[-2:] == [KazooState.SUSPENDED, KazooState.CONNECTED],
                "dropped and connected again",
            )
            client.retry(client.set, probe, b"after")  # the new certificate's identity
            assert client.get(probe)[0] == b"after"
            assert client.client_id[0] == session, "the same session"
            assert len(made) == 1
            assert node.raw_client().get_id("rotated") > 0
    finally:
        admin.delete(probe)  # its parent's ACL allows it
        admin.stop()
        admin.close()


def test_kazoo_times_out_on_every_tls_failure(tls_zk: ZooKeeper) -> None:
    """Why the refusals above can only name what to check: kazoo reports a failed
    handshake as a time-out (its log has the SSL error)."""
    client = tls_zk.client(certfile=None, keyfile=None)
    with pytest.raises(KazooTimeoutError):
        client.start(timeout=2)
    client.stop()
    client.close()


@pytest.mark.parametrize("given", [{"ca": None}, {"ca": "ca.pem", "verify_certs": False}])
def test_the_handler_refuses_tls_that_trusts_nothing_or_anything(given: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="give ca"):
        CaOnlyHandler().create_connection(("127.0.0.1", 1), use_ssl=True, **given)
