"""Cluster mode: worker ids registered and leased in ZooKeeper.

Znodes under ``--zk-path`` (``/snowflake-servers`` by default)::

    nodes/<datacenter>/<worker>   ephemeral, "host:port" of the node holding that worker id
    marks/<datacenter>/<worker>   persistent, the worker id's high-water mark in ms

A node checks its registered peers (ids and clock, as Twitter's server did),
then registers (a static id, or the lowest free one with ``--worker-id
auto``), honours the id's high-water mark from ZooKeeper as well as from its
own disk (so an id recycled from a dead host never repeats a timestamp), and
serves. It hands out ids only while its ephemeral node is certainly its own:
a heartbeat proves the node is still there and owned by our session, and ids
stop ``0.9 x session timeout`` after the last proof, whatever the session
state says. After a lost session, or a node gone, it registers again (same id
if free, otherwise another, with that id's mark); a client stuck in SUSPENDED
(a ZooKeeper that came back empty) is replaced by a new one.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from thriftpy2.thrift import TClient

from .config import ServerSettings
from .errors import ReservationError, StartupRefused
from .generator import pause
from .idl_loader import snowflake_thrift
from .transports import binary_protocol, client_socket
from .worker import Worker, WorkerSlot, gate_clock

__all__ = ["ZK_MARK_AHEAD_MS", "Cluster", "ZkMarkStore", "advertised_address"]

log = logging.getLogger(__name__)

ZK_MARK_AHEAD_MS = 2000
"""How far ahead of the clock the mark in ZooKeeper is reserved (rounded up to whole
seconds, so it is written about once a second)."""
_OP_TIMEOUT_S = 2.0
_PEER_TIMEOUT_S = 1.0
_GHOST_RETRIES = 2  # Twitter's: retry twice, 1 s apart; it may be our own ghost


def advertised_address(settings: ServerSettings, bound_port: int) -> str:
    """``host:port`` for peers and clients: the advertise flags, else what was bound."""
    host = settings.advertise_host or settings.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"{host}:{settings.advertise_port or bound_port}"


class ZkMarkStore:
    """A worker id's high-water mark in ZooKeeper: a mark store for the reservation.

    Every write is conditional. It is refused unless our ZooKeeper session is still
    the one that registered the worker id, and it names the znode version this
    store last saw (compare and set). So a node that lost its id (its session
    expired while it was frozen, the id re-leased elsewhere) can never move the
    new holder's mark, let alone lower it; its write fails and it stops serving.
    """

    name = "zookeeper"

    def __init__(
        self, cluster: Cluster, path: str, mark_ms: int, version: int | None, session: int
    ) -> None:
        self._cluster = cluster
        self._path = path
        self._written = mark_ms
        self._version = version  # None: the znode does not exist yet
        self._session = session
        self._lock = threading.Lock()
        self.writes = 0
        self.write_errors = 0

    @classmethod
    def load(cls, cluster: Cluster, path: str) -> ZkMarkStore:
        """The store of ``path`` with the mark found there (-1 if none), bound to the
        session that holds the registration now."""
        client = cluster.client
        session = client.client_id[0]
        try:
            data, stat = client.retry(client.get, path)
            mark, version = int(data.decode()), stat.version
        except NoNodeError:
            mark, version = -1, None
        except (ValueError, UnicodeDecodeError) as e:
            raise StartupRefused(
                f"the high-water mark in ZooKeeper {path} is not a number ({e}); it guards "
                "against repeating ids of a recycled worker id: repair it by hand"
            ) from None
        return cls(cluster, path, mark, version, session)

    @property
    def where(self) -> str:
        return f"zookeeper:{self._path}"

    @property
    def mark_ms(self) -> int:
        return self._written

    def advance(self, mark_ms: int) -> int:
        target = -(-mark_ms // 1000) * 1000  # whole seconds: about one write a second
        with self._lock:
            if target > self._written:
                self._write(target)
            return self._written

    def finish(self, mark_ms: int) -> None:
        with self._lock:
            self._write(mark_ms)

    def _write(self, mark_ms: int) -> None:
        client = self._cluster.client
        data = str(mark_ms).encode()
        try:
            owner = client.client_id if client is not None else None
            if owner is None or owner[0] != self._session:
                raise ReservationError(
                    f"not writing {self._path}: the ZooKeeper session that registered this "
                    "worker id is gone"
                )
            if self._version is None:
                client.ensure_path(self._path.rsplit("/", 1)[0])
                client.create_async(self._path, data).get(timeout=_OP_TIMEOUT_S)
                self._version = 0
            else:
                stat = client.set_async(self._path, data, version=self._version).get(
                    timeout=_OP_TIMEOUT_S
                )
                self._version = stat.version
        except (BadVersionError, NodeExistsError):
            self.write_errors += 1
            self._cluster.lost_ownership(f"{self._path} was changed by another node")
            raise ReservationError(
                f"{self._path} was changed by another node: this node no longer owns the worker id"
            ) from None
        except Exception:
            self.write_errors += 1
            raise
        self._written = mark_ms
        self.writes += 1


class Cluster(Collector):
    """This node's membership: connect, check peers, register, keep serving safely."""

    def __init__(
        self, settings: ServerSettings, slot: WorkerSlot, clock: Callable[[], int], address: str
    ) -> None:
        self._settings = settings
        self._slot = slot
        self._clock = clock
        self.address = address
        self._timeout = settings.zk_session_timeout
        self._dc = settings.datacenter_id
        self._nodes = f"{settings.zk_path}/nodes/{self._dc}"
        self._marks = f"{settings.zk_path}/marks/{self._dc}"
        self._client: Any = None
        self._node: str | None = None
        self._needs_register = False
        self._suspended_since: float | None = None
        self._last_contact = float("-inf")
        self._events: Counter[str] = Counter()
        self.registrations = 0
        self.client_restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def client(self) -> Any:
        return self._client

    # -- start-up -------------------------------------------------------------

    def connect(self) -> None:
        """Open a session, or raise ``StartupRefused`` within ``--zk-connect-timeout``."""
        self._client = self._start_client()
        if self._client is None:
            raise StartupRefused(
                f"cannot reach ZooKeeper at {self._settings.zookeeper} within "
                f"{self._settings.zk_connect_timeout:g} s (--zk-connect-timeout); is it running "
                "and is --zookeeper right?"
            )

    def _start_client(self) -> Any:
        client = KazooClient(
            hosts=self._settings.zookeeper,
            timeout=self._timeout,
            # Reconnect for as long as it takes (the session gate keeps ids safe
            # meanwhile); a command that meets a dropped connection waits for it.
            connection_retry=KazooRetry(max_tries=-1, delay=0.1, max_delay=1.0),
            command_retry=KazooRetry(max_tries=5, delay=0.1, max_delay=1.0),
        )
        client.add_listener(self._on_state)
        try:
            client.start(timeout=self._settings.zk_connect_timeout)
        except KazooTimeoutError:
            client.stop()
            client.close()
            return None
        return client

    def check_peers(self) -> None:
        """Twitter's sanity checks against every registered peer; ``StartupRefused``
        naming the peer and the number that was wrong."""
        if self._settings.skip_sanity_checks:
            log.warning("--skip-sanity-checks: not asking registered peers")
            return
        root = f"{self._settings.zk_path}/nodes"
        # One address may hold several registrations (a node run with --processes: any
        # of its processes may answer), so each address is asked once.
        registered: dict[str, set[tuple[int, int]]] = {}
        for dc_name in self._children(root):
            for worker_name in self._children(f"{root}/{dc_name}"):
                try:
                    data, _ = self._client.retry(
                        self._client.get, f"{root}/{dc_name}/{worker_name}"
                    )
                except NoNodeError:
                    continue  # gone meanwhile
                peer = data.decode(errors="replace")
                registered.setdefault(peer, set()).add((int(dc_name), int(worker_name)))
        # Our own address: sibling processes on this host and clock; asking could even
        # reach our own listening socket, which does not answer before we register.
        registered.pop(self.address, None)
        skews = [(peer, self._check_peer(peer, ids)) for peer, ids in registered.items()]
        if not skews:
            log.info("no registered peers to check")
            return
        mean = sum(skew for _, skew in skews) / len(skews)
        if abs(mean) > self._settings.max_peer_skew * 1000:
            detail = ", ".join(f"{peer} {skew:+d} ms" for peer, skew in skews)
            raise StartupRefused(
                f"our clock is {abs(mean):.0f} ms {'behind' if mean > 0 else 'ahead of'} the "
                f"mean of {len(skews)} peers' clocks, more than --max-peer-skew "
                f"{self._settings.max_peer_skew:g} s (peers relative to us: {detail}); fix "
                "the clocks (NTP)"
            )
        log.info("%d peer(s) sane; mean clock offset %+.0f ms", len(skews), mean)

    def _children(self, path: str) -> list[str]:
        try:
            names = self._client.retry(self._client.get_children, path)
            return sorted(names, key=lambda n: (len(n), n))
        except NoNodeError:
            return []

    def _check_peer(self, peer: str, registered: set[tuple[int, int]]) -> int:
        """The peer's clock minus ours, in ms, after checking its ids against the
        (datacenter, worker) pairs registered at its address.

        Several pairs at one address are the processes of one node (``--processes``):
        the kernel picks which one answers a connection, so connections are opened
        (up to 8 per pair) until each registered pair has answered. An answer that is
        not registered there, or a registered pair that never answers, is insanity.
        """
        as_text = ", ".join(f"datacenter {dc}, worker {w}" for dc, w in sorted(registered))
        where = f"peer {peer} (registered as {as_text})"
        answered: set[tuple[int, int]] = set()
        skew: int | None = None
        for _ in range(8 * len(registered)):
            pair, offset = self._ask_peer(peer, where)
            if pair[1] not in {w for _, w in registered}:
                raise StartupRefused(f"Worker id insanity: {where} says it is worker {pair[1]}")
            if pair not in registered:
                raise StartupRefused(
                    f"Datacenter id insanity: {where} says it is in datacenter {pair[0]}"
                )
            answered.add(pair)
            skew = offset if skew is None else skew
            if answered == registered:
                return skew
        missing = "; ".join(
            f"datacenter {dc}, worker {w}" for dc, w in sorted(registered - answered)
        )
        raise StartupRefused(
            f"Worker id insanity: {where} never answered as {missing} in "
            f"{8 * len(registered)} connections"
        )

    def _ask_peer(self, peer: str, where: str) -> tuple[tuple[int, int], int]:
        """One connection: the (datacenter, worker) that answers, and its clock minus ours."""
        host, _, port = peer.rpartition(":")
        try:
            protocol = binary_protocol(
                client_socket(host, int(port), _PEER_TIMEOUT_S), self._transport()
            )
            protocol.trans.open()
            client = TClient(snowflake_thrift().Snowflake, protocol)
            try:
                peer_worker = client.get_worker_id()
                peer_dc = client.get_datacenter_id()
                before = self._clock()
                peer_time = client.get_timestamp()
                after = self._clock()
            finally:
                client.close()
        except Exception as e:  # noqa: BLE001 - any failure to get an answer
            raise StartupRefused(
                f"{where} is unreachable: {e}; if it is gone for good its node expires with "
                "its session, or start with --skip-sanity-checks"
            ) from None
        return (int(peer_dc), int(peer_worker)), int(peer_time - (before + after) // 2)

    def _transport(self) -> Any:
        return "buffered" if self._settings.transport == "buffered" else "framed"

    def register(self) -> None:
        """Take a worker id (retrying a held static one twice, 1 s apart, as Twitter
        did), honour its marks and start serving it. ``StartupRefused`` if none."""
        self._register(preferred=None, patient=True)
        self._thread = threading.Thread(target=self._supervise, name="zookeeper", daemon=True)
        self._thread.start()

    # -- registration ---------------------------------------------------------

    def _register(self, preferred: int | None, patient: bool) -> None:
        worker_id = self._lease(preferred, patient)
        node = f"{self._nodes}/{worker_id}"
        try:
            store = ZkMarkStore.load(self, f"{self._marks}/{worker_id}")
            worker = Worker.open(
                self._settings, worker_id, clock=self._clock, remote=(store, ZK_MARK_AHEAD_MS)
            )
        except BaseException:
            self._delete(node)
            raise
        self._node = node
        self._slot.install(worker)
        self._needs_register = False
        self.registrations += 1
        log.info("registered %s as datacenter %d, worker %d", self.address, self._dc, worker_id)
        self._heartbeat()

    def _lease(self, preferred: int | None, patient: bool) -> int:
        self._client.retry(self._client.ensure_path, self._nodes)
        data = self.address.encode()
        if not self._settings.auto_worker_id:
            worker_id = self._settings.worker_id
            path = f"{self._nodes}/{worker_id}"
            for attempt in range(_GHOST_RETRIES + 1 if patient else 1):
                if self._take(path, data):
                    return worker_id
                if attempt < _GHOST_RETRIES and patient:
                    pause(1.0)
            raise StartupRefused(
                f"worker id {worker_id} of datacenter {self._dc} is registered by "
                f"{self._holder(path)} ({path}); two nodes with one worker id would hand out "
                "the same ids: stop that node, wait for its session to expire, or use another "
                "--worker-id (or auto)"
            )
        max_id = self._settings.layout().max_worker_id
        order = list(range(max_id + 1))
        if preferred is not None:  # the id we had, if it is still free
            order.remove(preferred)
            order.insert(0, preferred)
        for worker_id in order:
            if self._take(f"{self._nodes}/{worker_id}", data):
                return worker_id
        raise StartupRefused(
            f"all {max_id + 1} worker ids of datacenter {self._dc} are leased "
            f"({self._nodes}); widen --worker-id-bits or use another datacenter id"
        )

    def _take(self, path: str, data: bytes) -> bool:
        """Create our ephemeral registration at ``path``; False if another session holds it.

        Retried through a dropped connection; a create whose reply was lost finds our
        own node on the retry, which counts as taken.
        """
        client = self._client
        try:
            client.retry(client.create, path, data, ephemeral=True)
            return True
        except NodeExistsError:
            stat = client.retry(client.exists, path)
            return stat is not None and stat.ephemeralOwner == client.client_id[0]

    def _holder(self, path: str) -> str:
        try:
            data, _ = self._client.get(path)
            return str(data.decode(errors="replace"))
        except KazooException:
            return "another node"

    def _delete(self, node: str) -> None:
        try:
            self._client.delete(node)
        except (KazooException, KazooTimeoutError) as e:
            log.warning("could not delete %s: %s (it expires with the session)", node, e)

    # -- keeping it safe ------------------------------------------------------

    def lost_ownership(self, why: str) -> None:
        """Stop serving at once and register again: another node holds our worker id."""
        log.error("this node no longer owns its worker id: %s", why)
        self._slot.open_until = float("-inf")
        self._slot.closed_reason = f"worker id lost: {why}; registering again"
        self._needs_register = True

    def _on_state(self, state: str) -> None:
        # Runs on kazoo's thread: record and return, never block.
        self._events[state.lower()] += 1
        if state == KazooState.LOST:
            self._slot.open_until = float("-inf")
            self._slot.closed_reason = "the ZooKeeper session was lost; registering again"
            self._needs_register = True
            # Usually reconnected at once; if not, _tick replaces the client in time.
            if self._suspended_since is None:
                self._suspended_since = gate_clock()
        elif state == KazooState.SUSPENDED:
            if self._suspended_since is None:
                self._suspended_since = gate_clock()
            self._slot.closed_reason = "ZooKeeper unreachable for longer than the session allows"
        else:
            self._suspended_since = None
        log.log(logging.INFO if state == KazooState.CONNECTED else logging.WARNING,
                "ZooKeeper session %s", state)  # fmt: skip

    def _supervise(self) -> None:
        interval = min(1.0, self._timeout / 4)
        while not self._stop.wait(interval):
            try:
                self._tick()
            except StartupRefused as e:
                log.error("cannot register again yet: %s", e)
            except Exception as e:  # noqa: BLE001 - retried on the next tick
                log.warning("ZooKeeper supervision: %s: %s", type(e).__name__, e)

    def _tick(self) -> None:
        suspended = self._suspended_since
        if self._client is None or (
            suspended is not None and gate_clock() - suspended > self._timeout
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
        self._heartbeat()

    def _heartbeat(self) -> None:
        node = self._node
        assert node is not None
        sent = gate_clock()
        stat = self._client.exists_async(node).get(timeout=_OP_TIMEOUT_S)
        if stat is None or stat.ephemeralOwner != self._client.client_id[0]:
            log.error("our registration %s is gone or not ours any more", node)
            self._slot.open_until = float("-inf")
            self._slot.closed_reason = f"registration {node} lost; registering again"
            self._needs_register = True
            return
        # The server heard from our session after `sent`: the node is ours until at
        # least sent + session timeout; stop a little earlier.
        self._last_contact = sent
        self._slot.open_until = sent + 0.9 * self._timeout
        self._slot.closed_reason = "ZooKeeper unreachable for longer than the session allows"

    def _register_again(self) -> None:
        old = self._slot.retire()
        previous = None
        if old is not None:
            previous = old.worker_id
            old.close()
        if self._node is not None:
            stat = self._client.exists(self._node)
            if stat is not None and stat.ephemeralOwner == self._client.client_id[0]:
                self._delete(self._node)  # ours; a node someone else holds is not ours to delete
        self._node = None
        self._register(preferred=previous, patient=False)
        log.warning("registered again as worker %d", self._slot.settings.worker_id)

    def _restart_client(self) -> None:
        self._slot.open_until = float("-inf")
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
        if self._thread is not None:
            self._thread.join()
        worker = self._slot.retire()
        if worker is not None:
            worker.close()
        client = self._client
        if client is None:
            return
        if self._node is not None and client.connected:
            self._delete(self._node)
        client.stop()
        client.close()

    def health(self) -> tuple[bool, dict[str, object]]:
        serving = self._slot.serving
        details: dict[str, object] = {
            "zookeeper": self._client.state if self._client is not None else "NONE",
            "registered": self._node,
        }
        if not serving:
            details["reason"] = self._slot.closed_reason
        return serving, details

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "snowflake_zookeeper_registered",
            "1 while this node holds a registered worker id in ZooKeeper.",
            value=int(self._node is not None and self._slot.worker is not None),
        )
        yield GaugeMetricFamily(
            "snowflake_serving", "1 while this node hands out ids.", value=int(self._slot.serving)
        )
        events = CounterMetricFamily(
            "snowflake_zookeeper_session_events",
            "ZooKeeper session state transitions, by new state.",
            labels=["state"],
        )
        for state in ("connected", "suspended", "lost"):
            events.add_metric([state], self._events[state])
        yield events
        yield GaugeMetricFamily(
            "snowflake_zookeeper_last_contact_age_seconds",
            "Seconds since ZooKeeper last confirmed that our registration is ours.",
            value=gate_clock() - self._last_contact,
        )
        yield CounterMetricFamily(
            "snowflake_zookeeper_registrations",
            "Registrations of a worker id (the first, and each after a lost session).",
            value=self.registrations,
        )
        yield CounterMetricFamily(
            "snowflake_zookeeper_client_restarts",
            "ZooKeeper clients replaced after staying without a session too long.",
            value=self.client_restarts,
        )
