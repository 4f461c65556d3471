"""A worker id's high-water mark in ZooKeeper (``marks/<datacenter>/<worker>``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from .._errors import ReservationError, StartupRefused
from .._state.reservation import MarkStore

__all__ = ["ZK_MARK_AHEAD_MS", "ZkMarkStore"]

ZK_MARK_AHEAD_MS = 2000
"""How far ahead of the clock the mark in ZooKeeper is reserved (rounded up to whole
seconds, so it is written about once a second)."""
_OP_TIMEOUT_S = 2.0


class ZkMarkStore(MarkStore):
    """A worker id's high-water mark in ZooKeeper: a mark store for the reservation.

    Every write is conditional. It is refused unless our ZooKeeper session is still
    the one that registered the worker id, and it names the znode version this
    store last saw (compare and set). So a node that lost its id (its session
    expired while it was frozen, the id re-leased elsewhere) can never move the
    new holder's mark, let alone lower it; its write fails and ``on_lost`` stops
    the node serving.
    """

    name = "zookeeper"

    def __init__(
        self,
        client: Callable[[], Any],
        path: str,
        mark_ms: int,
        version: int | None,
        session: int,
        on_lost: Callable[[str], None],
    ) -> None:
        super().__init__(mark_ms)
        self._client = client
        self._path = path
        self._version = version  # None: the znode does not exist yet
        self._session = session
        self._on_lost = on_lost

    @classmethod
    def load(
        cls, client: Callable[[], Any], path: str, on_lost: Callable[[str], None]
    ) -> ZkMarkStore:
        """The store of ``path`` with the mark found there (-1 if none), bound to the
        session that holds the registration now. ``client`` returns the current
        ZooKeeper client (cluster mode may replace it)."""
        zk = client()
        session = zk.client_id[0]
        try:
            data, stat = zk.retry(zk.get, path)
            mark, version = int(data.decode()), stat.version
        except NoNodeError:
            mark, version = -1, None
        except (ValueError, UnicodeDecodeError) as e:
            raise StartupRefused(
                f"the high-water mark in ZooKeeper {path} is not a number ({e}); it guards "
                "against repeating ids of a recycled worker id: repair it by hand"
            ) from None
        return cls(client, path, mark, version, session, on_lost)

    @property
    def where(self) -> str:
        return f"zookeeper:{self._path}"

    def _target(self, mark_ms: int) -> int:
        return -(-mark_ms // 1000) * 1000  # whole seconds: about one write a second

    def _store(self, mark_ms: int) -> None:
        zk = self._client()
        data = str(mark_ms).encode()
        owner = zk.client_id if zk is not None else None
        if owner is None or owner[0] != self._session:
            raise ReservationError(
                f"not writing {self._path}: the ZooKeeper session that registered this "
                "worker id is gone"
            )
        try:
            if self._version is None:
                zk.ensure_path(self._path.rsplit("/", 1)[0])
                zk.create_async(self._path, data).get(timeout=_OP_TIMEOUT_S)
                self._version = 0
            else:
                stat = zk.set_async(self._path, data, version=self._version).get(
                    timeout=_OP_TIMEOUT_S
                )
                self._version = stat.version
        except (BadVersionError, NodeExistsError):
            self._on_lost(f"{self._path} was changed by another node")
            raise ReservationError(
                f"{self._path} was changed by another node: this node no longer owns the worker id"
            ) from None
