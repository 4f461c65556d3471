"""The host-wide lock of one (datacenter, worker): one server per worker id per host.

The state file's lock lives in the state directory, so two servers given
different ``--state-dir`` (another user, another ``$HOME`` or
``$XDG_STATE_HOME``) never see each other's lock and both hand out the same
ids. This lock does not depend on any directory: it is a Unix socket bound
in Linux's abstract namespace. The name is shared by every user of the
host, needs no file or permission, and the kernel frees it when its holder
exits, however it exits (nothing stale is left behind after a crash).

What it covers: one network namespace, which is the host, or one container
or pod with its own network. Two containers with their own network
namespaces, or two hosts, do not see each other's lock: keeping their worker
ids apart is ZooKeeper's job (cluster mode) or the operator's.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import socket

from .._errors import StartupRefused

__all__ = ["HostLock", "lock_name"]

_MAX_SCOPE = 48  # bytes; a longer scope is hashed so that the name fits sun_path (108)


def lock_name(scope: str, datacenter_id: int, worker_id: int) -> str:
    """The abstract socket name (without its leading NUL) of one worker's lock."""
    if len(scope.encode()) > _MAX_SCOPE:
        scope = "sha256-" + hashlib.sha256(scope.encode()).hexdigest()[:32]
    return f"snowflake-worker/{scope}/{datacenter_id}/{worker_id}"


class HostLock:
    """Held from :meth:`acquire` until :meth:`release` (or until the process ends)."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self._sock = sock
        self.name = name

    @classmethod
    def acquire(cls, datacenter_id: int, worker_id: int, scope: str = "") -> HostLock:
        """Take the lock of ``(datacenter_id, worker_id)`` in ``scope`` on this host.

        Raises ``StartupRefused`` if another process (or this one) holds it.
        """
        name = lock_name(scope, datacenter_id, worker_id)
        # Bound, never listening: nobody can connect to it or send it anything.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + name)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise StartupRefused(
                    f"another process on this host is serving datacenter {datacenter_id}, "
                    f"worker {worker_id}, whatever its --state-dir (it holds the host lock "
                    f"@{name}); two servers with one worker id would hand out the same ids: "
                    "stop it, or give this server another --worker-id"
                ) from None
            raise StartupRefused(
                f"cannot take the host lock @{name} of datacenter {datacenter_id}, "
                f"worker {worker_id}: {e.strerror or e}"
            ) from None
        return cls(sock, name)

    def release(self) -> None:
        """Free the lock: another process may serve this worker now."""
        with contextlib.suppress(OSError):
            self._sock.close()
