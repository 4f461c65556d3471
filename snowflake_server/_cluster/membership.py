"""Cluster mode: worker ids registered and leased in ZooKeeper.

Znodes under ``--zk-path`` (``/snowflake-servers`` by default)::

    layout                        persistent, the cluster's layout (JSON): see below
    nodes/<datacenter>/<worker>   ephemeral, "host:port" of the node holding that worker id
    marks/<datacenter>/<worker>   persistent, the worker id's high-water mark in ms and its layout

A node checks its registered peers (ids, clock and layout; Twitter's server
checked the first two), checks its layout against the cluster's, then registers
(a static id, or the lowest free one with ``--worker-id auto``), honours the
id's high-water mark from ZooKeeper as well as from its own disk (so an id
recycled from a dead host never repeats a timestamp), and serves. It hands out
ids only while its ephemeral node is certainly its own: a heartbeat proves the
node is still there and owned by our session, and ids stop ``0.9 x session
timeout`` after the last proof, whatever the session state says; the timeout is
the one ZooKeeper granted if lower than ``--zk-session-timeout`` (``session``).
After a lost session, or a node gone, it puts the marks of the id it held back
into ZooKeeper first (a ZooKeeper that lost its data lost them too), then
registers again (same id if free, otherwise another, with that id's mark); a
client stuck in SUSPENDED (a ZooKeeper that came back empty) is replaced by a
new one. Every ZooKeeper call of a registration ends within
``--zk-connect-timeout``, so a ZooKeeper that vanishes during start-up defers
it (``StartupDeferred``, exit 75) in about that time.

The layout znode is the cluster's layout, and it must be the layout of the
marks (each mark records the layout its ids were made with). A node of another
layout is refused at start, ``--skip-sanity-checks`` or not, and again right
before its first mark is written, after its start-up waits (the record may have
changed meanwhile): nothing is written by a refused node. A first start writes
no record before that confirmation; there a missing record is recorded from the
marks (a node refuses to start if they disagree among themselves), and from the
newcomer's layout only when there is no mark at all. Running nodes read the
record at each supervision tick (one read, which needs no watch to survive
reconnections and expired sessions): one that differs from the node's layout
stops it handing out ids (``/readyz`` says why) until the record has been its
layout again for 0.9 x session timeout; a deleted one is recorded again as the
node last read it (its own layout, or for a stopped node the record that stopped
it), by a node registering again too (never from the marks); one that cannot be
read, or is not a layout, changes nothing (logged), and a node registering again
waits for it.

A worker id without a mark in ZooKeeper is either new or was used before
ZooKeeper lost its data, perhaps by a node whose clock is ahead of ours. So the
node waits ``--first-start-wait`` (by default the session timeout plus
``--max-peer-skew``) before reading the mark again: in that time a node that held
the id has put its mark back or, gone for good, stamped its last id more than
the allowed skew ago. With ``--worker-id auto`` an id whose mark is further
ahead of our clock than ``--max-startup-wait`` (a node whose clock jumped
forward used it) is skipped, and counted, rather than refusing to start.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from snowflake_thrift_client import Layout

from .._config.settings import ClusterSettings
from .._errors import (
    ClockBehindMark,
    ReservationError,
    StartupDeferred,
    StartupInterrupted,
    StartupRefused,
)
from .._ids.clocks import boot_clock
from .._ids.layouts import describe_layout, layout_from_json, layout_to_json
from .._observability.metrics import counter_by
from .._state.reservation import MarkStore
from .._state.worker import Worker, WorkerSlot
from .peers import check_peers, children, numeric_order
from .session import GrantedTimeout, watch_granted_timeout
from .zkmarks import (
    ZK_MARK_AHEAD_MS,
    MarkOfAnotherLayout,
    ZkMarkStore,
    ZooKeeperSilent,
    describe_zk_error,
    mark_layout,
    restore_marks,
    session_id,
    zk_call,
)

__all__ = ["Cluster", "OpenWorker", "advertised_address"]

log = logging.getLogger(__name__)


class OpenWorker(Protocol):
    """Opens the worker of a leased id, honouring the id's mark in ZooKeeper (the
    store and its margin); the seconds waited for a worker id with no mark in
    ZooKeeper (None: it has one); ``before_first_write`` is called after every wait,
    right before the first mark is written; see :meth:`Worker.open`."""

    def __call__(
        self,
        worker_id: int,
        remote: tuple[MarkStore, int],
        waited: float | None,
        *,
        before_first_write: Callable[[], None] | None = None,
    ) -> Worker: ...


_OP_TIMEOUT_S = 2.0
_CONNECT_POLL_S = 0.05  # how soon a stop ends the wait for ZooKeeper's connection
_GHOST_RETRIES = 2  # Twitter's: retry twice, 1 s apart; it may be our own ghost
_REPEAT_LOG_S = 60.0  # a failure to register again, said again at most this often

# When the layout record is applied (see Cluster._apply_layout).
UNREACHABLE = "ZooKeeper unreachable for longer than the session allows"

_FIRST_START = "first start"
_AGAIN = "registering again"
_SERVING = "serving"


def advertised_address(settings: ClusterSettings, bound_port: int) -> str:
    """``host:port`` for peers and clients: the advertise flags, else what was bound."""
    host = settings.advertise_host or settings.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"{host}:{settings.advertise_port or bound_port}"


def _layout_data(layout: Layout) -> bytes:
    return json.dumps(layout_to_json(layout), sort_keys=True).encode()


def _parse_layout(path: str, data: bytes) -> Layout:
    """The layout recorded in the layout znode ``path``; ``StartupRefused`` if it is none."""
    try:
        return layout_from_json(json.loads(data.decode()))
    except (ValueError, UnicodeDecodeError) as e:
        raise StartupRefused(
            f"the cluster's layout in ZooKeeper {path} is not a layout ({e}); repair it by hand"
        ) from None


def _unanswered(error: BaseException, bound_s: float) -> str:
    """Why a ZooKeeper call given ``bound_s`` failed, in words."""
    if isinstance(error, ZooKeeperSilent):
        return f"ZooKeeper did not answer within {bound_s:g} s"
    return describe_zk_error(error)


class Cluster(Collector):
    """This node's membership: connect, check peers, register, keep serving safely.

    Everything outside it is injected: ``open_worker`` opens the worker of a
    leased id, ``client_factory`` makes the ZooKeeper client (``KazooClient``'s
    arguments), ``clock`` is the wall clock in ms (peer checks), ``gate`` the
    session gate's clock in seconds (the slot's), ``sleep`` waits between
    retries of a held worker id. ``supervise_every`` is the seconds between the
    supervision thread's checks (default: a quarter of the session timeout, at
    most 1 s); tests that drive :meth:`_tick` themselves make it long.
    """

    def __init__(
        self,
        settings: ClusterSettings,
        slot: WorkerSlot,
        clock: Callable[[], int],
        address: str,
        *,
        open_worker: OpenWorker,
        client_factory: Callable[..., Any] = KazooClient,
        gate: Callable[[], float] = boot_clock,
        sleep: Callable[[float], object] | None = None,
        supervise_every: float | None = None,
    ) -> None:
        self._settings = settings
        self._slot = slot
        self._clock = clock
        self._open_worker = open_worker
        self._client_factory = client_factory
        self._gate = gate
        # Ends the supervision thread: close() alone sets it.
        self._stop = threading.Event()
        # Ends every wait (start-up's, and a registration's again): interrupt() and close().
        # Not _stop: a stop asked for after start (a SIGTERM while draining) must leave the
        # heartbeats running until close().
        self._interrupt = threading.Event()
        # A stop ends a wait at once (the first-start wait can be long): by default.
        self._sleep = sleep or self._interrupt.wait
        self.address = address
        self._timeout = settings.zk_session_timeout
        self._granted = GrantedTimeout(self._timeout)
        self._every = supervise_every
        self._dc = settings.datacenter_id
        self._layout = settings.layout
        self._wait = settings.zk_connect_timeout
        self._layout_path = f"{settings.zk_path}/layout"
        self._nodes = f"{settings.zk_path}/nodes/{self._dc}"
        self._marks_root = f"{settings.zk_path}/marks"
        self._marks = f"{self._marks_root}/{self._dc}"
        self._client: Any = None
        self._node: str | None = None
        self._needs_register = False
        # The marks of the id we held last, until they are back in ZooKeeper.
        self._held: tuple[int, tuple[int, ...], int] | None = None
        self._suspended_since: float | None = None
        self._last_contact = float("-inf")
        # Why this node stopped handing out ids: its layout is not the recorded one.
        self._layout_stop: str | None = None
        # The layout record this node read last (None: none yet); see _keep_layout.
        self._last_record: Layout | None = None
        # When a node stopped for its layout first read its own layout again (gate
        # clock); it serves once that has held for a while (see _serve_for_layout).
        self._settle_from: float | None = None
        # Guards the gate between the heartbeat and lost_ownership (another thread).
        self._gate_lock = threading.Lock()
        self._closures = 0  # moved by every closure that asks for a registration again
        # Why registering again failed last, and when that was logged (gate clock).
        self._register_problem: tuple[str, float] | None = None
        self._layout_problem: str | None = None  # why the record was not read, logged once
        self._events: Counter[str] = Counter()
        self._skipped: Counter[str] = Counter()
        self.registrations = 0
        self.client_restarts = 0
        self._thread: threading.Thread | None = None

    @property
    def client(self) -> Any:
        return self._client

    # -- start-up -------------------------------------------------------------

    def interrupt(self) -> None:
        """A stop arrived while starting (SIGTERM): every start-up wait ends at once and
        the step in progress raises ``StartupInterrupted``; :meth:`close` then removes
        what was registered. Safe from any thread, idempotent; nothing else to call.

        The waits it ends: ZooKeeper's connection, the peer checks' tries, the retries
        of a held static worker id, the first-start wait. A ZooKeeper call already
        under way ends within ``--zk-connect-timeout`` as always. A node interrupted
        before its worker was opened has written no mark, in ZooKeeper or on disk: its
        next start waits the first-start wait again.

        Once started, it ends nothing but such waits (a registration again after a lost
        session has them too): the supervision keeps proving the registration until
        :meth:`close`, so a stop asked for while draining never lapses the gate."""
        self._interrupt.set()

    def _interrupted(self, doing: str) -> None:
        if self._interrupt.is_set():
            raise StartupInterrupted(f"stopping while {doing}; not registered")

    def connect(self) -> None:
        """Open a session, or raise ``StartupDeferred`` within ``--zk-connect-timeout``
        (``StartupInterrupted`` at once after :meth:`interrupt`)."""
        self._client = self._start_client()
        self._interrupted("connecting to ZooKeeper")
        if self._client is None:
            raise StartupDeferred(
                f"cannot reach ZooKeeper at {self._settings.zookeeper} within "
                f"{self._settings.zk_connect_timeout:g} s (--zk-connect-timeout); is it running "
                "and is --zookeeper right?"
            )

    def _start_client(self) -> Any:
        client = self._client_factory(
            hosts=self._settings.zookeeper,
            timeout=self._timeout,
            # Reconnect for as long as it takes (the session gate keeps ids safe
            # meanwhile); a command that meets a dropped connection waits for it.
            connection_retry=KazooRetry(max_tries=-1, delay=0.1, max_delay=1.0),
            command_retry=KazooRetry(max_tries=5, delay=0.1, max_delay=1.0),
        )
        self._granted = watch_granted_timeout(client, self._timeout)
        client.add_listener(self._on_state)
        # kazoo's start(timeout) waits out its timeout whatever happens: wait for its
        # connection ourselves, so that a stop ends the wait.
        connected = client.start_async()
        deadline = boot_clock() + self._settings.zk_connect_timeout
        while not connected.wait(_CONNECT_POLL_S):
            if self._interrupt.is_set() or boot_clock() > deadline:
                client.stop()
                client.close()
                return None
        return client

    def check_peers(self) -> None:
        """Twitter's sanity checks against every registered peer (see ``peers``)."""
        self._interrupted("about to ask the registered peers")
        check_peers(
            self._client, self._settings, self.address, self._clock, self._sleep,
            self._interrupt.is_set,
        )  # fmt: skip

    def register(self) -> None:
        """Take a worker id (retrying a held static one twice, 1 s apart, as Twitter
        did), honour its marks and start serving it. ``StartupRefused`` if starting
        could repeat ids, ``StartupDeferred`` if it may pass by itself (a static id
        still held), ``StartupInterrupted`` after :meth:`interrupt`."""
        self._interrupted("about to register")
        self._register(preferred=None, patient=True, phase=_FIRST_START)
        self._thread = threading.Thread(target=self._supervise, name="zookeeper", daemon=True)
        self._thread.start()

    # -- registration ---------------------------------------------------------

    def _register(self, preferred: int | None, patient: bool, phase: str) -> None:
        """Check the layout record, lease a worker id, open its worker and serve it; the
        record is confirmed again right before the worker's first mark is written."""
        self._apply_layout(phase)
        skipped: set[int] = set()

        def confirm() -> None:
            self._confirm_layout(phase)

        while True:
            worker_id = self._lease(preferred, patient, skipped)
            node = f"{self._nodes}/{worker_id}"
            try:
                store, waited = self._load_marks(worker_id, node)
                worker = self._open_worker(
                    worker_id, (store, ZK_MARK_AHEAD_MS), waited, before_first_write=confirm
                )
            except ClockBehindMark as e:
                self._delete(node)
                if not self._settings.auto_worker_id:
                    raise
                log.warning(
                    "skipping worker id %d: its high-water mark in %s is %.3f s ahead of our "
                    "clock, more than --max-startup-wait (a node whose clock ran ahead used "
                    "it); it is free again once the clock passes the mark",
                    worker_id, e.source, e.behind_ms / 1000,
                )  # fmt: skip
                self._skipped["mark_ahead"] += 1
                skipped.add(worker_id)
                continue
            except MarkOfAnotherLayout as e:
                self._delete(node)
                if not self._settings.auto_worker_id or not e.epoch_only:
                    # With other field widths the old ids collide with ours of other
                    # worker ids too: no other id is safe either.
                    raise
                # Another epoch's ids of this worker id are not ordered with ours: no
                # mark can guard them, so leave the id to that layout.
                log.warning("skipping worker id %d: %s", worker_id, e)
                self._skipped["other_layout"] += 1
                skipped.add(worker_id)
                continue
            except ReservationError as e:
                # Its first write was refused: a node put the id's mark back meanwhile.
                self._delete(node)
                raise StartupDeferred(
                    f"worker id {worker_id}: {e}; its high-water mark changed while this node "
                    "took it; start again (it will honour the new mark)"
                ) from None
            except BaseException:
                self._delete(node)
                raise
            break
        self._node = node
        self._held = None  # ours again, or another id's: the supervision has its marks
        self._slot.install(worker)
        self._needs_register = False
        self.registrations += 1
        log.info("registered %s as datacenter %d, worker %d", self.address, self._dc, worker_id)
        self._heartbeat()

    def _load_marks(self, worker_id: int, node: str) -> tuple[ZkMarkStore, float | None]:
        """The mark store of a leased ``worker_id`` (registered at ``node``), and the
        seconds waited because ZooKeeper held no mark of it (None: it held one). Without
        a mark the id is new, or ZooKeeper lost its data: wait, then read again what a
        node that held the id put back meanwhile."""
        path = f"{self._marks}/{worker_id}"

        def load() -> ZkMarkStore:
            return ZkMarkStore.load(
                lambda: self._client, path, self.lost_ownership, self._layout, self._wait
            )

        store = load()
        if max(store.marks) >= 0:
            return store, None
        wait = self._settings.first_start_wait
        if wait > 0:
            log.warning(
                "no high-water mark of worker id %d in ZooKeeper (%s): a new id, or one "
                "ZooKeeper lost; waiting --first-start-wait %g s for a node that held it to "
                "put its mark back, and for a clock ahead of ours by up to --max-peer-skew "
                "to be passed",
                worker_id, path, wait,
            )  # fmt: skip
            self._sleep(wait)
            # Before any mark is written: a mark written now would let the next start
            # skip the very wait that guards a mark ZooKeeper lost.
            self._interrupted(f"waiting --first-start-wait for the mark of {path}")
            # The node must still be ours, in the session that created it: after the wait
            # the store is bound to the session current then.
            if not self._owned(node, f"waiting for the mark of {path}"):
                raise StartupDeferred(
                    f"the registration {node} was lost while waiting for its high-water mark"
                )
            store = load()
            if max(store.marks) >= 0:
                log.warning("worker id %d has a high-water mark again: %s", worker_id, path)
                return store, None
        else:
            log.warning(
                "no high-water mark of worker id %d in ZooKeeper (%s), and not waiting "
                "(--first-start-wait 0): if ZooKeeper lost its data, ids of a node that "
                "held this id can repeat",
                worker_id, path,
            )  # fmt: skip
        return store, wait

    def _call(
        self, what: str, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> Any:
        """A ZooKeeper call that ends within ``timeout_s`` (default:
        ``--zk-connect-timeout``; see ``zk_call``)."""
        bound = self._wait if timeout_s is None else timeout_s
        return zk_call(self._client, bound, what, method, *args, **kwargs)

    def _apply_layout(self, phase: str, bound: float | None = None) -> None:
        """Apply the cluster's layout record (one read within ``bound``, default
        ``--zk-connect-timeout``): at the first start (``_FIRST_START``), when
        registering again (``_AGAIN``) and at each tick while serving (``_SERVING``).

        Ours: fine (a node stopped for its layout serves again after a settle time,
        see :meth:`_serve_for_layout`). Another: ``StartupRefused`` before serving,
        the layout stop (``/readyz`` says why) once registered, and both when
        registering again. Missing: nothing is written at a first start (the record is
        made right before the first mark, :meth:`_confirm_layout`); otherwise it is
        recorded again as this node last read it (:meth:`_record_layout_again`).
        Unreadable, or not a layout: a first start is refused or deferred, a node
        registering again is deferred (it leases nothing it cannot check), a serving
        or stopped node stays as it is (logged once)."""
        path = self._layout_path
        what = f"reading the layout in {path}"
        try:
            data, _ = self._call(what, "get", path, timeout_s=bound)
            recorded = _parse_layout(path, data)
        except NoNodeError:
            if phase != _FIRST_START:
                self._record_layout_again(self._wait if bound is None else bound)
            return
        except (ZooKeeperSilent, KazooException, KazooTimeoutError, StartupRefused) as e:
            if phase == _FIRST_START:
                raise
            why = str(e) if isinstance(e, StartupRefused) else _unanswered(e, bound or self._wait)
            self._layout_unread(why)
            if phase == _AGAIN:
                raise StartupDeferred(
                    f"the cluster's layout in {path} was not checked: {why}; not registering "
                    "again until it is"
                ) from None
            return
        self._layout_problem = None
        self._last_record = recorded
        if recorded == self._layout:
            self._serve_for_layout()
            return
        self._stop_for_layout(recorded)
        if phase != _SERVING:
            raise self._insanity(recorded, path)

    def _insanity(self, theirs: Layout, where: str) -> StartupRefused:
        return StartupRefused(
            f"Layout insanity: this node would make ids with {describe_layout(self._layout)}, "
            f"but the cluster ({where}) makes them with {describe_layout(theirs)}; two layouts "
            "in one cluster hand out the same ids: start with the cluster's --epoch and --*-bits"
        )

    def _confirm_layout(self, phase: str) -> None:
        """Right before the first mark of a worker opened (every start-up wait over):
        the record must be this node's layout, or ``StartupRefused`` and nothing is
        written. A missing one is recorded (create-only) first: at a first start from
        the marks (:meth:`_record_layout`), when registering again as this node last
        read it (never from the marks: its own mark, put back, would name its layout);
        one that cannot be read defers the start."""
        path = self._layout_path
        try:
            data, _ = self._call(f"reading the layout in {path}", "get", path)
        except NoNodeError:
            if phase == _FIRST_START:
                theirs, where = self._record_layout(), f"{path}, recorded from its marks"
            else:
                self._record_layout_again(self._wait)
                try:
                    data, _ = self._call(f"reading the layout in {path}", "get", path)
                except NoNodeError:
                    raise StartupDeferred(
                        f"the cluster's layout znode {path} is missing and this node read no "
                        "record to write back; not registering again until it is recorded"
                    ) from None
                theirs, where = _parse_layout(path, data), path
        else:
            theirs, where = _parse_layout(path, data), path
        self._last_record = theirs
        if theirs != self._layout:
            self._stop_for_layout(theirs)
            raise self._insanity(theirs, where)

    def _record_layout(self) -> Layout:
        """Record the cluster's layout where its znode is missing at a first start's
        confirmation: the layout of the marks (the ids handed out so far were made with
        it), or ours if there is no mark anywhere; the record found if another node
        recorded one first. ``StartupRefused`` if the marks disagree among themselves."""
        path = self._layout_path
        found = self._marks_layouts()
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
                f"recording the layout in {path}", "create", path, _layout_data(layout),
                makepath=True,
            )  # fmt: skip
        except NodeExistsError:  # recorded by another node meanwhile: that one counts
            data, _ = self._call(f"reading the layout in {path}", "get", path)
            return _parse_layout(path, data)
        source = "its high-water marks" if found else "this node, its first"
        log.info(
            "recorded the cluster's layout in %s from %s: %s", path, source,
            describe_layout(layout),
        )  # fmt: skip
        return layout

    def _marks_layouts(self) -> dict[Layout, list[str]]:
        """The layouts the marks under ``marks/`` were made with, and which marks; read
        within ``--zk-connect-timeout`` (``ZooKeeperSilent`` otherwise).

        The marks are read all at once, not one after another: a cluster may hold
        thousands, and one read waits a round trip."""
        root, client = self._marks_root, self._client
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

    def _lease(self, preferred: int | None, patient: bool, skipped: set[int]) -> int:
        self._call(f"creating {self._nodes}", "ensure_path", self._nodes)
        data = self.address.encode()
        if not self._settings.auto_worker_id:
            worker_id = self._settings.worker_id
            path = f"{self._nodes}/{worker_id}"
            for attempt in range(_GHOST_RETRIES + 1 if patient else 1):
                if self._take(path, data):
                    return worker_id
                if attempt < _GHOST_RETRIES and patient:
                    self._sleep(1.0)
                    self._interrupted(f"retrying the held worker id {worker_id}")
            # Deferred (exit 75), not refused: the holder may be a node that just crashed,
            # whose registration lasts until its session expires; a replacement started at
            # once is restarted by its supervisor until then. A genuine duplicate is
            # refused at every try and nothing is written meanwhile: the loop is harmless,
            # and its log names the holder each time.
            raise StartupDeferred(
                f"worker id {worker_id} of datacenter {self._dc} is registered by "
                f"{self._holder(path)} ({path}); two nodes with one worker id would hand out "
                "the same ids: if that node just stopped, a later start passes once its "
                "session expires; otherwise stop it or use another --worker-id (or auto)"
            )
        max_id = self._layout.max_worker_id
        order = [w for w in range(max_id + 1) if w not in skipped]
        if preferred is not None and preferred in order:  # the id we had, if still free
            order.remove(preferred)
            order.insert(0, preferred)
        for worker_id in order:
            if self._take(f"{self._nodes}/{worker_id}", data):
                return worker_id
        also = f", {len(skipped)} of them skipped for their marks" if skipped else ""
        # Not a danger, and it may pass: a crashed node's id is freed when its session
        # expires (75: try again).
        raise StartupDeferred(
            f"all {max_id + 1} worker ids of datacenter {self._dc} are leased "
            f"({self._nodes}{also}); widen --worker-id-bits or use another datacenter id"
        )

    def _take(self, path: str, data: bytes) -> bool:
        """Create our ephemeral registration at ``path``; False if another session holds it.

        Retried through a dropped connection; a create whose reply was lost finds our
        own node on the retry, which counts as taken.
        """
        try:
            self._call(f"registering {path}", "create", path, data, ephemeral=True)
            return True
        except NodeExistsError:
            return self._owned(path, f"registering {path}")

    def _owned(self, path: str, doing: str) -> bool:
        """Whether ``path`` exists and is an ephemeral node of our session."""
        stat = self._call(f"reading {path}", "exists", path)
        ours = session_id(self._client, doing)
        return stat is not None and stat.ephemeralOwner == ours

    def _holder(self, path: str) -> str:
        try:
            data, _ = self._call(f"reading {path}", "get", path)
            return str(data.decode(errors="replace"))
        except (KazooException, StartupRefused, StartupDeferred):
            return "another node"

    def _delete(self, node: str) -> None:
        try:
            self._client.delete_async(node).get(timeout=_OP_TIMEOUT_S)
        except (KazooException, KazooTimeoutError) as e:
            log.warning(
                "could not delete %s: %s (it expires with the session)", node,
                describe_zk_error(e),
            )  # fmt: skip

    # -- keeping it safe ------------------------------------------------------

    def lost_ownership(self, why: str) -> None:
        """Stop serving at once and register again: another node holds our worker id."""
        log.error("this node no longer owns its worker id: %s", why)
        self._close_to_register(f"worker id lost: {why}; registering again")

    def _close_to_register(self, reason: str) -> None:
        # Under the gate's lock: a heartbeat under way (another thread) must not open
        # the gate again after this (see _heartbeat).
        with self._gate_lock:
            self._needs_register = True
            self._closures += 1
            self._slot.close(reason)

    def _on_state(self, state: str) -> None:
        # Runs on kazoo's thread: record and return, never block.
        self._events[state.lower()] += 1
        if state == KazooState.LOST:
            self._close_to_register("the ZooKeeper session was lost; registering again")
            # Usually reconnected at once; if not, _tick replaces the client in time.
            if self._suspended_since is None:
                self._suspended_since = self._gate()
        elif state == KazooState.SUSPENDED:
            if self._suspended_since is None:
                self._suspended_since = self._gate()
            self._slot.closed_reason = UNREACHABLE
        else:
            self._suspended_since = None
        log.log(logging.INFO if state == KazooState.CONNECTED else logging.WARNING,
                "ZooKeeper session %s", state)  # fmt: skip

    @property
    def session_timeout(self) -> float:
        """The session timeout counted with: the requested one, or the granted one of
        the latest session if lower."""
        return self._granted.effective_s

    def _supervise(self) -> None:
        while not self._stop.wait(self._every or min(1.0, self.session_timeout / 4)):
            self._supervised_tick()

    def _supervised_tick(self) -> None:
        """One tick of the supervision thread; what fails is logged and tried again."""
        try:
            self._tick()
        except (StartupRefused, StartupDeferred) as e:
            self._register_failed(str(e))
        except (KazooException, KazooTimeoutError) as e:
            log.warning("ZooKeeper supervision: %s; trying again", describe_zk_error(e))
        except Exception as e:  # noqa: BLE001 - retried on the next tick
            log.warning("ZooKeeper supervision: %s: %s", type(e).__name__, e)

    def _register_failed(self, why: str) -> None:
        """A stopped node fails to register again at every tick (up to one a second):
        say each reason once, and again at most every ``_REPEAT_LOG_S``."""
        now, last = self._gate(), self._register_problem
        if last is not None and last[0] == why and now - last[1] < _REPEAT_LOG_S:
            return
        log.error("cannot register again yet: %s (trying again at each tick)", why)
        self._register_problem = (why, now)

    def _tick(self) -> None:
        suspended = self._suspended_since
        if self._client is None or (
            suspended is not None and self._gate() - suspended > self.session_timeout
        ):
            # Past the session timeout and still SUSPENDED: a ZooKeeper that came back
            # empty never says LOST. Drop this client and start a new session.
            self._restart_client()
            return
        if not self._client.connected:
            return
        if self._needs_register or self._node is None:
            self._register_again()
            return
        # The layout first: a record that stops the node stops it before the heartbeat
        # could extend the gate, and one that is ours again opens it in the same tick.
        self._keep_layout()
        self._heartbeat()

    def _heartbeat(self) -> None:
        node = self._node
        assert node is not None
        closures = self._closures
        sent = self._gate()
        stat = self._client.exists_async(node).get(timeout=_OP_TIMEOUT_S)
        session = self._client.client_id
        if stat is not None and session is None:
            return  # disconnected since it answered: not proven, the gate stays as it is
        timeout = None if session is None else self._granted.for_session(session[0])
        if stat is not None and timeout is None:
            return  # another session answered than the one whose timeout we know
        if stat is None or stat.ephemeralOwner != session[0]:
            log.error("our registration %s is gone or not ours any more", node)
            self._close_to_register(f"registration {node} lost; registering again")
            return
        # The server heard from our session after `sent`: the node is ours until at
        # least sent + session timeout (the granted one); stop a little earlier.
        assert timeout is not None
        self._last_contact = sent
        if self._layout_stop is not None:
            return  # closed until the recorded layout is ours again (_apply_layout)
        with self._gate_lock:
            # A mark write refused (lost_ownership, the reservation's thread) or a lost
            # session since the request was sent: the answer proves nothing any more.
            if self._needs_register or self._closures != closures:
                return
            self._slot.open_until = sent + 0.9 * timeout
            self._slot.closed_reason = UNREACHABLE

    def _keep_layout(self) -> None:
        """Apply the layout record while serving (see :meth:`_apply_layout`).

        One read, given a quarter of the session timeout: it runs between two heartbeats,
        whose gap (this, the tick's interval of at most a quarter, the heartbeat) stays
        well inside the gate's 0.9 x session timeout."""
        self._apply_layout(_SERVING, min(self._wait, self.session_timeout / 4))

    def _layout_unread(self, why: str) -> None:
        if why != self._layout_problem:
            state = "stopped" if self._layout_stop is not None else "as it was"
            log.warning(
                "the cluster's layout in %s was not checked: %s; this node stays %s and "
                "reads it again at each tick", self._layout_path, why, state,
            )  # fmt: skip
        self._layout_problem = why

    def _stop_for_layout(self, recorded: Layout) -> None:
        """Stop handing out ids: the recorded layout is not this node's (``/readyz`` says
        so until the record is this node's layout again)."""
        reason = (
            f"this node's layout ({describe_layout(self._layout)}) is not the cluster's, "
            f"recorded in {self._layout_path} ({describe_layout(recorded)}); two layouts in "
            "one cluster hand out the same ids"
        )
        if self._layout_stop is None and self._node is not None:
            log.error(
                "stopped handing out ids: %s; if the record is wrong, write the cluster's "
                "layout back (this node's: zkCli.sh set %s '%s')", reason, self._layout_path,
                _layout_data(self._layout).decode(),
            )  # fmt: skip
        self._layout_stop = reason
        self._settle_from = None
        self._slot.close(reason)

    def _serve_for_layout(self) -> None:
        """The record is this node's layout: serve, but a node stopped for its layout
        only once its own layout has been read for ``0.9 x session timeout``.

        Why wait: the record was just changed back to this node's layout, from one of
        another layout whose nodes may still serve (their ticks may be late); each of
        them stops at its next read of the record, and at the latest when its gate
        closes, 0.9 x session timeout after its last heartbeat, which it sent before
        this read. Past that time after the first matching read, none of them serves,
        whatever their ticks did; serving at once could overlap with them."""
        if self._layout_stop is None:
            return
        now = self._gate()
        if self._settle_from is None:
            self._settle_from = now
        settle = 0.9 * self.session_timeout
        if now - self._settle_from < settle:
            self._slot.closed_reason = (
                f"the cluster's layout in {self._layout_path} is this node's again; serving "
                f"{settle:g} s after it was first read so, once the nodes of the other "
                "layout have stopped"
            )
            return
        log.warning("the cluster's layout in %s is this node's again: serving", self._layout_path)
        self._layout_stop = None
        self._settle_from = None

    def _record_layout_again(self, bound: float) -> None:
        """The layout znode is gone: record again the layout this node read there last
        (never over one recorded meanwhile).

        For a serving node that is its own; for a node stopped for its layout it is the
        record that stopped it, so that its own write never lets it serve again (nor
        stops the nodes of that layout). Its state is left to the next read."""
        path, record = self._layout_path, self._last_record
        if record is None:
            return  # nothing read yet: nothing this node could vouch for
        try:
            self._call(
                f"recording the layout in {path} again", "create", path, _layout_data(record),
                timeout_s=bound,
            )  # fmt: skip
        except NodeExistsError:
            return  # recorded by another node meanwhile: read at the next tick
        except (ZooKeeperSilent, KazooException, KazooTimeoutError) as e:
            self._layout_unread(
                f"it is gone, and recording it again failed: {_unanswered(e, bound)}"
            )
            return
        stays = "" if self._layout_stop is None else " (not this node's: it stays stopped)"
        log.warning(
            "the cluster's layout znode %s was gone: recorded it again as this node last "
            "read it, %s%s", path, describe_layout(record), stays,
        )  # fmt: skip

    def _register_again(self) -> None:
        old = self._slot.retire()
        if old is not None:
            # Its exact final marks (the state file's): no id of it is stamped later.
            self._held = (old.worker_id, old.state.marks, old.state.clock_sequence)
        node = self._node
        if node is not None and self._owned(node, f"registering again after {node}"):
            self._delete(node)  # ours; a node someone else holds is not ours to delete
        self._node = None
        previous = None
        if self._held is not None:
            previous, marks, clock_sequence = self._held
            # Before leasing anything: if ZooKeeper lost them, whoever leases that id
            # meanwhile reads them after its wait (or its next write fails).
            path = f"{self._marks}/{previous}"
            if restore_marks(self._client, path, marks, clock_sequence, self._layout, self._wait):
                log.warning("put the high-water mark of worker id %d back: %s", previous, path)
        self._register(preferred=previous, patient=False, phase=_AGAIN)
        self._register_problem = None
        log.warning("registered again as worker %d", self._slot.settings.worker_id)

    def _restart_client(self) -> None:
        self._slot.close("replacing a ZooKeeper client stuck without a session")
        old, self._client = self._client, None
        if old is not None:
            log.warning("replacing a ZooKeeper client stuck without a session")
            try:
                old.stop()
                old.close()
            except Exception as e:  # noqa: BLE001 - it is being thrown away
                log.debug("closing the old client: %s", e)
        self._suspended_since = None
        self._client = self._start_client()
        self.client_restarts += 1
        self._needs_register = True

    # -- shutdown, health, metrics -------------------------------------------

    def close(self) -> None:
        """Stop serving, store the exact final marks, delete our node, end the session."""
        self._stop.set()
        self._interrupt.set()  # a registration again in the supervision thread may wait
        if self._thread is not None:
            self._thread.join()
        self._slot.retire()
        client = self._client
        if client is None:
            return
        if self._node is not None and client.connected:
            self._delete(self._node)
        client.stop()
        client.close()

    def details(self) -> dict[str, object]:
        """For the probes: the ZooKeeper session's state and our registration's node."""
        return {
            "zookeeper": self._client.state if self._client is not None else "NONE",
            "registered": self._node,
            "session_timeout_s": self.session_timeout,
        }

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "snowflake_zookeeper_registered",
            "1 while this node holds a registered worker id in ZooKeeper.",
            value=int(self._node is not None and self._slot.worker is not None),
        )
        yield GaugeMetricFamily(
            "snowflake_serving", "1 while this node hands out ids.", value=int(self._slot.serving)
        )
        yield counter_by(
            "snowflake_zookeeper_session_events",
            "ZooKeeper session state transitions, by new state.",
            "state",
            {state: self._events[state] for state in ("connected", "suspended", "lost")},
        )
        yield GaugeMetricFamily(
            "snowflake_zookeeper_last_contact_age_seconds",
            "Seconds since ZooKeeper last confirmed that our registration is ours.",
            value=self._gate() - self._last_contact,
        )
        yield CounterMetricFamily(
            "snowflake_zookeeper_registrations",
            "Registrations of a worker id (the first, and each after a lost session).",
            value=self.registrations,
        )
        yield GaugeMetricFamily(
            "snowflake_zookeeper_session_timeout_seconds",
            "The session timeout the gate counts with: --zk-session-timeout, or the one "
            "ZooKeeper granted if lower.",
            value=self.session_timeout,
        )
        yield counter_by(
            "snowflake_zookeeper_worker_ids_skipped",
            "Worker ids --worker-id auto passed over, by reason: mark_ahead (their mark is "
            "further ahead of our clock than --max-startup-wait), other_layout.",
            "reason",
            {reason: self._skipped[reason] for reason in ("mark_ahead", "other_layout")},
        )
        yield CounterMetricFamily(
            "snowflake_zookeeper_client_restarts",
            "ZooKeeper clients replaced after staying without a session too long.",
            value=self.client_restarts,
        )
