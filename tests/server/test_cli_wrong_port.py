"""``snowflake get`` pointed at a port that is not a Thrift server says, within a second,
what it reached (an HTTP server, a TLS server, an SSH server), rather than waiting for
its timeout to say "no reply in time"; a silent port still times out, as before."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
import yaml

from snowflake_server import ServerSettings
from snowflake_server._cli import main
from tests.support.foreign import HTTP_400, SSH_BANNER, TLS_ALERT, foreign_server
from tests.support.inprocess import InProcessServer

# Long: a wrong port is named at its first bytes, not at the timeout (the old code waited it
# out, per attempt, and said "no reply in time"), so the message tells which happened with
# no timed assertion.
TIMEOUT = "30"


def get(port: int, capsys: pytest.CaptureFixture[str], timeout: str = TIMEOUT) -> str:
    """What ``snowflake get --port PORT`` says on standard error."""
    assert main(["get", "--port", str(port), "--timeout", timeout]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    return err


@pytest.fixture
def pem(tmp_path: Path) -> Path:
    path = tmp_path / "server.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(path))
    return path


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[InProcessServer]:
    settings = ServerSettings(http_port=0, http_host="127.0.0.1")
    with InProcessServer(settings, tmp_path / "state") as server:
        yield server


def test_get_on_the_http_api_port_says_an_http_server_answered(
    http_server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert http_server.node.http_address is not None
    port = http_server.node.http_address[1]
    err = get(port, capsys)
    assert err == (
        f"snowflake get: 127.0.0.1:{port}: an HTTP server answered (HTTP/1.1 400 Bad Request), "
        "not a Thrift server: is this the HTTP API or the admin (metrics) port? Thrift is on "
        "7609 by default\n"
    )


def test_get_on_the_admin_port_says_an_http_server_answered(
    http_server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    err = get(http_server.metrics_port, capsys)
    assert "an HTTP server answered (HTTP/1.1 400 Bad Request)" in err
    assert "is this the HTTP API or the admin (metrics) port?" in err


def test_get_on_an_http_server_that_keeps_the_connection_says_so_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with foreign_server(answer=HTTP_400) as port:
        err = get(port, capsys)
    assert "an HTTP server answered (HTTP/1.1 400 Bad Request)" in err


def test_get_on_a_tls_alert_says_a_tls_server_answered(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with foreign_server(answer=TLS_ALERT) as port:
        err = get(port, capsys)
    assert f"127.0.0.1:{port}: a TLS server answered (a TLS alert), not a Thrift server" in err
    assert "snowflake get speaks plain Thrift: is this a TLS port" in err


def test_get_on_a_thrift_tls_port_says_a_tls_server(
    tmp_path: Path, pem: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Our TLS port closes at a Thrift frame without a word: the command asks it for a
    TLS handshake to say what it is."""
    settings = ServerSettings(tls_cert=str(pem))
    with InProcessServer(settings, tmp_path / "state") as server:
        err = get(server.port, capsys)
    assert f"127.0.0.1:{server.port}: a TLS server closed the connection" in err
    assert "is this a TLS port" in err


def test_get_on_the_admin_port_over_https_says_a_tls_server(
    tmp_path: Path, pem: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    web = tmp_path / "web.yml"
    web.write_text(
        yaml.safe_dump({"tls_server_config": {"cert_file": str(pem), "key_file": str(pem)}})
    )
    settings = ServerSettings(web_config_file=str(web))
    with InProcessServer(settings, tmp_path / "state") as server:
        err = get(server.metrics_port, capsys)
    assert "a TLS server closed the connection" in err


def test_get_on_an_ssh_server_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with foreign_server(banner=SSH_BANNER) as port:
        err = get(port, capsys)
    assert "an SSH server answered (SSH-2.0-OpenSSH_9.2p1 Debian-2)" in err
    assert "is this the snowflake server's port?" in err


@pytest.mark.slow
def test_get_on_a_silent_port_still_times_out_with_the_old_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with foreign_server() as port:
        started = time.monotonic()
        err = get(port, capsys, timeout="0.3")
        took = time.monotonic() - started
    assert err == f"snowflake get: no reply in time from 127.0.0.1:{port}\n"
    assert took >= 0.3  # it waited its timeout out
