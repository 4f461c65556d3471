"""The HTTP/JSON API and the admin endpoint over TLS on a real server process: the
API takes the Thrift port's --tls-* files (one identity per node), mutual TLS included;
SIGHUP reloads the API's certificate and the admin endpoint's web configuration; a bad
web configuration exits 2 naming it."""

from __future__ import annotations

import base64
import http.client
import json
import signal
import ssl
from pathlib import Path

import bcrypt
import pytest
import trustme

from snowflake_server._app.exits import ExitCode
from tests.support.processes import ServerProcess, spawned, start_server
from tests.support.waiting import wait_until


def issue(ca: trustme.CA, path: Path) -> None:
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(path))


def trusting(ca: trustme.CA, client_cert_from: trustme.CA | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if client_cert_from is not None:
        client_cert_from.issue_cert("client@example.com").configure_cert(context)
    return context


def https_get(
    address: tuple[str, int], path: str, context: ssl.SSLContext, auth: str = ""
) -> tuple[int, bytes]:
    connection = http.client.HTTPSConnection(*address, timeout=5, context=context)
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        connection.request("GET", path, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def api(server: ServerProcess) -> tuple[str, int]:
    assert server.http is not None
    return server.http


def test_the_http_api_over_mutual_tls(tmp_path: Path) -> None:
    server_ca, client_ca, rogue_ca = trustme.CA(), trustme.CA(), trustme.CA()
    issue(server_ca, tmp_path / "server.pem")
    client_ca.cert_pem.write_to_path(str(tmp_path / "client-ca.pem"))
    server = start_server(
        "--http-port", "0", "--tls-cert", str(tmp_path / "server.pem"),
        "--tls-client-ca", str(tmp_path / "client-ca.pem"),
    )  # fmt: skip
    try:
        status, body = https_get(api(server), "/v1/id?agent=m", trusting(server_ca, client_ca))
        assert status == 200 and int(json.loads(body)["id"]) > 0
        for refused in (trusting(server_ca), trusting(server_ca, rogue_ca)):
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
                https_get(api(server), "/v1/id?agent=m", refused)
    finally:
        assert server.stop() == 0


def test_sighup_reloads_the_api_certificate_and_the_admin_web_configuration(
    tmp_path: Path,
) -> None:
    old_ca, new_ca = trustme.CA(), trustme.CA()
    cert = tmp_path / "server.pem"
    issue(old_ca, cert)
    issue(old_ca, tmp_path / "admin.pem")
    web = tmp_path / "web.yml"
    hashed = bcrypt.hashpw(b"one", bcrypt.gensalt(4)).decode()
    web.write_text(
        f"tls_server_config: {{cert_file: admin.pem, key_file: admin.pem}}\n"
        f"basic_auth_users: {{alice: '{hashed}'}}\n",
        encoding="utf-8",
    )
    server = start_server(
        "--http-port", "0", "--tls-cert", str(cert), "--web-config-file", str(web)
    )  # fmt: skip
    admin = ("127.0.0.1", server.metrics_port)
    try:
        assert https_get(api(server), "/v1/layout", trusting(old_ca))[0] == 200
        assert https_get(admin, "/metrics", trusting(old_ca), "alice:one")[0] == 200
        assert https_get(admin, "/readyz", trusting(old_ca))[0] == 200
        issue(new_ca, cert)
        issue(new_ca, tmp_path / "admin.pem")
        hashed = bcrypt.hashpw(b"two", bcrypt.gensalt(4)).decode()
        web.write_text(
            f"tls_server_config: {{cert_file: admin.pem, key_file: admin.pem}}\n"
            f"basic_auth_users: {{bob: '{hashed}'}}\n",
            encoding="utf-8",
        )
        server.process.send_signal(signal.SIGHUP)

        def reloaded() -> bool:
            try:
                return https_get(api(server), "/v1/layout", trusting(new_ca))[0] == 200
            except ssl.SSLError:
                return False

        wait_until(reloaded, "the API serving the new certificate")
        wait_until(
            lambda: "reloaded web configuration" in server.log(), "the admin endpoint reloaded"
        )
        assert https_get(admin, "/metrics", trusting(new_ca), "bob:two")[0] == 200
        assert https_get(admin, "/metrics", trusting(new_ca), "alice:one")[0] == 401
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "tls_server_config: {cert_file: a.pem, key_file: a.pem, colour: red}",
            "unknown key 'colour' in tls_server_config",
        ),
        # A mistyped value, and nesting too deep to read: exit 2, never a traceback (exit 1).
        (
            "tls_server_config: {cert_file: a.pem, key_file: a.pem, min_version: [TLS12]}",
            "tls_server_config.min_version: unknown TLS version ['TLS12']",
        ),
        ("tls_server_config: " + "[" * 20000 + "]" * 20000, "nested too deeply to read"),
    ],
)
def test_a_bad_web_configuration_exits_2_naming_it(tmp_path: Path, text: str, says: str) -> None:
    web = tmp_path / "web.yml"
    web.write_text(text + "\n", encoding="utf-8")
    with spawned("--web-config-file", str(web)) as server:
        code, _ = server.end(15)
        assert code == ExitCode.CONFIGURATION, server.log()
        assert f"--web-config-file {web}: {says}" in server.log()
        assert "Traceback" not in server.log()
