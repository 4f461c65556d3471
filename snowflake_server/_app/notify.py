"""systemd's readiness protocol (``Type=notify``): ``READY=1`` once the node serves,
``STOPPING=1`` when it starts to drain, ``RELOADING=1`` around SIGHUP.

A few lines of standard library, rather than a dependency on libsystemd: one
datagram to the socket ``$NOTIFY_SOCKET`` names (``@`` at its start names an
abstract socket). Without the variable (not under systemd) nothing is sent.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping

__all__ = ["NOTIFY_SOCKET_ENV", "Notifier"]

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"

log = logging.getLogger(__name__)


class Notifier:
    """Sends state changes to the service manager named by ``environ`` (if any)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        path = environ.get(NOTIFY_SOCKET_ENV, "")
        self._address = "\0" + path[1:] if path.startswith("@") else path

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def ready(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={status}")

    def stopping(self, status: str) -> None:
        self._send(f"STOPPING=1\nSTATUS={status}")

    def reloading(self) -> None:
        # systemd >= 253 wants the time of the reload, to tell one from the next.
        self._send(
            f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
        )

    def reloaded(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={status}")

    def _send(self, message: str) -> None:
        if not self._address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message.encode(), self._address)
        except OSError as e:  # the manager went away: serving matters more than telling it
            log.warning("cannot notify the service manager at %s: %s", self._address, e)
