"""TLS and mutual TLS on the real server, with certificates made at test time."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from thriftpy2.transport import TTransportException

from tests.support.endpoints import tls_client
from tests.support.processes import (
    ServerDidNotStart,
    ServerProcess,
    failures,
    parse_metrics,
    start_server,
)


class Pki:
    """A server CA, a client CA, and another CA nobody trusts."""

    def __init__(self, directory: Path) -> None:
        self.server_ca = trustme.CA()
        self.client_ca = trustme.CA()
        self.rogue_ca = trustme.CA()
        self.server_pem = directory / "server.pem"
        self.server_ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
            str(self.server_pem)
        )
        self.client_ca_pem = directory / "client-ca.pem"
        self.client_ca.cert_pem.write_to_path(str(self.client_ca_pem))

    def context(self, client_cert_from: trustme.CA | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.server_ca.configure_trust(context)
        if client_cert_from is not None:
            client_cert_from.issue_cert("client@example.com").configure_cert(context)
        return context


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_server(pki: Pki) -> Iterator[ServerProcess]:
    server = start_server("--tls-cert", str(pki.server_pem))
    yield server
    assert server.stop() == 0


@pytest.fixture
def mtls_server(pki: Pki) -> Iterator[ServerProcess]:
    server = start_server(
        "--tls-cert", str(pki.server_pem), "--tls-client-ca", str(pki.client_ca_pem)
    )
    yield server
    assert server.stop() == 0


REFUSED = (TTransportException, OSError)


def test_tls_serves_tls_clients_and_refuses_plain_ones(tls_server: ServerProcess, pki: Pki) -> None:
    client = tls_client(tls_server, pki.context())
    assert client.get_id("over-tls") > 0
    assert len(client.get_ids("over-tls", 4096)) == 4096
    with pytest.raises(REFUSED):
        tls_server.raw_client().get_id("plain")
    assert client.get_id("still-tls") > 0
    assert failures(parse_metrics(tls_server.metrics()), "tls_error") >= 1


def test_mutual_tls_lets_in_only_certificates_of_the_client_ca(
    mtls_server: ServerProcess, pki: Pki
) -> None:
    for refused in (None, pki.rogue_ca, pki.server_ca):  # none, unknown CA, wrong CA
        with pytest.raises(REFUSED):
            tls_client(mtls_server, pki.context(client_cert_from=refused)).get_id("nope")
    with pytest.raises(REFUSED):
        mtls_server.raw_client().get_id("plain")
    good = tls_client(mtls_server, pki.context(client_cert_from=pki.client_ca))
    assert good.get_id("trusted") > 0
    assert failures(parse_metrics(mtls_server.metrics()), "tls_error") >= 4


def test_a_client_that_never_handshakes_does_not_block_others(
    tls_server: ServerProcess, pki: Pki
) -> None:
    with socket.create_connection((tls_server.host, tls_server.port)):  # silent
        assert tls_client(tls_server, pki.context()).get_id("not-blocked") > 0


def test_bad_tls_files_are_start_up_errors(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ServerDidNotStart, match=r"--tls-cert .*missing\.pem"):
        start_server("--tls-cert", str(tmp_path / "missing.pem"))
    with pytest.raises(ServerDidNotStart, match="--tls-client-ca"):
        start_server(
            "--tls-cert", str(pki.server_pem), "--tls-client-ca", str(pki.server_pem) + "x"
        )
    with pytest.raises(ServerDidNotStart, match="need --tls-cert"):
        start_server("--tls-client-ca", str(pki.client_ca_pem))
