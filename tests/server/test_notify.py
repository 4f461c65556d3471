"""systemd's notify protocol, received on a socket the test provides."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest

from snowflake_server._app.notify import Notifier


def test_ready_stopping_and_reloading_arrive(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    notifier.ready("serving")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"
    notifier.reloading()
    fields = dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())
    assert fields["RELOADING"] == "1" and int(fields["MONOTONIC_USEC"]) > 0
    notifier.reloaded("serving")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"
    notifier.stopping("draining")
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"


def test_an_abstract_socket_is_named_with_an_at() -> None:
    name = f"snowflake-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        Notifier({"NOTIFY_SOCKET": "@" + name}).ready("serving")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_nothing_is_sent_outside_systemd() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    notifier.ready("serving")  # no socket, no error


def test_a_vanished_manager_is_logged_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}).stopping("draining")
    assert "cannot notify the service manager" in caplog.text
