"""The lease of a worker id: an ephemeral znode ``nodes/<datacenter>/<worker>`` holding the
address of the node that registered it.

ZooKeeper gives a znode to one session: whoever creates it first holds the worker id
until it deletes the znode or its session ends. A static id is retried twice, 1 s
apart, as Twitter's server did (the holder may be our own ghost, a session of a
crashed run); ``--worker-id auto`` takes the lowest free id, the one held last first.
What the lease proves while serving is the session gate's business (``gate.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kazoo.exceptions import KazooException, NodeExistsError
from kazoo.handlers.threading import KazooTimeoutError

from .._errors import StartupDeferred, StartupRefused
from .zk import OP_TIMEOUT_S, describe_zk_error, session_id, zk_call

__all__ = ["Lease"]

log = logging.getLogger(__name__)

_GHOST_RETRIES = 2  # Twitter's: retry twice, 1 s apart; it may be our own ghost


class Lease:
    """Leases worker ids of ``datacenter_id`` under ``nodes`` (the znode of the
    datacenter's registrations) for ``address``.

    ``client`` returns the current ZooKeeper client (cluster mode may replace it);
    every call ends within ``wait_s`` (``--zk-connect-timeout``). ``sleep`` waits
    between the tries of a held static id, and ``interrupted(doing)`` raises
    ``StartupInterrupted`` once a stop was asked.
    """

    def __init__(
        self,
        client: Callable[[], Any],
        nodes: str,
        datacenter_id: int,
        address: str,
        wait_s: float,
        *,
        sleep: Callable[[float], object],
        interrupted: Callable[[str], None],
    ) -> None:
        self._client = client
        self._nodes = nodes
        self._dc = datacenter_id
        self._address = address
        self._wait = wait_s
        self._sleep = sleep
        self._interrupted = interrupted

    def node(self, worker_id: int) -> str:
        """The registration znode of ``worker_id``."""
        return f"{self._nodes}/{worker_id}"

    def take(
        self,
        static: int | None,
        max_worker_id: int,
        *,
        preferred: int | None = None,
        patient: bool = True,
        skipped: frozenset[int] = frozenset(),
    ) -> int:
        """Register ``static`` (retried twice, 1 s apart, if ``patient``), or with None
        the lowest free id up to ``max_worker_id`` but ``skipped``, ``preferred`` first.
        ``StartupDeferred`` if none can be had: a held id may be freed when its session
        expires."""
        self._call(f"creating {self._nodes}", "ensure_path", self._nodes)
        if static is not None:
            path = self.node(static)
            for attempt in range(_GHOST_RETRIES + 1 if patient else 1):
                if self._take(path):
                    return static
                if attempt < _GHOST_RETRIES and patient:
                    self._sleep(1.0)
                    self._interrupted(f"retrying the held worker id {static}")
            # Deferred (exit 75), not refused: the holder may be a node that just crashed,
            # whose registration lasts until its session expires; a replacement started at
            # once is restarted by its supervisor until then. A genuine duplicate is
            # refused at every try and nothing is written meanwhile: the loop is harmless,
            # and its log names the holder each time.
            raise StartupDeferred(
                f"worker id {static} of datacenter {self._dc} is registered by "
                f"{self.holder(path)} ({path}); two nodes with one worker id would hand out "
                "the same ids: if that node just stopped, a later start passes once its "
                "session expires; otherwise stop it or use another --worker-id (or auto)"
            )
        order = [w for w in range(max_worker_id + 1) if w not in skipped]
        if preferred is not None and preferred in order:  # the id we had, if still free
            order.remove(preferred)
            order.insert(0, preferred)
        for worker_id in order:
            if self._take(self.node(worker_id)):
                return worker_id
        also = f", {len(skipped)} of them skipped for their marks" if skipped else ""
        # Not a danger, and it may pass: a crashed node's id is freed when its session
        # expires (75: try again).
        raise StartupDeferred(
            f"all {max_worker_id + 1} worker ids of datacenter {self._dc} are leased "
            f"({self._nodes}{also}); widen --worker-id-bits or use another datacenter id"
        )

    def owned(self, path: str, doing: str) -> bool:
        """Whether ``path`` exists and is an ephemeral znode of our session."""
        stat = self._call(f"reading {path}", "exists", path)
        ours = session_id(self._client(), doing)
        return stat is not None and stat.ephemeralOwner == ours

    def holder(self, path: str) -> str:
        """The address registered at ``path``, or ``another node`` if it cannot be read."""
        try:
            data, _ = self._call(f"reading {path}", "get", path)
            return str(data.decode(errors="replace"))
        except (KazooException, StartupRefused, StartupDeferred):
            return "another node"

    def release(self, path: str) -> None:
        """Delete our registration ``path``; if ZooKeeper does not answer, it expires with
        the session (logged)."""
        try:
            self._client().delete_async(path).get(timeout=OP_TIMEOUT_S)
        except (KazooException, KazooTimeoutError) as e:
            log.warning(
                "could not delete %s: %s (it expires with the session)", path,
                describe_zk_error(e),
            )  # fmt: skip

    def _take(self, path: str) -> bool:
        """Create our ephemeral registration at ``path``; False if another session holds it.

        Retried through a dropped connection; a create whose reply was lost finds our
        own node on the retry, which counts as taken.
        """
        try:
            self._call(f"registering {path}", "create", path, self._address.encode(),
                       ephemeral=True)  # fmt: skip
            return True
        except NodeExistsError:
            return self.owned(path, f"registering {path}")

    def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return zk_call(self._client(), self._wait, what, method, *args, **kwargs)
