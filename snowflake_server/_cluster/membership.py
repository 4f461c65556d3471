"""Cluster mode: worker ids registered and leased in ZooKeeper.

Znodes under ``--zk-path`` (``/snowflake-servers`` by default)::

    layout                        persistent, the cluster's layout (JSON): see ``layout_record``
    nodes/<datacenter>/<worker>   ephemeral, "host:port" of the node holding that worker id
    marks/<datacenter>/<worker>   persistent, the worker id's high-water mark in ms and its layout

A node checks its registered peers (ids, clock and layout; Twitter's server
checked the first two), checks its layout against the cluster's, then registers
(a static id, or the lowest free one with ``--worker-id auto``), honours the
id's high-water mark from ZooKeeper as well as from its own disk (so an id
recycled from a dead host never repeats a timestamp), and serves, only while the
session gate is open (``gate``: the proof is stated there). After a lost session,
or a node gone, it puts the marks of the id it held back into ZooKeeper first (a
ZooKeeper that lost its data lost them too), then registers again (same id if
free, otherwise another, with that id's mark); a client stuck in SUSPENDED (a
ZooKeeper that came back empty) is replaced by a new one. Every ZooKeeper call of
a registration ends within ``--zk-connect-timeout``, so a ZooKeeper that vanishes
during start-up defers it (``StartupDeferred``, exit 75) in about that time.

:class:`Cluster` composes the parts, as kazoo's recipes are composed: the lease of a
worker id (``lease``), the cluster's layout record (``layout_record``), the session
gate (``gate``) and the marks (``zkmarks``); none of them calls another.

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

import logging
import math
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import KeeperState
from kazoo.retry import KazooRetry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._config.settings import ClusterSettings
from .._errors import (
    ClockBehindMark,
    ReservationError,
    StartupDeferred,
    StartupInterrupted,
    StartupRefused,
)
from .._ids.clocks import boot_clock
from .._observability.metrics import counter_by
from .._state.reservation import MarkStore
from .._state.worker import Worker
from .access import check_access, check_parents, credentials_refused
from .gate import SessionGate
from .layout_record import LayoutRecord, Stage
from .lease import Lease
from .peers import check_peers
from .session import GrantedTimeout, watch_granted_timeout
from .slot import WorkerSlot
from .zk import check_tls_files, client_options, describe_zk_error, tls_hint
from .zkmarks import ZK_MARK_AHEAD_MS, MarkOfAnotherLayout, ZkMarkStore, restore_marks

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


_CONNECT_POLL_S = 0.05  # how soon a stop ends the wait for ZooKeeper's connection
_REPEAT_LOG_S = 60.0  # a failure to register again, said again at most this often
_REGISTRATIONS_EVERY_S = 30.0  # the free-worker-ids gauge's registrations, read again


def advertised_address(settings: ClusterSettings, bound_port: int) -> str:
    """``host:port`` for peers and clients: the advertise flags, else what was bound."""
    host = settings.advertise_host or settings.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"{host}:{settings.advertise_port or bound_port}"


class Cluster(Collector):
    """This node's membership: connect, check peers, register, keep serving safely.

    ``slot`` is where the ids are served from; its gate (``slot.gate``) is the session
    gate this membership keeps proving. Everything outside it is injected:
    ``open_worker`` opens the worker of a leased id, ``client_factory`` makes the
    ZooKeeper client (``KazooClient``'s arguments), ``clock`` is the wall clock in ms
    (peer checks), ``gate_clock`` the gate's clock in seconds (for the layout record's
    settle time and the supervision's timing), ``sleep`` waits between retries of a
    held worker id and the first-start wait. ``supervise_every`` is the seconds
    between the supervision thread's ticks (default: a quarter of the session
    timeout, at most 1 s); tests that drive :meth:`tick` themselves make it long.
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
        gate_clock: Callable[[], float] = boot_clock,
        sleep: Callable[[float], object] | None = None,
        supervise_every: float | None = None,
    ) -> None:
        self._settings = settings
        self._slot = slot
        self._gate: SessionGate = slot.gate
        self._clock = clock
        self._open_worker = open_worker
        self._client_factory = client_factory
        self._now = gate_clock
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
        self.granted = GrantedTimeout(self._timeout)
        """The session timeouts ZooKeeper granted (replaced with each client)."""
        self._every = supervise_every
        self._dc = settings.datacenter_id
        self._layout = settings.layout
        self._wait = settings.zk_connect_timeout
        self._marks = f"{settings.zk_path}/marks/{self._dc}"
        self._nodes = f"{settings.zk_path}/nodes/{self._dc}"
        self._client: Any = None
        self.lease = Lease(
            lambda: self._client, self._nodes, self._dc, address,
            self._wait, sleep=self._sleep, interrupted=self._interrupted,
        )  # fmt: skip
        self.record = LayoutRecord(
            lambda: self._client, settings.zk_path, self._layout, self._wait,
            clock=gate_clock, session_timeout=lambda: self.session_timeout,
        )  # fmt: skip
        self._node: str | None = None
        # The marks of the id we held last, until they are back in ZooKeeper.
        self._held: tuple[int, tuple[int, ...], int] | None = None
        self._suspended_since: float | None = None
        # Why registering again failed last, and when that was logged (gate clock).
        self._register_problem: tuple[str, float] | None = None
        self._events: Counter[str] = Counter()
        self._skipped: Counter[str] = Counter()
        self.registrations = 0
        self.client_restarts = 0
        # The worker ids of our datacenter registered when the peers were checked.
        self._registered_ids: frozenset[int] | None = None
        self._registrations_read_at = -math.inf
        self._registrations_pending: Any = None  # kazoo's IAsyncResult of the read
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
        (``StartupInterrupted`` at once after :meth:`interrupt`); ``ConfigurationError``
        if the TLS files do not load."""
        check_tls_files(self._settings.access)
        self._client = self._start_client()
        self._interrupted("connecting to ZooKeeper")
        if self._client is None:
            over = " over TLS" if self._settings.access.tls else ""
            raise StartupDeferred(
                f"cannot reach ZooKeeper at {self._settings.zookeeper}{over} within "
                f"{self._settings.zk_connect_timeout:g} s (--zk-connect-timeout); is it running "
                f"and is --zookeeper right?{tls_hint(self._settings.access)}"
            )
        check_access(
            self._client, self._settings.access, self._settings.zk_path, self._wait
        )  # fmt: skip

    def _start_client(self) -> Any:
        client = self._client_factory(
            hosts=self._settings.zookeeper,
            timeout=self._timeout,
            # Reconnect for as long as it takes (the session gate keeps ids safe
            # meanwhile); a command that meets a dropped connection waits for it.
            connection_retry=KazooRetry(max_tries=-1, delay=0.1, max_delay=1.0),
            command_retry=KazooRetry(max_tries=5, delay=0.1, max_delay=1.0),
            **client_options(self._settings.access),
        )
        self.granted = watch_granted_timeout(client, self._timeout)
        client.add_listener(self._on_state)
        # kazoo's start(timeout) waits out its timeout whatever happens: wait for its
        # connection ourselves, so that a stop ends the wait.
        connected = client.start_async()
        deadline = boot_clock() + self._settings.zk_connect_timeout
        while not connected.wait(_CONNECT_POLL_S):
            refused = client.client_state == KeeperState.AUTH_FAILED
            if refused or self._interrupt.is_set() or boot_clock() > deadline:
                client.stop()
                client.close()
                if refused:  # never passes by itself: not "try again"
                    raise credentials_refused(self._settings.access)
                return None
        return client

    def check_peers(self) -> None:
        """Twitter's sanity checks against every registered peer (see ``peers``)."""
        self._interrupted("about to ask the registered peers")
        pairs = check_peers(
            self._client, self._settings, self.address, self._clock, self._sleep,
            self._interrupt.is_set,
        )  # fmt: skip
        if pairs is not None:
            self.saw_registrations(pairs)

    def saw_registrations(self, pairs: Iterable[tuple[int, int]]) -> None:
        """The (datacenter, worker) pairs registered in ZooKeeper, as the peer checks read
        them: ``snowflake_zookeeper_free_worker_ids`` counts from these from now on."""
        self._registered_ids = frozenset(w for dc, w in pairs if dc == self._dc)
        self._registrations_read_at = self._now()

    def register(self) -> None:
        """Take a worker id (retrying a held static one twice, 1 s apart, as Twitter
        did), honour its marks and start serving it. ``StartupRefused`` if starting
        could repeat ids, ``StartupDeferred`` if it may pass by itself (a static id
        still held), ``StartupInterrupted`` after :meth:`interrupt`."""
        self._interrupted("about to register")
        # Before anything is written: the tree check at connect passed on a tree that
        # did not exist yet, which someone else could have created open since.
        check_parents(
            self._client, self._settings.access, self._settings.zk_path,
            (self._nodes, self._marks), self._wait,
        )  # fmt: skip
        self._register(preferred=None, patient=True, stage=Stage.FIRST_START)
        self._thread = threading.Thread(target=self._supervise, name="zookeeper", daemon=True)
        self._thread.start()

    # -- registration ---------------------------------------------------------

    def _check_layout(self, stage: Stage, bound: float | None = None) -> None:
        """The layout record's verdict, applied to the gate whatever it raises."""
        try:
            self.record.check(stage, bound)
        finally:
            self._gate.hold(self.record.hold)

    def _confirm_layout(self, stage: Stage) -> None:
        try:
            self.record.confirm(stage)
        finally:
            self._gate.hold(self.record.hold)

    def _register(self, preferred: int | None, patient: bool, stage: Stage) -> None:
        """Check the layout record, lease a worker id, open its worker and serve it; the
        record is confirmed again right before the worker's first mark is written."""
        token = self._gate.registering()
        self._check_layout(stage)
        skipped: set[int] = set()
        static = None if self._settings.auto_worker_id else self._settings.worker_id

        def confirm() -> None:
            self._confirm_layout(stage)

        while True:
            worker_id = self.lease.take(
                static, self._layout.max_worker_id, preferred=preferred, patient=patient,
                skipped=frozenset(skipped),
            )  # fmt: skip
            node = self.lease.node(worker_id)
            try:
                store, waited = self._load_marks(worker_id, node)
                worker = self._open_worker(
                    worker_id, (store, ZK_MARK_AHEAD_MS), waited, before_first_write=confirm
                )
            except ClockBehindMark as e:
                self.lease.release(node)
                if static is not None:
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
                self.lease.release(node)
                if static is not None or not e.epoch_only:
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
                self.lease.release(node)
                raise StartupDeferred(
                    f"worker id {worker_id}: {e}; its high-water mark changed while this node "
                    "took it; start again (it will honour the new mark)"
                ) from None
            except BaseException:
                self.lease.release(node)
                raise
            break
        self._node = node
        self._held = None  # ours again, or another id's: the supervision has its marks
        self._slot.install(worker)
        self.registrations += 1
        log.info("registered %s as datacenter %d, worker %d", self.address, self._dc, worker_id)
        if not self._gate.reopen(token):
            # Closed while the worker opened (its first mark write refused, on the
            # reservation's thread): that was about this registration; the next tick
            # makes another.
            log.warning("closed while registering (%s): registering again", self._gate.reason)
            return
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
            if not self.lease.owned(node, f"waiting for the mark of {path}"):
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

    # -- keeping it safe ------------------------------------------------------

    def lost_ownership(self, why: str) -> None:
        """Stop serving at once and register again: another node holds our worker id."""
        log.error("this node no longer owns its worker id: %s", why)
        self._gate.close(f"worker id lost: {why}; registering again")

    def _on_state(self, state: str) -> None:
        # Runs on kazoo's thread: record and return, never block.
        self._events[state.lower()] += 1
        if state == KazooState.LOST:
            self._gate.close("the ZooKeeper session was lost; registering again")
            # Usually reconnected at once; if not, tick() replaces the client in time.
            if self._suspended_since is None:
                self._suspended_since = self._now()
        elif state == KazooState.SUSPENDED:
            if self._suspended_since is None:
                self._suspended_since = self._now()
            self._gate.unreachable()
        else:
            self._suspended_since = None
        log.log(logging.INFO if state == KazooState.CONNECTED else logging.WARNING,
                "ZooKeeper session %s", state)  # fmt: skip

    @property
    def session_timeout(self) -> float:
        """The session timeout counted with: the requested one, or the granted one of
        the latest session if lower."""
        return self.granted.effective_s

    def _supervise(self) -> None:
        while not self._stop.wait(self._every or min(1.0, self.session_timeout / 4)):
            self.supervise_tick()

    def supervise_tick(self) -> None:
        """One :meth:`tick` as the supervision thread runs it: what fails is logged and
        tried again at the next."""
        try:
            self.tick()
        except (StartupRefused, StartupDeferred) as e:
            self._register_failed(str(e))
        except (KazooException, KazooTimeoutError) as e:
            log.warning("ZooKeeper supervision: %s; trying again", describe_zk_error(e))
        except Exception as e:  # noqa: BLE001 - retried on the next tick
            log.warning("ZooKeeper supervision: %s: %s", type(e).__name__, e)

    def _register_failed(self, why: str) -> None:
        """A stopped node fails to register again at every tick (up to one a second):
        say each reason once, and again at most every ``_REPEAT_LOG_S``."""
        now, last = self._now(), self._register_problem
        if last is not None and last[0] == why and now - last[1] < _REPEAT_LOG_S:
            return
        log.error("cannot register again yet: %s (trying again at each tick)", why)
        self._register_problem = (why, now)

    def tick(self) -> None:
        """One check of the supervision: replace a client stuck without a session,
        register again after a closure, else read the layout record and send a
        heartbeat. Raises what fails (:meth:`supervise_tick` logs it)."""
        suspended = self._suspended_since
        if self._client is None or (
            suspended is not None and self._now() - suspended > self.session_timeout
        ):
            # Past the session timeout and still SUSPENDED: a ZooKeeper that came back
            # empty never says LOST. Drop this client and start a new session.
            self._restart_client()
            return
        if not self._client.connected:
            return
        if self._gate.shut or self._node is None:
            self._register_again()
            return
        # The layout first: a record that holds the node holds it before the heartbeat
        # could extend the gate, and one that is ours again opens it in the same tick.
        self._keep_layout()
        self._heartbeat()
        self._count_registrations()

    def _heartbeat(self) -> None:
        node = self._node
        assert node is not None
        if not self._gate.heartbeat(self._client, node, self.granted):
            log.error("our registration %s is gone or not ours any more", node)
            self._gate.close(f"registration {node} lost; registering again")

    def _count_registrations(self) -> None:
        """Read the datacenter's registrations again for the free-worker-ids gauge, every
        ``_REGISTRATIONS_EVERY_S``, so that nodes joining and leaving since the start
        show. Asked for after a heartbeat and taken at a later tick, never waited for: the
        supervision thread's time belongs to the heartbeats (a slow ZooKeeper would
        otherwise stretch the gap the gate is counted against)."""
        if self._registered_ids is None:
            return  # the peer checks were skipped: no gauge
        pending, now = self._registrations_pending, self._now()
        if pending is not None and pending.ready():
            self._registrations_pending = None
            try:
                names = pending.get_nowait()
            except Exception as e:  # noqa: BLE001 - only a gauge: the last count stands
                # (nodes/<dc> gone too: this node's own registration lives there, so the
                # supervision is busy registering again, and the next read counts afresh)
                log.debug("free worker ids: %s", e)
                return
            # ASCII digits only: int() also takes other scripts' digits, or refuses them.
            self._registered_ids = frozenset(
                int(name) for name in names if name.isascii() and name.isdigit()
            )
        elif now - self._registrations_read_at >= _REGISTRATIONS_EVERY_S:
            # Due, and any read still unanswered (a client replaced meanwhile) is dropped.
            self._registrations_read_at = now
            self._registrations_pending = self._client.get_children_async(self._nodes)

    def _keep_layout(self) -> None:
        """Apply the layout record while serving.

        One read, given a quarter of the session timeout: it runs between two heartbeats,
        whose gap (this, the tick's interval of at most a quarter, the heartbeat) stays
        well inside the gate's 0.9 x session timeout."""
        self._check_layout(Stage.SERVING, min(self._wait, self.session_timeout / 4))

    def _register_again(self) -> None:
        old = self._slot.retire()
        if old is not None:
            # Its exact final marks (the state file's): no id of it is stamped later.
            self._held = (old.worker_id, old.state.marks, old.state.clock_sequence)
        node = self._node
        if node is not None and self.lease.owned(node, f"registering again after {node}"):
            self.lease.release(node)  # ours; a node someone else holds is not ours to delete
        self._node = None
        previous = None
        if self._held is not None:
            previous, marks, clock_sequence = self._held
            # Before leasing anything: if ZooKeeper lost them, whoever leases that id
            # meanwhile reads them after its wait (or its next write fails).
            path = f"{self._marks}/{previous}"
            if restore_marks(self._client, path, marks, clock_sequence, self._layout, self._wait):
                log.warning("put the high-water mark of worker id %d back: %s", previous, path)
        self._register(preferred=previous, patient=False, stage=Stage.AGAIN)
        self._register_problem = None
        log.warning("registered again as worker %d", self._slot.settings.worker_id)

    def _restart_client(self) -> None:
        self._gate.close("replacing a ZooKeeper client stuck without a session")
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

    # -- shutdown, health, metrics -------------------------------------------

    def close(self) -> None:
        """Stop serving, store the exact final marks, delete our node, end the session."""
        self._stop.set()
        self._interrupt.set()  # a registration again in the supervision thread may wait
        if self._thread is not None:
            self._thread.join()
        self._slot.retire("this node is stopping")
        client = self._client
        if client is None:
            return
        if self._node is not None and client.connected:
            self.lease.release(self._node)
        # A session ended on purpose is no lost session: calls keep being told why.
        client.remove_listener(self._on_state)
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
            value=self._gate.age(),
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
        yield from self._free_worker_ids()
        yield CounterMetricFamily(
            "snowflake_zookeeper_client_restarts",
            "ZooKeeper clients replaced after staying without a session too long.",
            value=self.client_restarts,
        )

    def _free_worker_ids(self) -> Iterable[Metric]:
        # From the registrations last read (no ZooKeeper read per scrape), with the id we
        # hold now.
        seen = self._registered_ids
        if seen is None:
            return
        worker = self._slot.worker
        held = {worker.generator.settings.worker_id} if worker is not None else set()
        yield GaugeMetricFamily(
            "snowflake_zookeeper_free_worker_ids",
            "Worker ids of this node's datacenter no node has registered (its own taken "
            "out), as read at the peer checks and every 30 s since.",
            value=self._layout.max_worker_id + 1 - len(seen | held),
        )
