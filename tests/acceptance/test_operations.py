"""A server's life as an operator drives it: systemd's notifications, SIGHUP (TLS
files reloaded, audit trail and log file reopened), JSON logs, --version."""

from __future__ import annotations

import json
import re
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
import trustme

from snowflake_server import decompose
from snowflake_server._version import __version__
from tests.support.endpoints import tls_client
from tests.support.processes import ServerProcess, start_server
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow]


def fields(message: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in message.decode().splitlines())


def test_systemd_hears_ready_reloading_and_stopping(
    notify_socket: tuple[socket.socket, str],
) -> None:
    sock, path = notify_socket
    server = start_server("--drain-seconds", "1", env={"NOTIFY_SOCKET": path})
    try:
        ready = fields(sock.recv(4096))
        assert ready["READY"] == "1" and ready["STATUS"] == "serving datacenter 0 worker 0"
        server.process.send_signal(signal.SIGHUP)
        assert fields(sock.recv(4096))["RELOADING"] == "1"
        assert fields(sock.recv(4096))["READY"] == "1"
        server.process.send_signal(signal.SIGTERM)
        stopping = fields(sock.recv(4096))
        assert stopping == {"STOPPING": "1", "STATUS": "draining for 1 s"}
        assert server.process.wait(15) == 0
    finally:
        server.stop()


def test_the_supervisor_alone_talks_to_systemd(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    server = start_server("--processes", "2", env={"NOTIFY_SOCKET": path})
    try:
        assert fields(sock.recv(4096)) == {"READY": "1", "STATUS": "2 processes serving"}
        server.process.send_signal(signal.SIGTERM)
        assert fields(sock.recv(4096))["STOPPING"] == "1"
        assert server.process.wait(20) == 0
        sock.settimeout(0.1)
        with pytest.raises(TimeoutError):
            sock.recv(4096)  # nothing from the children
    finally:
        server.stop()


def tls_get_id(server: ServerProcess, trusted: trustme.CA) -> int:
    context = ssl.create_default_context()
    trusted.configure_trust(context)
    return int(tls_client(server, context).get_id("sighup"))


def test_sighup_reloads_the_tls_certificate_and_keeps_it_when_the_new_one_is_bad(
    tmp_path: Path,
) -> None:
    old_ca, new_ca = trustme.CA(), trustme.CA()
    pem = tmp_path / "server.pem"
    old_ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    server = start_server("--tls-cert", str(pem))
    try:
        assert tls_get_id(server, old_ca) > 0
        new_ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
        server.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "reloaded TLS certificate" in server.log(), "the reload")
        assert tls_get_id(server, new_ca) > 0
        with pytest.raises(ssl.SSLCertVerificationError):
            tls_get_id(server, old_ca)
        pem.write_text("not a certificate\n")
        server.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "keeping the TLS certificate in use" in server.log(), "the refusal")
        assert tls_get_id(server, new_ca) > 0, "a bad file keeps the certificate in use"
    finally:
        assert server.stop() == 0


def test_sighup_reopens_the_audit_trail_and_the_log_file(tmp_path: Path) -> None:
    audit, log = tmp_path / "audit.jsonl", tmp_path / "server.log"
    server = start_server("--audit-log", str(audit), "--log-file", str(log), "--log-format", "json")
    try:
        client = server.raw_client()
        before = client.get_ids("rotate", 5)
        wait_until(lambda: len(audit.read_text().splitlines()) == 5, "the first entries")
        audit.rename(tmp_path / "audit.jsonl.1")
        log.rename(tmp_path / "server.log.1")
        server.process.send_signal(signal.SIGHUP)
        wait_until(lambda: audit.exists() and log.exists(), "both files reopened")
        wait_until(lambda: "reopened the audit log" in log.read_text(), "the reopen logged")
        after = client.get_ids("rotate", 3)
        wait_until(lambda: len(audit.read_text().splitlines()) == 3, "entries in the new file")
    finally:
        assert server.stop() == 0
    old_entries = [
        json.loads(line) for line in (tmp_path / "audit.jsonl.1").read_text().splitlines()
    ]
    new_entries = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [int(e["id"]) for e in old_entries] == before
    assert [int(e["id"]) for e in new_entries] == after
    old_log = (tmp_path / "server.log.1").read_text().splitlines()
    new_log = log.read_text().splitlines()
    assert any("serving framed/binary" in json.loads(line)["message"] for line in old_log)
    assert any(json.loads(line)["message"] == "stopped" for line in new_log)
    for line in old_log + new_log:
        entry = json.loads(line)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"])
        assert {"time", "level", "logger", "message"} <= entry.keys()
    serving = next(json.loads(line) for line in old_log if "serving" in line)
    assert serving["worker_id"] == 0 and serving["thrift"] == f"127.0.0.1:{server.port}"
    assert decompose(after[0]).timestamp_ms >= decompose(before[-1]).timestamp_ms


NOTHING = (
    "SIGHUP: nothing to reload (no TLS certificate, ZooKeeper TLS, web configuration, "
    "audit log or log file configured)"
)
"""Written out, not imported: the test pins the words an operator reads."""


def sighup_lines(log: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in log.splitlines() if ": SIGHUP: " in line]


def test_sighup_with_nothing_configured_says_there_is_nothing_to_reload() -> None:
    """Before, such a SIGHUP logged nothing: the operator could not tell it was seen."""
    server = start_server()
    try:
        server.process.send_signal(signal.SIGHUP)
        wait_until(lambda: sighup_lines(server.log()), "the SIGHUP's line")
        assert sighup_lines(server.log()) == [NOTHING]
        assert server.raw_client().get_id("after") > 0
    finally:
        assert server.stop() == 0


def test_sighup_names_what_it_reloads_first(tmp_path: Path) -> None:
    """One line, before the steps' own, names every step that applies: here the log
    file (the line is in the new file), the API's certificate and the audit log."""
    ca, pem = trustme.CA(), tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    log = tmp_path / "server.log"
    args = ("--tls-cert", str(pem), "--audit-log", str(tmp_path / "audit.jsonl"))
    server = start_server(*args, "--log-file", str(log))
    try:
        log.rename(tmp_path / "server.log.1")
        server.process.send_signal(signal.SIGHUP)
        wait_until(lambda: log.exists() and "reopened the audit log" in log.read_text(), "the end")
        assert sighup_lines(log.read_text())[:1] == [
            "SIGHUP: reloading the log file, the API's TLS certificate and the audit log"
        ]
    finally:
        assert server.stop() == 0


def test_the_supervisor_says_it_passed_sighup_on_and_each_process_says_its_own() -> None:
    server = start_server("--processes", "2")
    try:
        server.process.send_signal(signal.SIGHUP)
        wait_until(lambda: len(sighup_lines(server.log())) == 3, "three SIGHUP lines")
        supervisor = (
            "SIGHUP: nothing to reload in the supervisor (no log file or web configuration "
            "configured); passed SIGHUP on to 2 processes"
        )
        assert sorted(sighup_lines(server.log())) == sorted([supervisor, NOTHING, NOTHING])
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("command", ["snowflake-server", "snowflake"])
def test_both_commands_say_their_version(command: str) -> None:
    script = Path(sys.executable).parent / command
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    assert result.stdout == f"{command} {__version__}\n"
