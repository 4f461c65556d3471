"""Server settings: valid by construction, and handed down as narrow views.

:class:`ServerSettings` checks every value in ``__post_init__``, so no layer
ever holds settings that cannot work (``dataclasses.replace`` checks again).
Each layer receives only its part: :attr:`ServerSettings.ids` (the
generator), :attr:`~ServerSettings.worker` (state file and start-up wait),
:attr:`~ServerSettings.cluster` (ZooKeeper), :attr:`~ServerSettings.thrift`
(the Thrift server), :attr:`~ServerSettings.admin` (metrics and health),
:attr:`~ServerSettings.probes` (what readiness and liveness watch) and
:attr:`~ServerSettings.audit`.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

from snowflake_thrift_client import TWITTER_EPOCH_MS, Layout

from .._errors import ConfigurationError
from .._ids.generator import GeneratorSettings
from .._ids.layouts import layout_from

__all__ = [
    "AUTO_WORKER_ID",
    "HTTP_OFF",
    "PEER_CHECK_SLOTS",
    "AdminSettings",
    "AuditSettings",
    "ClusterSettings",
    "FromMachine",
    "LogSettings",
    "ProbeSettings",
    "ServerSettings",
    "ServingSettings",
    "WorkerSettings",
    "ZooKeeperAccess",
    "check_zk_tls",
]

MAX_NATIVE_THREADS = 64
AUTO_WORKER_ID = -1
"""``--worker-id auto``: lease the lowest free worker id from ZooKeeper."""
HTTP_OFF = -1
STANDALONE_FIRST_START_WAIT_S = 5.0
UNBOUNDED_SKEW_WAIT_S = 10.0  # Twitter's start-up sleep, where no skew bound derives one
"""``--http-port`` by default: no HTTP/JSON API."""
READY_WINDOW_S = 5.0
"""The window over which the serving loop's lag is judged for readiness."""
MIN_LIVE_MAX_STALL_S = 10.0
"""The least ``--live-max-stall``: below it a client that can hold the loop a few
seconds could get nodes restarted (losing their connections) at will."""
# A stalled loop reads as overloaded within half the ready window: it must leave the
# rotation well before liveness restarts it.
assert READY_WINDOW_S < MIN_LIVE_MAX_STALL_S


class FromMachine(enum.Enum):
    """``--worker-id ordinal``, ``ip`` or ``mac``: an id read from this machine at start-up
    (``_app/node_id.py``), then served as a fixed one."""

    ORDINAL = "ordinal"
    """The worker id is the host name's trailing number (StatefulSet pod ``snowflake-7``)."""
    IP = "ip"
    """The datacenter and worker ids are the low bits of this host's IPv4 address."""
    MAC = "mac"
    """The same from the MAC address of the interface holding that IPv4 address."""

    @property
    def fills_datacenter(self) -> bool:
        """Whether it gives the datacenter id too: one node id split over both fields."""
        return self is not FromMachine.ORDINAL


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
Transport = Literal["framed", "buffered"]


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What opening a worker needs: its ids, its state directory, the start-up wait."""

    datacenter_id: int
    layout: Layout
    max_backwards_ms: int
    sequence_start: Literal["zero", "random"]
    state_dir: str
    max_startup_wait: float
    discard_corrupt_state: bool
    first_start_wait: float
    host_lock_scope: str
    max_batch: int
    native_state: bool = False
    """Native threads will issue this worker's ids (``ServingSettings.native``): its
    state lives in the native core where that is built."""

    def generator(self, worker_id: int) -> GeneratorSettings:
        """The generator's settings for ``worker_id`` (checked against the layout)."""
        return GeneratorSettings(
            datacenter_id=self.datacenter_id,
            worker_id=worker_id,
            layout=self.layout,
            max_backwards_ms=self.max_backwards_ms,
            sequence_start=self.sequence_start,
            max_batch=self.max_batch,
        )


ZK_AUTHS = ("none", "sasl", "digest")
ZK_READ_ACLS = ("world", "service")


