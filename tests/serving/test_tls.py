"""TLS for the serving core (snowflake_server/_serving/tls.py): contexts from files, with
errors a person can act on, and one connection's session over memory buffers."""

from __future__ import annotations

import contextlib
import ssl
from pathlib import Path

import pytest
import trustme

from snowflake_server import ConfigurationError
from snowflake_server._serving.tls import TlsSession, server_context


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


def _pem(ca: trustme.CA, path: Path) -> str:
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(path))
    return str(path)


def test_unreadable_or_wrong_files_are_configuration_errors(ca: trustme.CA, tmp_path: Path) -> None:
    pem = _pem(ca, tmp_path / "server.pem")
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ConfigurationError, match=r"--tls-cert .*cannot read it: No such file"):
        server_context(missing)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigurationError, match="cannot load a certificate and its key from it"):
        server_context(str(junk))
    with pytest.raises(ConfigurationError, match=r"--tls-client-ca .*cannot read it"):
        server_context(pem, client_ca=missing)
    with pytest.raises(ConfigurationError, match="cannot load CA certificates from it"):
        server_context(pem, client_ca=str(junk))


def test_a_client_ca_requires_client_certificates(ca: trustme.CA, tmp_path: Path) -> None:
    pem = _pem(ca, tmp_path / "server.pem")
    client_ca = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(client_ca))
    context = server_context(pem, client_ca=str(client_ca))
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert server_context(pem).verify_mode == ssl.CERT_NONE


def _handshake(
    ca: trustme.CA, tmp_path: Path
) -> tuple[TlsSession, ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    session = TlsSession(server_context(_pem(ca, tmp_path / "server.pem")))
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    into_client, from_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(into_client, from_client, server_hostname="127.0.0.1")
    assert not session.mid_handshake
    while True:
        try:
            client.do_handshake()
            break
        except ssl.SSLWantReadError:
            plaintext, reply = session.receive(from_client.read())
            assert plaintext == b"" and (session.established or session.mid_handshake)
            into_client.write(reply)
    return session, client, into_client, from_client


def test_a_session_carries_data_both_ways_and_sees_the_peers_close(
    ca: trustme.CA, tmp_path: Path
) -> None:
    session, client, into_client, from_client = _handshake(ca, tmp_path)
    # TLS 1.3: the server's tickets come after the client's last handshake flight.
    client.write(b"hello")
    plaintext, reply = session.receive(from_client.read())
    assert plaintext == b"hello" and session.established and not session.mid_handshake
    into_client.write(reply + session.encrypt(b"world"))
    assert client.read(5) == b"world"
    with contextlib.suppress(ssl.SSLWantReadError):
        client.unwrap()  # close_notify
    plaintext, _ = session.receive(from_client.read())
    assert plaintext == b"" and session.closed_by_peer
    assert session.close()  # its own close_notify


def test_a_session_closed_before_its_handshake_sends_nothing(
    ca: trustme.CA, tmp_path: Path
) -> None:
    session = TlsSession(server_context(_pem(ca, tmp_path / "server.pem")))
    assert session.close() == b""
    with pytest.raises(ssl.SSLError):
        session.receive(b"\x16\x03\x01\x00\x05hello")  # a record that is no ClientHello
