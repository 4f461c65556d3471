"""A worker id's high-water mark in ZooKeeper (``marks/<datacenter>/<worker>``), the
cluster's layout beside it.

A mark is stored as JSON, ``{"mark_ms": N, "layout": {...}}``: a mark only guards
the ids of the layout it was made under. A plain number (0.1.0 wrote those) is a
mark of the layout in use. A layout with a clock sequence adds the mark of each
value and the value in use: ``"marks_ms": [...], "clock_sequence": N``, ``mark_ms``
being the newest of the marks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kazoo.exceptions import (
    BadVersionError,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
)
from kazoo.handlers.threading import KazooTimeoutError
from snowflake_thrift_client import Layout

from .._errors import ReservationError, StartupRefused
from .._ids.layouts import describe_layout, layout_from_json, layout_to_json
from .._state.reservation import MarkStore, valid_marks
from .zk import OP_TIMEOUT_S, session_id, zk_call

__all__ = [
    "ZK_MARK_AHEAD_MS",
    "MarkOfAnotherLayout",
    "ZkMarkStore",
    "mark_layout",
    "restore_marks",
]

log = logging.getLogger(__name__)

ZK_MARK_AHEAD_MS = 2000
"""How far ahead of the clock the mark in ZooKeeper is reserved (rounded up to whole
seconds, so it is written about once a second)."""
_RESTORE_TRIES = 5  # reads and conditional writes of a mark other nodes keep moving


class MarkOfAnotherLayout(StartupRefused):
    """The mark was recorded under another layout: it does not guard our ids.

    ``epoch_only``: the layouts differ in the epoch alone (the same field widths), so
    the other layout's ids of this worker id cannot collide with ours of another
    worker id; with other widths they can, whatever worker id we take.
    """

    def __init__(self, message: str, *, epoch_only: bool) -> None:
        super().__init__(message)
        self.epoch_only = epoch_only


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
        layout: Layout | None = None,
        marks: tuple[tuple[int, ...], int] | None = None,
    ) -> None:
        layout = layout or Layout()
        by_value, value = marks or ((mark_ms, *[-1] * layout.max_clock_sequence), 0)
        super().__init__(mark_ms, by_value, value)
        self._client = client
        self._path = path
        self._version = version  # None: the znode does not exist yet
        self._session = session
        self._on_lost = on_lost
        self._layout = layout_to_json(layout)

    @classmethod
    def load(
        cls,
        client: Callable[[], Any],
        path: str,
        on_lost: Callable[[str], None],
        layout: Layout | None = None,
        timeout_s: float = OP_TIMEOUT_S,
    ) -> ZkMarkStore:
        """The store of ``path`` with the mark found there (-1 if none), bound to the
        session that holds the registration now. ``client`` returns the current
        ZooKeeper client (cluster mode may replace it). A mark recorded under a
        layout other than ``layout`` (the default one if None) raises
        ``MarkOfAnotherLayout``; ``timeout_s`` bounds the read."""
        ours = layout or Layout()
        zk = client()
        session = session_id(zk, f"loading the high-water mark {path}")
        try:
            data, stat = zk_call(zk, timeout_s, f"loading the high-water mark {path}", "get", path)
            marks, version = _parse_mark(path, data, ours), stat.version
        except NoNodeError:
            marks, version = ((-1,) * (ours.max_clock_sequence + 1), 0), None
        return cls(client, path, max(marks[0]), version, session, on_lost, ours, marks)

    @property
    def where(self) -> str:
        return f"zookeeper:{self._path}"

    def _target(self, mark_ms: int) -> int:
        return -(-mark_ms // 1000) * 1000  # whole seconds: about one write a second

    def _store(self, marks: tuple[int, ...], clock_sequence: int) -> None:
        zk = self._client()
        data = _encode(marks, clock_sequence, self._layout)
        if zk is None:
            raise ReservationError(f"not writing {self._path}: no ZooKeeper client")
        owner = zk.client_id
        if owner is None:  # kazoo has no client_id while disconnected; the session may live
            raise ReservationError(
                f"not writing {self._path}: disconnected from ZooKeeper ({zk.client_state}); "
                "the session that registered this worker id may still be alive"
            )
        if owner[0] != self._session:
            raise ReservationError(
                f"not writing {self._path}: the ZooKeeper session that registered this worker "
                f"id (0x{self._session:x}) is gone; this client's session is 0x{owner[0]:x}"
            )
        try:
            if self._version is not None:
                try:
                    stat = zk.set_async(self._path, data, version=self._version).get(
                        timeout=OP_TIMEOUT_S
                    )
                    self._version = stat.version
                    return
                except NoNodeError:
                    # Gone while our registration stands (ZooKeeper lost it, or a hand
                    # deleted it): put it back. A create fails if another node did first.
                    log.warning("the high-water mark %s is gone: writing it again", self._path)
            zk.ensure_path_async(self._path.rsplit("/", 1)[0]).get(timeout=OP_TIMEOUT_S)
            zk.create_async(self._path, data).get(timeout=OP_TIMEOUT_S)
            self._version = 0
        except KazooTimeoutError:
            raise ReservationError(
                f"writing {self._path}: no reply from ZooKeeper within {OP_TIMEOUT_S:g} s"
            ) from None
        except NoAuthError:
            # Locked by the service's ACL (snowflake zk-acl) while this node has no
            # credentials: it stops at its reserved ceiling; nobody else took the id.
            raise ReservationError(
                f"ZooKeeper refused this node's write of {self._path}: its ACL does not let "
                "this node in (start it with the service's credentials: --zk-auth, "
                "--zk-credentials-file)"
            ) from None
        except (BadVersionError, NodeExistsError):
            self._on_lost(f"{self._path} was changed by another node")
            raise ReservationError(
                f"{self._path} was changed by another node: this node no longer owns the worker id"
            ) from None


def restore_marks(
    client: Any,
    path: str,
    marks: tuple[int, ...],
    clock_sequence: int,
    layout: Layout,
    timeout_s: float = OP_TIMEOUT_S,
) -> bool:
    """Put ``marks`` (a worker id's marks, one per clock-sequence value) into ``path``
    where ZooKeeper holds none or lower ones: a node that held the id puts back what a
    ZooKeeper that lost its data forgot. Never lowers a mark; keeps the value in use
    that is recorded. True if it wrote. A mark of another layout is left alone.

    Whoever holds the id now finds its next conditional write refused and stops,
    then registers again under the higher mark: a duplicate it might have made is
    worse than the interruption.
    """
    layout_json = layout_to_json(layout)
    for _ in range(_RESTORE_TRIES):
        try:
            found, stat = zk_call(client, timeout_s, f"reading {path}", "get", path)
        except NoNodeError:
            if max(marks) < 0:
                return False
            try:
                zk_call(client, timeout_s, f"restoring {path}", "create", path,
                        _encode(marks, clock_sequence, layout_json), makepath=True)  # fmt: skip
                return True
            except NodeExistsError:
                continue  # created meanwhile (perhaps by our own lost reply): merge with it
        try:
            recorded, in_use = _parse_mark(path, found, layout)
        except MarkOfAnotherLayout:
            return False
        merged = tuple(max(a, b) for a, b in zip(recorded, marks, strict=True))
        if merged == recorded:
            return False
        try:
            zk_call(client, timeout_s, f"restoring {path}", "set", path,
                    _encode(merged, in_use, layout_json), version=stat.version)  # fmt: skip
            return True
        except (BadVersionError, NoNodeError):
            continue
    raise StartupRefused(f"{path} kept changing while its high-water mark was put back")


def mark_layout(data: bytes) -> Layout | None:
    """The layout a mark's record names; None for a record that names none (0.1.0's
    plain numbers) or is not a mark (its own load refuses it, with the reason)."""
    try:
        value = json.loads(data.decode())
        return layout_from_json(value["layout"]) if isinstance(value, dict) else None
    except (ValueError, UnicodeDecodeError, KeyError):
        return None


def _encode(marks: tuple[int, ...], clock_sequence: int, layout: dict[str, int]) -> bytes:
    """The JSON record of ``marks`` (see the module docstring)."""
    record: dict[str, object] = {"mark_ms": max(marks), "layout": layout}
    if len(marks) > 1:
        record.update(marks_ms=list(marks), clock_sequence=clock_sequence)
    return json.dumps(record).encode()


def _parse_mark(path: str, data: bytes, ours: Layout) -> tuple[tuple[int, ...], int]:
    """The marks in ``data`` (one per clock-sequence value) and the value in use: JSON
    with its layout, or a plain number (0.1.0's)."""
    try:
        value = json.loads(data.decode())
        if isinstance(value, int) and not isinstance(value, bool):
            # 0.1.0 recorded no layout: a mark of the one in use (which had no clock sequence)
            return (value, *[-1] * ours.max_clock_sequence), 0
        if not isinstance(value, dict) or set(value) not in (
            {"mark_ms", "layout"},
            {"mark_ms", "layout", "marks_ms", "clock_sequence"},
        ):
            raise ValueError(f"neither a number nor a mark with its layout: {value!r}")
        mark = value["mark_ms"]
        if not isinstance(mark, int) or isinstance(mark, bool):
            raise ValueError(f"mark_ms is not a number: {mark!r}")
        by_value, in_use = value.get("marks_ms", [mark]), value.get("clock_sequence", 0)
        if not valid_marks(by_value, in_use, mark):
            raise ValueError(f"bad clock-sequence marks {by_value!r} (in use: {in_use!r})")
        recorded = layout_from_json(value["layout"])
    except (ValueError, UnicodeDecodeError) as e:
        raise StartupRefused(
            f"the high-water mark in ZooKeeper {path} is not a number ({e}); it guards "
            "against repeating ids of a recycled worker id: repair it by hand"
        ) from None
    if recorded != ours:
        raise MarkOfAnotherLayout(
            f"the high-water mark {path} was recorded under another layout "
            f"({describe_layout(recorded)}) than ours ({describe_layout(ours)}); ids of one "
            "worker id under two layouts can collide: use the layout the cluster was "
            "started with (--epoch and the --*-bits flags)",
            epoch_only=replace(recorded, epoch_ms=ours.epoch_ms) == ours,
        )
    if len(by_value) != ours.max_clock_sequence + 1:
        raise StartupRefused(
            f"the high-water mark in ZooKeeper {path} holds {len(by_value)} clock-sequence "
            f"marks for a layout with {ours.max_clock_sequence + 1}: repair it by hand"
        )
    return tuple(by_value), in_use
