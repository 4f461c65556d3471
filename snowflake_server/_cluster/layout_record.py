"""The cluster's layout record: the znode ``<zk-path>/layout``, which must be the layout
of every node and of every mark (each mark records the layout its ids were made with).

A node of another layout is refused at start, ``--skip-sanity-checks`` or not, and
again right before its first mark is written, after its start-up waits (the record may
have changed meanwhile): nothing is written by a refused node. A first start writes no
record before that confirmation; there a missing record is recorded from the marks (a
node refuses to start if they disagree among themselves), and from the newcomer's
layout only when there is no mark at all. Running nodes read the record at each
supervision tick (one read, which needs no watch to survive reconnections and expired
sessions): one that differs from the node's layout holds its ids (``/readyz`` says
why) until the record has been its layout again for 0.9 x session timeout; a deleted
one is recorded again as the node last read it (its own layout, or for a stopped node
the record that stopped it), by a node registering again too (never from the marks);
one that cannot be read, or is not a layout, changes nothing (logged), and a node
registering again waits for it.

:class:`LayoutRecord` says why ids must be held (:attr:`~LayoutRecord.hold`) and never
touches the session gate: ``membership.Cluster`` applies it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import Any

from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from snowflake_thrift_client import Layout

from .._errors import StartupDeferred, StartupRefused
from .._ids.layouts import describe_layout, layout_from_record, layout_to_record
from .zk import ZooKeeperSilent, children, describe_zk_error, numeric_order, zk_call
from .zkmarks import mark_layout

__all__ = ["LayoutRecord", "Stage", "parse_record"]

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    """When the record is read: each stage answers a record that is not ours its own way."""

    FIRST_START = "first start"
    """Refused (``StartupRefused``); a missing record is made before the first mark."""
    AGAIN = "registering again"
    """Refused, and held; an unreadable record defers the registration."""
    SERVING = "serving"
    """Held (``/readyz`` says why), never raised."""


def parse_record(path: str, data: bytes) -> Layout:
    """The layout recorded in the layout znode ``path``; ``StartupRefused`` if it is none."""
    try:
        return layout_from_record(data)
    except ValueError as e:
        raise StartupRefused(
            f"the cluster's layout in ZooKeeper {path} is not a layout ({e}); repair it by hand"
        ) from None


def _unanswered(error: BaseException, bound_s: float) -> str:
    """Why a ZooKeeper call given ``bound_s`` failed, in words."""
    if isinstance(error, ZooKeeperSilent):
        return f"ZooKeeper did not answer within {bound_s:g} s"
    return describe_zk_error(error)


class LayoutRecord:
    """This node's view of the cluster's layout record under ``zk_path``.

    ``client`` returns the current ZooKeeper client; calls end within ``wait_s``
    (``--zk-connect-timeout``) unless given less. ``clock`` is the session gate's
    (seconds) and ``session_timeout`` the timeout it counts with: a node held for its
    layout serves again only once its own layout has been read for 0.9 x that.
    """

    def __init__(
        self,
        client: Callable[[], Any],
        zk_path: str,
        layout: Layout,
        wait_s: float,
        *,
        clock: Callable[[], float],
        session_timeout: Callable[[], float],
    ) -> None:
        self._client = client
        self.path = f"{zk_path}/layout"
        self._marks_root = f"{zk_path}/marks"
        self._layout = layout
        self._wait = wait_s
        self._clock = clock
        self._session_timeout = session_timeout
        # Why this node stopped handing out ids: its layout is not the recorded one.
        self._stop: str | None = None
        # When a stopped node first read its own layout again (see _serve).
        self._settle_from: float | None = None
        self._hold: str | None = None
        self.last: Layout | None = None
        """The record this node read last (None: none yet)."""
        self._problem: str | None = None  # why the record was not read, logged once

    @property
    def hold(self) -> str | None:
        """Why ids must be held now (the record is another layout's, or was ours again
        for too short a time), or None."""
        return self._hold

    def check(self, stage: Stage, bound_s: float | None = None) -> None:
        """Read the record (within ``bound_s``, default ``--zk-connect-timeout``) and apply it.

        Ours: fine (a node held for its layout serves again after a settle time). Another:
        ``StartupRefused`` before serving, held once registered, both when registering
        again. Missing: nothing is written at a first start (:meth:`confirm` records it
        right before the first mark); otherwise it is recorded again as this node last
        read it. Unreadable, or not a layout: a first start is refused or deferred, a
        node registering again is deferred (it leases nothing it cannot check), a
        serving or held node stays as it is (logged once)."""
        bound = self._wait if bound_s is None else bound_s
        path = self.path
        try:
            data, _ = self._call(f"reading the layout in {path}", "get", path, timeout_s=bound)
            recorded = parse_record(path, data)
        except NoNodeError:
            if stage is not Stage.FIRST_START:
                self._record_again(bound)
            return
        except (ZooKeeperSilent, KazooException, KazooTimeoutError, StartupRefused) as e:
            if stage is Stage.FIRST_START:
                raise
            why = str(e) if isinstance(e, StartupRefused) else _unanswered(e, bound)
            self._unread(why)
            if stage is Stage.AGAIN:
                raise StartupDeferred(
                    f"the cluster's layout in {path} was not checked: {why}; not registering "
                    "again until it is"
                ) from None
            return
        self._problem = None
        self.last = recorded
        if recorded == self._layout:
            self._serve()
            return
        self._stop_for(recorded, stage)
        if stage is not Stage.SERVING:
            raise self._insanity(recorded, path)

    def confirm(self, stage: Stage) -> None:
        """Right before the first mark of a worker opened (every start-up wait over): the
        record must be this node's layout, or ``StartupRefused`` and nothing is written.
        A missing one is recorded (create-only) first: at a first start from the marks,
        when registering again as this node last read it (never from the marks: its own
        mark, put back, would name its layout); one that cannot be read defers."""
        path = self.path
        try:
            data, _ = self._call(f"reading the layout in {path}", "get", path)
        except NoNodeError:
            if stage is Stage.FIRST_START:
                theirs, where = self._record_from_marks(), f"{path}, recorded from its marks"
            else:
                self._record_again(self._wait)
                try:
                    data, _ = self._call(f"reading the layout in {path}", "get", path)
                except NoNodeError:
                    raise StartupDeferred(
                        f"the cluster's layout znode {path} is missing and this node read no "
                        "record to write back; not registering again until it is recorded"
                    ) from None
                theirs, where = parse_record(path, data), path
        else:
            theirs, where = parse_record(path, data), path
        self.last = theirs
        if theirs != self._layout:
            self._stop_for(theirs, stage)
            raise self._insanity(theirs, where)

    # -- holding and serving ----------------------------------------------------

    def _stop_for(self, recorded: Layout, stage: Stage) -> None:
        """Hold the ids: the recorded layout is not this node's."""
        reason = (
            f"this node's layout ({describe_layout(self._layout)}) is not the cluster's, "
            f"recorded in {self.path} ({describe_layout(recorded)}); two layouts in "
            "one cluster hand out the same ids"
        )
        if self._stop is None and stage is Stage.SERVING:
            log.error(
                "stopped handing out ids: %s; if the record is wrong, write the cluster's "
                "layout back (this node's: zkCli.sh set %s '%s')", reason, self.path,
                layout_to_record(self._layout).decode(),
            )  # fmt: skip
        self._stop = reason
        self._settle_from = None
        self._hold = reason

    def _serve(self) -> None:
        """The record is this node's layout: serve, but a node held for its layout only
        once its own layout has been read for ``0.9 x session timeout``.

        Why wait: the record was just changed back to this node's layout, from one of
        another layout whose nodes may still serve (their ticks may be late); each of
        them stops at its next read of the record, and at the latest when its gate
        closes, 0.9 x session timeout after its last heartbeat, which it sent before
        this read. Past that time after the first matching read, none of them serves,
        whatever their ticks did; serving at once could overlap with them."""
        if self._stop is None:
            return
        now = self._clock()
        if self._settle_from is None:
            self._settle_from = now
        settle = 0.9 * self._session_timeout()
        if now - self._settle_from < settle:
            self._hold = (
                f"the cluster's layout in {self.path} is this node's again; serving "
                f"{settle:g} s after it was first read so, once the nodes of the other "
                "layout have stopped"
            )
            return
        log.warning("the cluster's layout in %s is this node's again: serving", self.path)
        self._stop = None
        self._settle_from = None
        self._hold = None

    def _unread(self, why: str) -> None:
        if why != self._problem:
            state = "stopped" if self._stop is not None else "as it was"
            log.warning(
                "the cluster's layout in %s was not checked: %s; this node stays %s and "
                "reads it again at each tick", self.path, why, state,
            )  # fmt: skip
        self._problem = why

    def _insanity(self, theirs: Layout, where: str) -> StartupRefused:
        return StartupRefused(
            f"Layout insanity: this node would make ids with {describe_layout(self._layout)}, "
            f"but the cluster ({where}) makes them with {describe_layout(theirs)}; two layouts "
            "in one cluster hand out the same ids: start with the cluster's --epoch and --*-bits"
        )

    # -- recording --------------------------------------------------------------

    def _record_again(self, bound: float) -> None:
        """The layout znode is gone: record again the layout this node read there last
        (never over one recorded meanwhile).

        For a serving node that is its own; for a node held for its layout it is the
        record that held it, so that its own write never lets it serve again (nor
        stops the nodes of that layout). Its state is left to the next read."""
        path, record = self.path, self.last
        if record is None:
            return  # nothing read yet: nothing this node could vouch for
        try:
            self._call(
                f"recording the layout in {path} again", "create", path, layout_to_record(record),
                timeout_s=bound,
            )  # fmt: skip
        except NodeExistsError:
            return  # recorded by another node meanwhile: read at the next tick
        except (ZooKeeperSilent, KazooException, KazooTimeoutError) as e:
            self._unread(f"it is gone, and recording it again failed: {_unanswered(e, bound)}")
            return
        stays = "" if self._stop is None else " (not this node's: it stays stopped)"
        log.warning(
            "the cluster's layout znode %s was gone: recorded it again as this node last "
            "read it, %s%s", path, describe_layout(record), stays,
        )  # fmt: skip

    def _record_from_marks(self) -> Layout:
        """Record the cluster's layout where its znode is missing at a first start's
        confirmation: the layout of the marks (the ids handed out so far were made with
        it), or ours if there is no mark anywhere; the record found if another node
        recorded one first. ``StartupRefused`` if the marks disagree among themselves."""
        path = self.path
        found = self.marks_layouts()
        if len(found) > 1:
            which = "; ".join(
                f"{describe_layout(layout)}: {', '.join(paths)}" for layout, paths in found.items()
            )
            raise StartupRefused(
                f"the cluster's layout znode {path} is missing and the high-water marks were "
                f"made under {len(found)} layouts ({which}); two layouts in one cluster hand "
                f"out the same ids: repair it by hand (record the cluster's layout in {path})"
            )
        layout = next(iter(found), self._layout)
        try:
            self._call(
                f"recording the layout in {path}", "create", path, layout_to_record(layout),
                makepath=True,
            )  # fmt: skip
        except NodeExistsError:  # recorded by another node meanwhile: that one counts
            data, _ = self._call(f"reading the layout in {path}", "get", path)
            return parse_record(path, data)
        source = "its high-water marks" if found else "this node, its first"
        log.info(
            "recorded the cluster's layout in %s from %s: %s", path, source,
            describe_layout(layout),
        )  # fmt: skip
        return layout

    def marks_layouts(self) -> dict[Layout, list[str]]:
        """The layouts the marks under ``marks/`` were made with, and which marks; read
        within ``--zk-connect-timeout`` (``ZooKeeperSilent`` otherwise).

        The marks are read all at once, not one after another: a cluster may hold
        thousands, and one read waits a round trip."""
        root, client = self._marks_root, self._client()
        what = f"reading the high-water marks under {root}"
        deadline = time.monotonic() + self._wait

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        dcs = children(client, root, f"listing the high-water marks in {root}", self._wait)
        listings = [(dc, client.get_children_async(f"{root}/{dc}")) for dc in dcs]
        reads: list[tuple[str, Any]] = []
        for dc, listing in listings:
            try:
                names = listing.get(timeout=left())
            except NoNodeError:
                continue
            except KazooTimeoutError:
                raise ZooKeeperSilent(what, self._wait) from None
            reads += [
                (f"marks/{dc}/{worker}", client.get_async(f"{root}/{dc}/{worker}"))
                for worker in numeric_order(names)
            ]
        found: dict[Layout, list[str]] = {}
        for name, read in reads:
            try:
                data, _ = read.get(timeout=left())
            except NoNodeError:
                continue
            except KazooTimeoutError:
                raise ZooKeeperSilent(what, self._wait) from None
            layout = mark_layout(data)
            if layout is not None:
                found.setdefault(layout, []).append(name)
        return found

    def _call(
        self, what: str, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> Any:
        bound = self._wait if timeout_s is None else timeout_s
        return zk_call(self._client(), bound, what, method, *args, **kwargs)
