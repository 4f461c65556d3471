"""TLS from the client's side: client_context against a real server with certificates
made at test time, with and without client certificates.

The servers run in processes of their own: the in-process server leaks the socket of a
refused TLS handshake, which the ResourceWarning turned error fails the test on."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trustme
from snowflake_thrift_client import (
    CallFailedError,
    NoServerAvailableError,
    SnowflakeClient,
    SnowflakePool,
    client_context,
    decompose,
)

from tests.client.helpers import address
from tests.support.processes import ServerProcess, start_server


class Pki:
    """A CA for the server's certificate, and one for clients' certificates."""

    def __init__(self, directory: Path) -> None:
        ca, client_ca = trustme.CA(), trustme.CA()
        self.ca = directory / "ca.pem"
        ca.cert_pem.write_to_path(str(self.ca))
        self.server = directory / "server.pem"
        ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(self.server))
        self.client_ca = directory / "client-ca.pem"
        client_ca.cert_pem.write_to_path(str(self.client_ca))
        issued = client_ca.issue_cert("client@example.com")
        self.client_cert = directory / "client.pem"
        issued.cert_chain_pems[0].write_to_path(str(self.client_cert))
        self.client_key = directory / "client.key"
        issued.private_key_pem.write_to_path(str(self.client_key))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_servers() -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        started.append(start_server(*args))
        return started[-1]

    yield start
    codes = [server.stop() for server in started]
    assert codes == [0] * len(started), [server.log() for server in started]


def test_a_context_that_trusts_the_servers_ca(
    tls_servers: Callable[..., ServerProcess], pki: Pki
) -> None:
    server = tls_servers("--worker-id", "3", "--tls-cert", str(pki.server))
    context = client_context(str(pki.ca))
    with SnowflakePool(address(server), ssl_context=context) as pool:
        assert decompose(pool.next_id()).worker_id == 3 and len(pool.next_ids(5)) == 5
    with SnowflakeClient(server.host, server.port, ssl_context=context) as client:
        assert client.worker_id() == 3
    for refused in [client_context(), None]:  # the system's CAs only; plain Thrift
        with (
            SnowflakePool(address(server), timeout=2, attempts=1, ssl_context=refused) as pool,
            pytest.raises(NoServerAvailableError),
        ):
            pool.next_id()
    with pytest.raises(CallFailedError, match="CERTIFICATE_VERIFY_FAILED") as info:
        SnowflakeClient(server.host, server.port, ssl_context=client_context()).next_id()
    assert not info.value.connected, "refused during the handshake"


def test_a_client_certificate_for_a_server_that_requires_one(
    tls_servers: Callable[..., ServerProcess], pki: Pki
) -> None:
    server = tls_servers("--tls-cert", str(pki.server), "--tls-client-ca", str(pki.client_ca))
    with_cert = client_context(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    with SnowflakePool(address(server), ssl_context=with_cert) as pool:
        assert pool.next_id() > 0
    without = client_context(str(pki.ca))
    with (
        SnowflakePool(address(server), timeout=2, attempts=1, ssl_context=without) as pool,
        pytest.raises(NoServerAvailableError),
    ):
        pool.next_id()
