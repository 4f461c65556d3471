"""The admin endpoint's web configuration as Prometheus uses it: promtool accepts the
example docs/operations.md shows, and a real Prometheus scrapes a real server through it
(HTTPS, a client certificate, basic auth), while a job with a wrong password is refused."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import bcrypt
import pytest
import trustme
import yaml

from snowflake_server._http.webconfig import load_web_config
from tests.deploy.test_alerts import promtool
from tests.deploy.test_prometheus import Prometheus
from tests.support.processes import start_server
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
_YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.S)


def documented(key: str) -> str:
    """The YAML block of docs/operations.md that holds ``key``."""
    blocks = [b for b in _YAML_BLOCK.findall(OPERATIONS.read_text(encoding="utf-8")) if key in b]
    assert len(blocks) == 1, f"one yaml block with {key} in {OPERATIONS}"
    block: str = blocks[0]
    return block


def write_pki(directory: Path) -> tuple[trustme.CA, trustme.CA]:
    """The admin certificate (files admin.pem, admin-key.pem) and the scraper's CA
    (prometheus-ca.pem); returns (server CA, client CA)."""
    server_ca, client_ca = trustme.CA(), trustme.CA()
    cert = server_ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(directory / "admin.pem"))
    cert.private_key_pem.write_to_path(str(directory / "admin-key.pem"))
    client_ca.cert_pem.write_to_path(str(directory / "prometheus-ca.pem"))
    return server_ca, client_ca


def test_promtool_accepts_the_documented_web_configuration(tmp_path: Path) -> None:
    write_pki(tmp_path)
    text = documented("basic_auth_users").replace("/etc/snowflake/", f"{tmp_path}/")
    path = tmp_path / "web.yml"
    path.write_text(text, encoding="utf-8")
    checked = subprocess.run(
        [promtool(), "check", "web-config", str(path)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = load_web_config(str(path))
    assert config.require_client_cert and config.scheme == "https"
    # The password the example names is the one its hash holds.
    assert bcrypt.checkpw(b"change-me", config.users["prometheus"])
    scrape = yaml.safe_load(documented("scrape_configs"))["scrape_configs"][0]
    assert scrape["scheme"] == "https" and set(scrape["tls_config"]) == {
        "ca_file", "cert_file", "key_file",
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_prometheus_scrapes_through_tls_a_client_certificate_and_basic_auth(
    tmp_path: Path,
) -> None:
    server_ca, client_ca = write_pki(tmp_path)
    hashed = bcrypt.hashpw(b"scrape-me", bcrypt.gensalt(10)).decode()
    web = tmp_path / "web.yml"
    web.write_text(
        yaml.safe_dump({
            "tls_server_config": {
                "cert_file": "admin.pem", "key_file": "admin-key.pem",
                "client_auth_type": "RequireAndVerifyClientCert",
                "client_ca_file": "prometheus-ca.pem",
            },
            "basic_auth_users": {"prometheus": hashed},
        }),
        encoding="utf-8",
    )  # fmt: skip
    scraper = client_ca.issue_cert("prometheus")
    scraper.cert_chain_pems[0].write_to_path(str(tmp_path / "prometheus.pem"))
    scraper.private_key_pem.write_to_path(str(tmp_path / "prometheus-key.pem"))
    server_ca.cert_pem.write_to_path(str(tmp_path / "admin-ca.pem"))
    (tmp_path / "password").write_text("scrape-me", encoding="utf-8")
    (tmp_path / "wrong").write_text("guess", encoding="utf-8")

    server = start_server("--web-config-file", str(web))
    target = f"127.0.0.1:{server.metrics_port}"

    def job(name: str, password_file: str) -> dict[str, object]:
        return {
            "job_name": name,
            "scheme": "https",
            "tls_config": {
                "ca_file": str(tmp_path / "admin-ca.pem"),
                "cert_file": str(tmp_path / "prometheus.pem"),
                "key_file": str(tmp_path / "prometheus-key.pem"),
            },
            "basic_auth": {
                "username": "prometheus",
                "password_file": str(tmp_path / password_file),
            },
            "static_configs": [{"targets": [target]}],
        }

    prometheus = Prometheus(
        tmp_path / "prometheus",
        {
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [job("snowflake", "password"), job("snowflake-wrong", "wrong")],
        },
    )
    try:
        wait_until(prometheus.ready, "prometheus ready", 30)

        def health() -> dict[str, tuple[str, str]]:
            targets = prometheus.get("/api/v1/targets")["data"]["activeTargets"]
            return {t["labels"]["job"]: (t["health"], t["lastError"]) for t in targets}

        wait_until(
            lambda: (
                health().get("snowflake", ("",))[0] == "up"
                and health().get("snowflake-wrong", ("",))[0] == "down"
            ),
            "the right job up, the wrong one down",
            30,
        )
        assert "401" in health()["snowflake-wrong"][1], health()
        wait_until(lambda: prometheus.query('snowflake_info{job="snowflake"}'), "a scraped series")
        denied = 'snowflake_admin_requests_denied_total{job="snowflake",reason="wrong_credentials"}'
        wait_until(lambda: prometheus.query(f"{denied} > 0"), "the wrong job's scrapes counted")
    except BaseException:
        print(f"prometheus log (end):\n{prometheus.log_tail()}\nserver log:\n{server.log()}")
        raise
    finally:
        prometheus.stop()
        assert server.stop() == 0