def check_zk_tls(ca: str, cert: str, key: str) -> None:
    """The ZooKeeper TLS settings' one check, for the server and every command that
    reaches ZooKeeper: ``ConfigurationError`` naming the settings (``zk_tls_*``) unless
    the certificate and key come together, and with the CA (TLS is on when it is given:
    without it they would be dropped and the connection made in the clear)."""
    if bool(cert) != bool(key):
        raise ConfigurationError(
            "zk_tls_cert and zk_tls_key go together (a client certificate and its key)"
        )
    if cert and not ca:
        raise ConfigurationError(
            "zk_tls_cert needs zk_tls_ca: TLS to ZooKeeper is on when its CA is given"
        )


@dataclass(frozen=True, slots=True)
class ZooKeeperAccess:
    """Who this node is to ZooKeeper, what the znodes it creates let others do, and how
    it reaches ZooKeeper.

    ``auth``: ``none`` (anonymous; anyone who reaches ZooKeeper can break uniqueness),
    ``sasl`` (DIGEST-MD5) or ``digest``, as the user in ``credentials_file``.
    ``read_acl``: who may read the service's znodes (``world``: discovery clients
    without credentials; ``service``: only the service's identities). ``open_acl``:
    during a migration to ACLs, authenticate but create znodes anyone may write and
    accept such ones (see ``snowflake zk-acl``).

    Over TLS when ``tls_ca`` is set (the CA that signed the servers' certificates),
    presenting ``tls_cert`` and ``tls_key`` when both are set; the servers' certificates
    must name the host dialled (``tls_verify_hostname``, always on from the options).
    """

    auth: str = "none"
    credentials_file: str = ""
    read_acl: str = "world"
    open_acl: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_verify_hostname: bool = True

    def __post_init__(self) -> None:
        check_zk_tls(self.tls_ca, self.tls_cert, self.tls_key)

    @property
    def authenticated(self) -> bool:
        return self.auth != "none"

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca)


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """What cluster mode needs: where ZooKeeper is, which id to take, how to check peers."""

    zookeeper: str
    zk_path: str
    datacenter_id: int
    worker_id: int  # AUTO_WORKER_ID: lease the lowest free one
    layout: Layout
    transport: Transport
    host: str
    advertise_host: str
    advertise_port: int
    max_peer_skew: float
    skip_sanity_checks: bool
    zk_session_timeout: float
    zk_connect_timeout: float
    first_start_wait: float
    max_startup_wait: float
    access: ZooKeeperAccess = ZooKeeperAccess()

    @property
    def auto_worker_id(self) -> bool:
        return self.worker_id == AUTO_WORKER_ID


PEER_CHECK_SLOTS = 8
"""Thrift connections kept beyond --max-connections for joining nodes' peer checks
(they may not ask for ids, and stay a few seconds)."""


@dataclass(frozen=True, slots=True)
class ServingSettings:
    """What the serving core needs: its ports, their protocols' limits, TLS."""

    host: str
    port: int
    transport: Transport
    idle_timeout: float
    request_timeout: float
    max_connections: int
    http_max_connections: int
    max_frame_size: int
    reuse_port: bool
    tls_cert: str
    tls_key: str
    tls_client_ca: str
    http_host: str
    http_port: int  # HTTP_OFF: no HTTP/JSON API
    native_threads: int = 0
    """Native threads for the Thrift port's get_id (0: Python serves every request)."""

    @property
    def http(self) -> bool:
        return self.http_port != HTTP_OFF

    @property
    def native(self) -> bool:
        """Native threads answer the Thrift port's get_id where the native core is built:
        framed, without TLS, with threads to run."""
        return self.native_threads > 0 and self.transport == "framed" and not self.tls_cert

    @property
    def connection_slots(self) -> int:
        """Client connections served at once on every port, the reserve included (the
        open files they need)."""
        http = self.http_max_connections if self.http else 0
        return self.max_connections + PEER_CHECK_SLOTS + http


@dataclass(frozen=True, slots=True)
class AdminSettings:
    """What the metrics and health endpoint needs."""

    host: str
    port: int
    max_agents: int
    web_config_file: str = ""
    """The exporter-toolkit web configuration (TLS, client certificates, users), or ""."""


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """What readiness and liveness watch of the serving loop: its lag, judged over
    ``window_s``, above ``max_lag_s`` makes the node unready; no turn for
    ``max_stall_s`` makes it wedged."""

    max_lag_s: float
    max_stall_s: float
    window_s: float


