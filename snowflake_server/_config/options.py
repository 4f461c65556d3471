"""Server settings from flags, ``SNOWFLAKE_*`` environment variables or a TOML file.

One table, :data:`OPTIONS`, defines every setting once; it drives the flags,
the environment variable names, the file keys, ``--help`` (in the groups of
:data:`GROUPS`) and the options table in ``docs/configuration.md``. Precedence:
flag, then environment, then file (``--config`` / ``SNOWFLAKE_CONFIG``), then
default. Nothing is read at import time: call :func:`load_settings`.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .._errors import ConfigurationError
from .._version import __version__
from .settings import (
    AUTO_WORKER_ID,
    LOG_FORMATS,
    LOG_LEVELS,
    MAX_NATIVE_THREADS,
    FromMachine,
    ServerSettings,
    datacenter_filled,
)

__all__ = [
    "ENV_PREFIX",
    "GROUPS",
    "OPTIONS",
    "Option",
    "build_parser",
    "default_state_dir",
    "in_flags",
    "load_settings",
    "worker_id_text",
]

ENV_PREFIX = "SNOWFLAKE_"


def default_state_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_STATE_HOME/snowflake``, else ``~/.local/state/snowflake``."""
    base = environ.get("XDG_STATE_HOME") or str(Path(environ.get("HOME", "~")) / ".local/state")
    return Path(base).expanduser() / "snowflake"


def _worker_id(text: str) -> int | FromMachine:
    word = text.strip().lower()
    if word == "auto":
        return AUTO_WORKER_ID
    try:
        return FromMachine(word)
    except ValueError:
        pass
    if not _INTEGER.fullmatch(text.strip()):
        raise ValueError("must be a number, auto, ordinal, ip or mac")
    return _integer(text)


def _native_threads(text: str) -> int | None:
    if text.strip().lower() == "auto":
        return None
    return _integer(text)


def worker_id_text(value: int | FromMachine) -> str:
    """``--worker-id``'s text for ``value``: what :func:`_worker_id` reads back."""
    if isinstance(value, FromMachine):
        return value.value
    return "auto" if value == AUTO_WORKER_ID else str(value)


_INTEGER = re.compile(r"[+-]?[0-9]+")
_MAX_DIGITS = 19  # every setting fits a signed 64-bit integer
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?inf")
# What Kubernetes injects for a Service named after a setting (SNOWFLAKE_PORT for a
# Service "snowflake", SNOWFLAKE_METRICS_PORT for "snowflake-metrics"): a service link.
_SERVICE_LINK = re.compile(r"(tcp|udp|sctp)://[^/\s]+:[0-9]+")


def _integer(text: str) -> int:
    """A plain decimal integer: not ``1_0``, ``0x10`` or ``1e3``, which ``int`` reads."""
    stripped = text.strip()
    if not _INTEGER.fullmatch(stripped):
        raise ValueError(f"must be a whole number in decimal digits{_link_hint(stripped)}")
    if len(stripped.lstrip("+-")) > _MAX_DIGITS:
        raise ValueError(f"must be a whole number of at most {_MAX_DIGITS} digits")
    return int(stripped)


def _number(text: str) -> float:
    """A decimal number of seconds (``inf`` allowed where the setting allows it)."""
    stripped = text.strip().lower()
    if not _NUMBER.fullmatch(stripped):
        raise ValueError(f"must be a number like 2 or 0.5{_link_hint(stripped)}")
    value = float(stripped)
    assert not math.isnan(value)  # the pattern has no nan
    return value


