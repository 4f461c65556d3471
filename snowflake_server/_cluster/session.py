"""The session timeout ZooKeeper granted, which the session gate must use.

ZooKeeper clamps the timeout a client asks for into its ``minSessionTimeout`` ..
``maxSessionTimeout`` (by default 2 and 20 ticks), and expires the session after the
*granted* one: a gate computed from the requested 10 s while the server granted 2 s
kept a node serving 8 s after its worker id could be leased elsewhere.

kazoo (2.11) reads the granted value from the connect reply and keeps it in a local
variable only, so :func:`watch_granted_timeout` wraps the client's connection
handshake to see the reply. That is a private method of kazoo's: the tests drive it
against a real ZooKeeper whose ``maxSessionTimeout`` is below the request, so a
kazoo that changes it fails them rather than the gate.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kazoo.protocol.serialization import Connect

__all__ = ["GrantedTimeout", "watch_granted_timeout"]

log = logging.getLogger(__name__)


class GrantedTimeout:
    """The session timeout granted to each session of one client, in seconds."""

    def __init__(self, requested_s: float) -> None:
        self.requested_s = requested_s
        self._lock = threading.Lock()
        self._session: int | None = None
        self._granted_s: float | None = None

    def record(self, session: int, granted_ms: int) -> None:
        """Called with each connect reply (kazoo's connection thread)."""
        granted_s = granted_ms / 1000
        with self._lock:
            changed = session != self._session or granted_s != self._granted_s
            self._session, self._granted_s = session, granted_s
        if changed and granted_s < self.requested_s:
            log.warning(
                "ZooKeeper granted a session timeout of %g s, not the %g s asked for "
                "(--zk-session-timeout; the server's maxSessionTimeout is lower): ids stop "
                "%g s after ZooKeeper last confirmed our registration",
                granted_s, self.requested_s, 0.9 * granted_s,
            )  # fmt: skip
        elif changed and granted_s > self.requested_s:
            log.warning(
                "ZooKeeper granted a session timeout of %g s, more than the %g s asked for "
                "(its minSessionTimeout is higher): sessions outlive --zk-session-timeout",
                granted_s, self.requested_s,
            )  # fmt: skip

    def for_session(self, session: int) -> float | None:
        """The timeout to count with for ``session``: the smaller of the requested and
        the granted one; None until that session's connect reply was seen."""
        with self._lock:
            if session != self._session or self._granted_s is None:
                return None
            return self._effective_s()

    @property
    def granted_s(self) -> float | None:
        """The latest session's granted timeout (None before the first)."""
        with self._lock:
            return self._granted_s

    @property
    def effective_s(self) -> float:
        """The timeout to count with: the requested one, or the latest session's
        granted one if lower."""
        with self._lock:
            return self._effective_s()

    def _effective_s(self) -> float:
        granted = self._granted_s
        return self.requested_s if granted is None else min(self.requested_s, granted)


def watch_granted_timeout(client: Any, requested_s: float) -> GrantedTimeout:
    """Record the timeout granted to every session ``client`` (a ``KazooClient``, not
    started yet) opens. ``TypeError`` if this kazoo has no handshake to watch."""
    granted = GrantedTimeout(requested_s)
    connection = getattr(client, "_connection", None)
    invoke = getattr(connection, "_invoke", None)
    if invoke is None:
        raise TypeError(
            f"cannot see the session timeout ZooKeeper grants with this kazoo ({client!r})"
        )

    def watched(timeout: float, request: Any, xid: int | None = None) -> Any:
        result = invoke(timeout, request, xid)
        if isinstance(request, Connect) and isinstance(result, tuple):
            reply = result[0]
            # Recorded before kazoo reports CONNECTED, so a heartbeat never meets a
            # session whose timeout is unknown; an expired session's reply says 0.
            if reply.time_out > 0:
                granted.record(reply.session_id, reply.time_out)
        return result

    connection._invoke = watched  # type: ignore[union-attr]
    return granted