@dataclass(frozen=True, slots=True)
class LogSettings:
    """Where the log goes, and how it is written (``file`` empty: standard error)."""

    level: str
    format: str
    file: str


@dataclass(frozen=True, slots=True)
class AuditSettings:
    """Where the audit trail goes (``path`` empty: off)."""

    path: str
    queue: int


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Everything a server process needs to start, checked when it is made.

    Raises ``ConfigurationError`` naming the field at fault; ``load_settings``
    turns field names into the flags and variables that set them.
    """

    host: str = "127.0.0.1"
    port: int = 7609
    transport: Transport = "framed"
    idle_timeout: float = 600.0
    request_timeout: float = 10.0
    datacenter_id: int = 0
    worker_id: int | FromMachine = 0
    force_node_id: bool = False
    epoch: int = TWITTER_EPOCH_MS
    timestamp_bits: int = 41
    datacenter_id_bits: int = 5
    worker_id_bits: int = 5
    sequence_bits: int = 12
    clock_sequence_bits: int = 0
    max_backwards_ms: int = 5
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9990
    max_agents: int = 100
    log_level: str = "info"
    log_format: str = "text"
    log_file: str = ""
    drain_seconds: float = 0.0
    ready_max_lag: float = 0.25
    live_max_stall: float = 30.0
    state_dir: str = ""
    max_startup_wait: float = 10.0
    sequence_start: Literal["zero", "random"] = "zero"
    discard_corrupt_state: bool = False
    first_start_wait: float | None = None  # see first_start_window
    host_lock_scope: str = ""
    max_batch: int = 4096
    zookeeper: str = ""
    zk_path: str = "/snowflake-servers"
    advertise_host: str = ""
    advertise_port: int = 0
    max_peer_skew: float = 10.0
    skip_sanity_checks: bool = False
    zk_session_timeout: float = 10.0
    zk_connect_timeout: float = 10.0
    zk_auth: str = "none"
    zk_credentials_file: str = ""
    zk_read_acl: str = "world"
    zk_open_acl: bool = False
    zk_tls_ca: str = ""
    zk_tls_cert: str = ""
    zk_tls_key: str = ""
    max_connections: int = 1000
    http_max_connections: int = 1000
    max_frame_size: int = 64 * 1024
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    web_config_file: str = ""
    audit_log: str = ""
    audit_queue: int = 100_000
    processes: int = 1
    reuse_port: bool = False
    native_threads: int | None = None  # see native_thread_count
    http_host: str = "127.0.0.1"
    http_port: int = HTTP_OFF

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "advertise_port"):
            _within(name, getattr(self, name), 0, 65535)
        _within("http_port", self.http_port, HTTP_OFF, 65535)
        for name in ("max_connections", "http_max_connections", "max_frame_size", "audit_queue",
                     "processes", "max_batch"):  # fmt: skip
            _within(name, getattr(self, name), 1, None)
        for name in ("max_agents", "max_backwards_ms"):
            _within(name, getattr(self, name), 0, None)
        if self.native_threads is not None:
            _within("native_threads", self.native_threads, 0, MAX_NATIVE_THREADS)
        # inf means "never refuse" for the start-up wait and the peers' skew; for the
        # timeouts it is no setting at all (0 is "never" for the idle timeout).
        for name in ("zk_session_timeout", "zk_connect_timeout"):
            _seconds(name, getattr(self, name), positive=True, unbounded=False)
        _seconds("max_peer_skew", self.max_peer_skew, positive=True, unbounded=True)
        _seconds("idle_timeout", self.idle_timeout, positive=False, unbounded=False)
        _seconds("request_timeout", self.request_timeout, positive=False, unbounded=False)
        _seconds("max_startup_wait", self.max_startup_wait, positive=False, unbounded=True)
        if self.first_start_wait is not None:
            _seconds("first_start_wait", self.first_start_wait, positive=False, unbounded=False)
        _seconds("drain_seconds", self.drain_seconds, positive=False, unbounded=False)
        _probes(self.ready_max_lag, self.live_max_stall)
        _one_of("transport", self.transport, ("framed", "buffered"))
        _one_of("sequence_start", self.sequence_start, ("zero", "random"))
        _one_of("log_level", self.log_level, LOG_LEVELS)
        _one_of("log_format", self.log_format, LOG_FORMATS)
        _one_of("zk_auth", self.zk_auth, ZK_AUTHS)
        _one_of("zk_read_acl", self.zk_read_acl, ZK_READ_ACLS)
        if self.zk_auth == "none":
            if self.zk_credentials_file or self.zk_open_acl or self.zk_read_acl != "world":
                raise ConfigurationError(
                    "zk_credentials_file, zk_read_acl service and zk_open_acl need zk_auth "
                    "sasl or digest"
                )
        elif not self.zk_credentials_file:
            raise ConfigurationError(
                f"zk_auth {self.zk_auth} needs zk_credentials_file (credentials never come "
                "from the command line)"
            )
        path = self.zk_path
        if not path.startswith("/") or path.endswith("/") or "//" in path:
            raise ConfigurationError(
                f"zk_path must be an absolute ZooKeeper path like /snowflake-servers, got {path!r}"
            )
        if (self.tls_key or self.tls_client_ca) and not self.tls_cert:
            raise ConfigurationError("tls_key and tls_client_ca need tls_cert")
        check_zk_tls(self.zk_tls_ca, self.zk_tls_cert, self.zk_tls_key)
        if self.worker_id == AUTO_WORKER_ID and not self.zookeeper:
            raise ConfigurationError("worker_id auto leases ids from ZooKeeper: give zookeeper")
        worker_id = self.worker_id
        if isinstance(worker_id, FromMachine):
            _machine_source(worker_id, self.datacenter_id, self.processes)
            worker_id = 0
        # The layout, and the ids in it (a leased id, or one read from the machine, is
        # checked once it is known).
        self.worker.generator(0 if worker_id == AUTO_WORKER_ID else worker_id)

    @property
    def auto_worker_id(self) -> bool:
        return self.worker_id == AUTO_WORKER_ID

    @property
    def worker_number(self) -> int:
        """The worker id to serve (``AUTO_WORKER_ID`` with auto). Raises
        ``ConfigurationError`` while it is still to be read from the machine: the
        process entry point resolves ``ordinal``, ``ip`` and ``mac`` first."""
        if isinstance(self.worker_id, FromMachine):
            raise ConfigurationError(
                f"worker_id {self.worker_id.value} is read from this machine at start-up, "
                "and was not: resolve it first (resolve_worker_id)"
            )
        return self.worker_id

    @property
    def layout(self) -> Layout:
        return layout_from(self)

    @property
    def first_start_window(self) -> float:
        """The wait before the first id of a worker id with no high-water mark:
        ``--first-start-wait`` if given; else, standalone, 5 s; in cluster mode the
        session timeout plus the peers' allowed skew (10 s if unbounded), the time
        within which a node that held the id before ZooKeeper lost its data has put
        its mark back or, gone for good, cannot have stamped an id ahead of our clock."""
        if self.first_start_wait is not None:
            return self.first_start_wait
        if not self.zookeeper:
            return STANDALONE_FIRST_START_WAIT_S
        skew = self.max_peer_skew if math.isfinite(self.max_peer_skew) else UNBOUNDED_SKEW_WAIT_S
        return self.zk_session_timeout + skew

    @property
    def worker(self) -> WorkerSettings:
        return self._view(
            WorkerSettings,
            first_start_wait=self.first_start_window,
            native_state=self.serving.native,
        )

    @property
    def ids(self) -> GeneratorSettings:
        """The generator's settings for the configured worker id (0 with ``auto``,
        until one is leased)."""
        return self.worker.generator(0 if self.auto_worker_id else self.worker_number)

    @property
    def cluster(self) -> ClusterSettings:
        return self._view(
            ClusterSettings, worker_id=self.worker_number, first_start_wait=self.first_start_window,
            access=self.zk_access,
        )  # fmt: skip

    @property
    def zk_access(self) -> ZooKeeperAccess:
        """How to reach ZooKeeper (identity, ACLs, TLS), for the cluster and anything else
        that asks it."""
        return ZooKeeperAccess(
            auth=self.zk_auth, credentials_file=self.zk_credentials_file,
            read_acl=self.zk_read_acl, open_acl=self.zk_open_acl,
            tls_ca=self.zk_tls_ca, tls_cert=self.zk_tls_cert, tls_key=self.zk_tls_key,
        )  # fmt: skip

    @property
    def serving(self) -> ServingSettings:
        return self._view(ServingSettings, native_threads=self.native_thread_count)

    @property
    def native_thread_count(self) -> int:
        """``--native-threads`` if given; else the CPUs this process may run on, shared
        by ``--processes`` (at least one each)."""
        if self.native_threads is not None:
            return self.native_threads
        return max(1, len(os.sched_getaffinity(0)) // self.processes)

    @property
    def admin(self) -> AdminSettings:
        return AdminSettings(
            self.metrics_host, self.metrics_port, self.max_agents, self.web_config_file
        )

    @property
    def probes(self) -> ProbeSettings:
        return ProbeSettings(self.ready_max_lag, self.live_max_stall, READY_WINDOW_S)

    @property
    def logging(self) -> LogSettings:
        return LogSettings(self.log_level, self.log_format, self.log_file)

    @property
    def audit(self) -> AuditSettings:
        return AuditSettings(self.audit_log, self.audit_queue)

    def _view(self, view: type[_View], **values: Any) -> _View:
        """``view`` with each of its fields taken from the same-named setting, unless given."""
        for f in fields(view):
            if f.name not in values:
                values[f.name] = getattr(self, f.name)
        return view(**values)


_View = TypeVar("_View", WorkerSettings, ClusterSettings, ServingSettings)


def _machine_source(source: FromMachine, datacenter_id: int, processes: int) -> None:
    if not source.fills_datacenter:
        return  # ordinal: --processes multiplies it, checked once the ordinal is known
    if datacenter_id != 0:
        raise ConfigurationError(datacenter_filled(source))
    if processes > 1:
        raise ConfigurationError(
            f"worker_id {source.value} gives each machine one node id (datacenter and worker "
            "together): processes must be 1, as consecutive worker ids would take the node "
            "ids of neighbouring addresses"
        )


def datacenter_filled(source: FromMachine) -> str:
    """Why a datacenter id may not be given with ``source`` (``ip`` or ``mac``)."""
    # Worded without other options' names: load_settings turns those into flags.
    return (
        f"worker_id {source.value} fills datacenter_id too (both come from the low bits "
        "of the address): leave datacenter_id unset"
    )


def _within(name: str, value: object, low: int, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigurationError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        rule = {0: "must not be negative", 1: "must be positive"}.get(low, f"must be >= {low}")
        rule = f"must be in {low}..{high}" if high is not None else rule
        raise ConfigurationError(f"{name} {rule}, got {value}")


def _seconds(name: str, value: object, *, positive: bool, unbounded: bool) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}")
    if value < 0 or (positive and value == 0):
        rule = "must be positive" if positive else "must not be negative"
        raise ConfigurationError(f"{name} {rule} (a number of seconds), got {value!r}")
    if math.isinf(value) and not unbounded:
        raise ConfigurationError(f"{name} must be a finite number of seconds, got {value!r}")


def _probes(max_lag: float, max_stall: float) -> None:
    _seconds("ready_max_lag", max_lag, positive=True, unbounded=False)
    _seconds("live_max_stall", max_stall, positive=True, unbounded=False)
    if max_stall < MIN_LIVE_MAX_STALL_S:
        raise ConfigurationError(
            f"live_max_stall must be at least {MIN_LIVE_MAX_STALL_S:g} s, got {max_stall:g}: "
            "a shorter one would let a client that holds the serving loop for that long "
            "get the node restarted, and every connection on it dropped, whenever it likes "
            "(an overloaded node leaves the rotation through readiness instead)"
        )
    if max_lag >= max_stall:
        raise ConfigurationError(
            f"ready_max_lag ({max_lag:g} s) must be below live_max_stall ({max_stall:g} s): "
            "a node whose loop stalls must leave the rotation before it is restarted"
        )


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigurationError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