def _link_hint(text: str) -> str:
    if not _SERVICE_LINK.fullmatch(text):
        return ""
    return (
        ". This looks like a Kubernetes service link, not a setting: a Service named "
        "after this variable (snowflake, snowflake-metrics, ...) makes Kubernetes set it "
        "in every pod of the namespace. Set enableServiceLinks: false in the pod spec "
        "(the shipped manifests do), or rename the Service"
    )


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be true or false")


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its field in ``ServerSettings``, how to parse it, what it does.

    A switch (``parse`` is ``_bool``) is a flag without a value; its
    environment variable takes true/false, 1/0, yes/no.
    """

    name: str
    parse: Callable[[str], Any]
    help: str
    metavar: str = ""

    @property
    def is_switch(self) -> bool:
        return self.parse is _bool

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("host", str, "Address to serve Thrift on; 0.0.0.0 for every interface.", "ADDR"),
    Option("port", _integer, "Thrift port; 0 picks a free one (printed at start).", "PORT"),
    Option("transport", str,
           "Thrift transport: framed (what Twitter's clients speak) or buffered.",
           "{framed,buffered}"),
    Option("idle_timeout", _number,
           "Close a client connection idle for this many seconds (within a quarter more); "
           "0 never.", "SECONDS"),
    Option("request_timeout", _number,
           "Close a client connection whose request (a Thrift frame, an HTTP request line "
           "and headers) is not whole this many seconds after its first byte (within a "
           "quarter more), however it trickles in; 0 never.", "SECONDS"),
    Option("datacenter_id", _integer, "Datacenter id of this server (0..31 by default).", "N"),
    Option("worker_id", _worker_id,
           "Worker id of this server, unique within its datacenter (0..31 by default); "
           "'auto' leases the lowest free one from ZooKeeper; 'ordinal' takes the host "
           "name's trailing number (pod snowflake-7: worker 7); 'ip' and 'mac' take the "
           "datacenter and worker ids together from the low bits of this host's IPv4 "
           "address (--advertise-host, or the first interface's) or its interface's MAC "
           "address.", "{N,auto,ordinal,ip,mac}"),
    Option("force_node_id", _bool,
           "With --worker-id ip or mac: use an address that is refused by default "
           "(loopback; an all-zero, multicast or locally administered MAC, as containers "
           "and VMs make up) as if it were this host's own."),
    Option("epoch", _integer, "Epoch of the ids' timestamps, in ms since the Unix epoch.", "MS"),
    Option("timestamp_bits", _integer, "Bits of an id holding ms since the epoch.", "N"),
    Option("datacenter_id_bits", _integer, "Bits of an id holding the datacenter id.", "N"),
    Option("worker_id_bits", _integer, "Bits of an id holding the worker id.", "N"),
    Option("sequence_bits", _integer, "Bits of an id holding the per-ms sequence.", "N"),
    Option("clock_sequence_bits", _integer,
           "Bits of an id holding a clock sequence, between the timestamp and the "
           "datacenter id (0: none; take them from the datacenter or worker bits). On a "
           "clock step back beyond --max-backwards-ms, and at a start with the clock "
           "behind the high-water mark, the server moves to another clock-sequence value "
           "instead of refusing or waiting: ids stay unique but are then no longer "
           "increasing on this worker.", "N"),
    Option("max_backwards_ms", _integer,
           "A clock step back of at most this many ms is waited out; a larger one is "
           "refused with InvalidSystemClock. 0: always refuse (Twitter's behaviour). "
           "At most 60000.", "MS"),
    Option("metrics_host", str, "Address of the Prometheus metrics and health endpoint.", "ADDR"),
    Option("metrics_port", _integer,
           "Port of /metrics, /livez and /readyz (and /health, its old name); 0 picks a free "
           "one.", "PORT"),
    Option("max_agents", _integer,
           "Distinct user agents that get their own metrics label; the rest share one.", "N"),
    Option("log_level", str, "Logging threshold.",
           "{" + ",".join(LOG_LEVELS) + "}"),
    Option("log_format", str,
           "Log lines as text, or as JSON objects (one per line: time in UTC, level, "
           "logger, message and the event's fields).", "{" + ",".join(LOG_FORMATS) + "}"),
    Option("log_file", str,
           "Append the log to this file instead of standard error; SIGHUP reopens it "
           "(for log rotation).", "FILE"),
    Option("drain_seconds", _number,
           "On SIGTERM, report not ready (/readyz 503) at once but serve on for this "
           "many seconds, so that load balancers and clients move away first; then stop "
           "accepting and finish the calls in flight. 0: stop at once.", "SECONDS"),
    Option("ready_max_lag", _number,
           "Report not ready (/readyz 503, reason overloaded) while the serving loop lags "
           "more than this: the median over 5 s of how late its 0.1 s timer fires; ready "
           "again once it is back to half of this. One slow moment never counts, a loop "
           "stalled for 2.4 s does.", "SECONDS"),
    Option("live_max_stall", _number,
           "Report the process wedged (/livez 503: restart it) once its serving loop has "
           "not turned for this long. At least 10 s, so that no client can get nodes "
           "restarted cheaply; an overloaded node leaves the rotation by readiness "
           "instead.", "SECONDS"),
    Option("state_dir", str,
           "Directory of the state files holding each worker's high-water mark "
           "(default: $XDG_STATE_HOME/snowflake or ~/.local/state/snowflake).", "DIR"),
    Option("max_startup_wait", _number,
           "At start, wait at most this long for a clock that is behind the stored "
           "high-water mark; further behind, refuse to start.", "SECONDS"),
    Option("sequence_start", str,
           "Start each ms at sequence 0 (Twitter) or at a random 0..99 (Leaf), which "
           "spreads id %% 100 evenly at low traffic.", "{zero,random}"),
    Option("discard_corrupt_state", _bool,
           "Start even if the state file is unreadable or corrupt, as if it were "
           "missing. Only when the clock is surely past every id this worker issued."),
    Option("first_start_wait", _number,
           "Before the first id of a worker id with no high-water mark (standalone: no state "
           "file; in cluster mode: none in ZooKeeper, whatever the state file holds, since "
           "another node may have used the id before ZooKeeper lost its data), wait this long, "
           "so that a clock behind by less cannot repeat ids of a lost state or of that node "
           "(Twitter slept at every start). Default: 5 s standalone; in cluster mode "
           "--zk-session-timeout + --max-peer-skew (10 s if inf). 0: no wait.", "SECONDS"),
    Option("host_lock_scope", str,
           "Name of the host-wide worker lock's scope: two servers on one host (one network "
           "namespace) with one (datacenter, worker) and the same scope refuse to run at "
           "once, whatever their --state-dir. Only for tests that run many servers at once.",
           "NAME"),
    Option("zookeeper", str,
           "Cluster mode: ZooKeeper ensemble to register in, HOST:PORT[,HOST:PORT...]. "
           "Empty: standalone.", "HOSTS"),
    Option("zk_path", str, "ZooKeeper path under which nodes register.", "PATH"),
    Option("advertise_host", str,
           "Address peers and clients should dial (default: --host, or this host's "
           "name when --host is a wildcard).", "ADDR"),
    Option("advertise_port", _integer, "Port peers and clients should dial (default: the "
           "Thrift port bound).", "PORT"),
    Option("max_peer_skew", _number,
           "Refuse to start if our clock is further than this from the mean of the "
           "registered peers' clocks.", "SECONDS"),
    Option("skip_sanity_checks", _bool,
           "Start without asking registered peers for their ids and clocks (an "
           "unreachable peer then does not block start-up)."),
    Option("zk_session_timeout", _number,
           "ZooKeeper session timeout; it must lie within the ensemble's min and max "
           "session timeouts. Ids stop 0.9 x this long after ZooKeeper last confirmed "
           "our registration.",
           "SECONDS"),
    Option("zk_connect_timeout", _number,
           "At start, refuse if ZooKeeper cannot be reached within this time.", "SECONDS"),
    Option("zk_auth", str,
           "Authenticate to ZooKeeper: none; sasl (DIGEST-MD5, a user of the ensemble's "
           "JAAS file); digest. With sasl or digest every znode the service creates lets "
           "only the service's identity write it, and a node refuses to start when its "
           "credentials are refused or existing znodes let others write.",
           "{none,sasl,digest}"),
    Option("zk_credentials_file", str,
           "File of the ZooKeeper credentials (user = ..., password = ...; chmod 600, or "
           "0440 in this user's own group as kubelet mounts a Secret under fsGroup: any "
           "other access for group or others is refused); see docs/operations.md.", "FILE"),
    Option("zk_read_acl", str,
           "Who may read the service's znodes: world (discovery clients without "
           "credentials) or service (only the service's identities and the credentials "
           "file's reader ones).", "{world,service}"),
    Option("zk_open_acl", _bool,
           "Migration to ZooKeeper ACLs only: authenticate, but create znodes anyone may "
           "write and accept such ones, so nodes without credentials keep working; drop it "
           "once snowflake zk-acl has locked the tree."),
    Option("zk_tls_ca", str,
           "Reach ZooKeeper over TLS (its secureClientPort), trusting the servers' "
           "certificates signed by this CA (PEM); each must name the host dialled in "
           "--zookeeper (hostname verification is always on). Empty: plain TCP.", "FILE"),
    Option("zk_tls_cert", str,
           "With --zk-tls-ca: present this client certificate (PEM) to ZooKeeper, for "
           "servers that require one (ssl.clientAuth). Read again at each reconnection: "
           "replace the files in place to rotate it.", "FILE"),
    Option("zk_tls_key", str, "The private key of --zk-tls-cert (PEM).", "FILE"),
    Option("max_connections", _integer,
           "Thrift connections served at once; further ones are closed at once and "
           "counted (a few more are kept for joining nodes' peer checks).", "N"),
    Option("http_max_connections", _integer,
           "HTTP/JSON API connections served at once, apart from the Thrift ones; further "
           "ones are closed at once and counted.", "N"),
    Option("max_batch", _integer,
           "Most ids one get_ids call may ask for, whatever the layout (at most "
           "2^sequence_bits are made per ms).", "N"),
    Option("max_frame_size", _integer,
           "Largest request accepted, in bytes; a larger frame is refused before it is "
           "read.", "BYTES"),
    Option("tls_cert", str, "Serve TLS with this certificate (PEM; may hold the key).", "FILE"),
    Option("tls_key", str, "The private key of --tls-cert, if in its own file.", "FILE"),
    Option("tls_client_ca", str,
           "Require a client certificate signed by this CA (mutual TLS).", "FILE"),
    Option("web_config_file", str,
           "The admin endpoint's web configuration, as Prometheus exporters read it "
           "(YAML: tls_server_config for HTTPS and client certificates, basic_auth_users "
           "with bcrypt hashes); checked at start, read again on SIGHUP. /livez and "
           "/readyz need no certificate or password.", "FILE"),
    Option("audit_log", str,
           "Append one JSON line per id issued to this file (off the id path; entries "
           "are dropped, and counted, if the disk falls behind).", "FILE"),
    Option("audit_queue", _integer,
           "Audit entries that may wait in memory before new ones are dropped.", "N"),
    Option("http_port", _integer,
           "Serve the HTTP/JSON API (/v1/id, /v1/ids, /v1/decode/ID, /v1/layout) on this "
           "port; 0 picks a free one; -1: off.", "PORT"),
    Option("http_host", str, "Address of the HTTP/JSON API.", "ADDR"),
    Option("processes", _integer,
           "Run this many server processes on the one port (SO_REUSEPORT), each with its "
           "own worker id: consecutive from --worker-id (from ordinal x N with ordinal), or "
           "leased with auto.", "N"),
    Option("reuse_port", _bool,
           "Let several processes listen on --port (SO_REUSEPORT); --processes sets it."),
    Option("native_threads", _native_threads,
           "Threads of the native core answering get_id on the Thrift port (framed, "
           "without TLS) beside the Python server, which serves everything else; 'auto' "
           "(the default): the CPUs this process may use divided by --processes, at "
           f"least 1; 0: Python serves every request. At most {MAX_NATIVE_THREADS}. "
           "Without the native core built (or with SNOWFLAKE_NO_NATIVE=1 in the "
           "environment) Python serves, whatever this says.", "N"),
)  # fmt: skip

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("server", ("host", "port", "transport", "idle_timeout", "request_timeout", "processes",
                "reuse_port", "native_threads", "drain_seconds", "http_host", "http_port")),
    ("ids & layout", ("datacenter_id", "worker_id", "force_node_id", "epoch", "timestamp_bits",
                      "datacenter_id_bits", "worker_id_bits", "sequence_bits",
                      "clock_sequence_bits", "sequence_start")),
    ("clock & state", ("max_backwards_ms", "state_dir", "max_startup_wait",
                       "discard_corrupt_state", "first_start_wait", "host_lock_scope")),
    ("cluster", ("zookeeper", "zk_path", "advertise_host", "advertise_port", "max_peer_skew",
                 "skip_sanity_checks", "zk_session_timeout", "zk_connect_timeout",
                 "zk_auth", "zk_credentials_file", "zk_read_acl", "zk_open_acl",
                 "zk_tls_ca", "zk_tls_cert", "zk_tls_key")),
    ("security", ("tls_cert", "tls_key", "tls_client_ca", "web_config_file", "audit_log",
                  "audit_queue")),
    ("limits", ("max_connections", "http_max_connections", "max_frame_size", "max_batch",
                "max_agents")),
    ("observability", ("metrics_host", "metrics_port", "ready_max_lag", "live_max_stall",
                       "log_level", "log_format", "log_file")),
)  # fmt: skip
"""The ``--help`` sections, each naming its options in the order shown."""

_BY_NAME = {option.name: option for option in OPTIONS}
_DEFAULTS = ServerSettings()
assert set(_BY_NAME) == {f.name for f in fields(ServerSettings)}, "OPTIONS, ServerSettings differ"
assert sorted(n for _, names in GROUPS for n in names) == sorted(_BY_NAME), "GROUPS, OPTIONS differ"


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """``; did you mean X?`` for the closest of ``known`` to a mistyped ``word``, or ``""``."""
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


class _Parser(argparse.ArgumentParser):
    """argparse, saying which flag a mistyped one was probably meant to be."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flags = [f for action in self._actions for f in action.option_strings]
            first = unknown[0]
            word = first.split("=", 1)[0]
            hint = did_you_mean(word, flags) if word.startswith("-") else ""
            self.error(f"unknown argument {first!r}{hint}")
        return parsed


def build_parser(prog: str = "snowflake-server") -> argparse.ArgumentParser:
    """The ``snowflake-server`` argument parser; every flag also has an environment variable."""
    parser = _Parser(
        prog=prog,
        description="Serve unique, time-ordered 64-bit ids over Thrift (Twitter Snowflake "
        "compatible). Precedence: flag, environment, config file, default.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML file of settings, keys as the flags without '--' (env {ENV_PREFIX}CONFIG)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    for title, names in GROUPS:
        group = parser.add_argument_group(title)
        for name in names:
            option = _BY_NAME[name]
            default = getattr(_DEFAULTS, option.name)
            shown = f"; default {default}" if default not in ("", None) else ""
            help_text = f"{option.help} (env {option.env}{shown})"
            if option.is_switch:
                group.add_argument(
                    option.flag, dest=option.name, action="store_const", const="true",
                    help=help_text,
                )  # fmt: skip
            else:
                group.add_argument(
                    option.flag, dest=option.name, metavar=option.metavar, help=help_text
                )
    return parser


def _convert(option: Option, value: object, source: str) -> Any:
    try:
        if isinstance(value, str):
            return option.parse(value)
        default = getattr(_DEFAULTS, option.name)
        # A default of None is derived from other settings; the value is still a number.
        kind = float if default is None else type(default)
        if kind is bool and isinstance(value, bool):
            return value
        # TOML values come typed: accept an int where a float is due, nothing looser.
        if isinstance(value, bool) or not isinstance(value, (kind, int)):
            raise ValueError(f"must be {_KIND_NAMES[kind]}")
        return option.parse(str(value))
    except ValueError as e:
        raise ConfigurationError(f"{source}: invalid value {value!r}: {e}") from None


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _read_file(path: str) -> dict[str, object]:
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigurationError(f"config file {path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigurationError(f"config file {path}: not valid TOML: {e}") from None
    out: dict[str, object] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in _BY_NAME:
            hint = did_you_mean(name, list(_BY_NAME))
            raise ConfigurationError(f"config file {path}: unknown setting {key!r}{hint}")
        out[name] = value
    return out


def load_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServerSettings:
    """Build the settings from ``argv`` (flags), ``environ`` and the config file.

    Raises ``ConfigurationError`` naming the flag, variable or file key at fault;
    argparse exits for ``--help`` and for unknown flags.
    """
    environ = {} if environ is None else environ
    args = build_parser().parse_args(argv)
    config_path = args.config or environ.get(ENV_PREFIX + "CONFIG")
    from_file = _read_file(config_path) if config_path else {}
    values: dict[str, Any] = {}
    origin: dict[str, tuple[str, object]] = {}  # name -> (where it was set, its raw value)
    for option in OPTIONS:
        flag_value = getattr(args, option.name)
        if flag_value is not None:
            origin[option.name] = (option.flag, flag_value)
        elif option.env in environ:
            origin[option.name] = (option.env, environ[option.env])
        elif option.name in from_file:
            origin[option.name] = (
                f"config file {config_path}: {option.name}",
                from_file[option.name],
            )
        else:
            continue
        where, raw = origin[option.name]
        values[option.name] = _convert(option, raw, where)
    if not values.get("state_dir"):
        values["state_dir"] = str(default_state_dir(environ))
    try:
        settings = ServerSettings(**values)
        source = settings.worker_id
        # The settings cannot tell a datacenter id of 0 from none; the options can.
        if (
            isinstance(source, FromMachine)
            and source.fills_datacenter
            and "datacenter_id" in origin
        ):
            raise ConfigurationError(datacenter_filled(source))
        return settings
    except ConfigurationError as e:
        # Settings name their fields; say where the values at fault were set.
        named = [o for o in OPTIONS if re.search(rf"\b{o.name}(_ms)?\b", str(e))]
        given = [o for o in named if o.name in origin]
        if len(named) == 1 and given:
            where, raw = origin[given[0].name]
            raise ConfigurationError(f"{where}: invalid value {raw!r}: {e}") from None
        # Several settings at fault (a layout, a combination): name them as flags.
        message = in_flags(str(e))
        where = "; ".join(origin[o.name][0] for o in given if origin[o.name][0] != o.flag)
        raise ConfigurationError(f"{message} (set by {where})" if where else message) from None


def in_flags(message: str) -> str:
    """``message`` of a ``ConfigurationError`` from the settings, each setting it names
    (``zk_tls_cert``) said as its flag (``--zk-tls-cert``)."""
    for option in OPTIONS:
        message = re.sub(rf"\b{option.name}\b", option.flag, message)
    return message
