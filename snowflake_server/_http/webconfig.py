"""The admin endpoint's web configuration: the Prometheus exporters' file
(exporter-toolkit's ``--web.config.file``), read by ``--web-config-file``.

::

    tls_server_config:                 # HTTPS on the admin port
      cert_file: /etc/snowflake/admin.pem
      key_file: /etc/snowflake/admin-key.pem
      client_auth_type: RequireAndVerifyClientCert   # optional: mutual TLS
      client_ca_file: /etc/snowflake/prometheus-ca.pem
      min_version: TLS12
    http_server_config:
      headers: {X-Content-Type-Options: nosniff}
    basic_auth_users:                  # optional: user -> bcrypt hash
      prometheus: $2b$10$...

:func:`load_web_config` accepts what ``promtool check web-config`` (Prometheus 2.42)
accepts and refuses, with a ``ConfigurationError`` naming the key, what it refuses:
unknown keys, values of the wrong type, unknown versions, ciphers, curves and
client-auth types, files that do not load, hashes that are not bcrypt; any file it
cannot read, whatever is in it, is a ``ConfigurationError``, never another exception.
Four things promtool accepts are refused here, each because this server cannot or
should not do what the file asks: ``RequireAnyClientCert`` (any certificate,
unverified: Python's TLS cannot take a certificate it does not verify; use
``RequireAndVerifyClientCert``); a ``min_version`` above ``max_version`` (no handshake
could succeed); ``RequireAndVerifyClientCert`` or ``VerifyClientCertIfGiven`` without
``client_ca_file`` (Go, and so exporter-toolkit, then verifies client certificates
against the system's roots: any publicly trusted certificate would pass); and bcrypt
hashes of a cost above 12 (Go takes up to 31: each check would cost seconds of CPU,
and a client with wrong passwords could keep the checking thread busy). Relative paths
are relative to the file's folder, as exporter-toolkit reads them.

Differences a client can see: ``RequireAndVerifyClientCert`` asks for a certificate
during the handshake and verifies any certificate given, but a client without one
still completes it and then gets 403 for everything except the probes (``/livez``,
``/readyz``, ``/health``): a kubelet or a container health check presents none (see
docs/operations.md). ``http2`` is accepted and ignored (the endpoint speaks HTTP/1.1,
which every scraper speaks); with several ``curve_preferences`` OpenSSL's own order
applies (one curve: only that one).

:class:`BasicAuth` checks the users' passwords. A bcrypt check costs about 50 ms of
CPU (cost 10), so it is priced: a password that passed is remembered (an LRU of keyed
digests, never the password), so a scraper pays once, not at every scrape; each client
(source address; an IPv6 /64) may start ``client_checks_per_s`` checks a second (a
burst of 3) and have one in flight, all clients together ``checks_per_s`` (a burst of
as many) with at most ``max_pending`` waiting for the checking thread. Beyond any of
these the answer is 429, so a client guessing passwords spends its own budget, not the
CPU nor the budget of Prometheus scraping from another address.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import re
import reprlib
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import yaml

from .._errors import ConfigurationError

__all__ = ["PROBE_PATHS", "BasicAuth", "WebConfig", "load_web_config"]

log = logging.getLogger(__name__)

PROBE_PATHS = frozenset({"/livez", "/readyz", "/health"})
"""Served without credentials or a client certificate: orchestrators present neither."""

_TOP = frozenset({"tls_server_config", "http_server_config", "basic_auth_users"})
_TLS = frozenset({
    "cert_file", "key_file", "client_auth_type", "client_ca_file", "cipher_suites",
    "curve_preferences", "min_version", "max_version", "prefer_server_cipher_suites",
})  # fmt: skip
_HTTP = frozenset({"http2", "headers"})
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go's names (crypto/tls) of the TLS 1.2 suites, as OpenSSL calls them. Go's TLS 1.3 names
# are accepted and, as in Go, change nothing: TLS 1.3's suites are not configurable.
_CIPHERS = {
    "TLS_RSA_WITH_RC4_128_SHA": "RC4-SHA",
    "TLS_RSA_WITH_3DES_EDE_CBC_SHA": "DES-CBC3-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA": "ECDHE-ECDSA-RC4-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_RC4_128_SHA": "ECDHE-RSA-RC4-SHA",
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA": "ECDHE-RSA-DES-CBC3-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
_TLS13_CIPHERS = frozenset(
    {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}
)
_CURVES = {
    "CurveP256": "prime256v1",
    "CurveP384": "secp384r1",
    "CurveP521": "secp521r1",
    "X25519": "X25519",
}
_CLIENT_AUTH = ("NoClientCert", "RequestClientCert", "RequireAnyClientCert",
                "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")  # fmt: skip
# exporter-toolkit's list: the headers it lets a file set, and the values some may take.
_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
# What Go's crypto/bcrypt reads: $2a$/$2b$/$2y$, a cost of 4..31, 53 characters of salt+hash.
_BCRYPT = re.compile(rb"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
# Cost 12 is about 0.2 s of CPU a check here, 13 about 0.4 s, each step doubling: above 12
# a handful of wrong passwords a second would take a core.
MAX_BCRYPT_COST = 12
_DEFAULT_COST = 10
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother = 3, 60, 60
_MAX_PASSWORD = 72  # bcrypt's limit: longer ones are refused (bcrypt 5 raises, Go errs)


@dataclass(frozen=True)
class WebConfig:
    """A checked web configuration: ``tls`` (None: plain HTTP), whether a client
    certificate is required beyond the probes, the users (name -> bcrypt hash) and
    the headers every answer carries."""

    path: str
    tls: ssl.SSLContext | None = None
    require_client_cert: bool = False
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


def load_web_config(path: str) -> WebConfig:
    """Read and check the web configuration at ``path``; raises ``ConfigurationError``
    (``--web-config-file PATH: ...``) naming what is wrong."""
    where = f"--web-config-file {path}"
    try:
        return _load(path)
    except _Invalid as e:
        raise ConfigurationError(f"{where}: {e}") from None
    except RecursionError:
        raise ConfigurationError(f"{where}: nested too deeply to read") from None
    except Exception as e:  # whatever a file makes the loader raise
        # A file is input: what it holds must never crash the start or a SIGHUP.
        raise ConfigurationError(
            f"{where}: cannot be read: {type(e).__name__}: {_SHOW.repr(str(e))}"
        ) from e


def _load(path: str) -> WebConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise _Invalid(f"cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise _Invalid("not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _Invalid(f"not valid YAML: {e}") from None
    return _config(path, {} if data is None else data, Path(path).parent)


class _Invalid(Exception):
    """What is wrong with the file, worded for its reader (the path is added)."""


def _show(value: object) -> str:
    """``value`` for a message: shortened, so a huge or deep value stays one short line."""
    return _SHOW.repr(value)


def _config(path: str, data: object, base: Path) -> WebConfig:
    top = _mapping(data, "the file", _TOP)
    tls, require = _tls(_mapping(top.get("tls_server_config"), "tls_server_config", _TLS), base)
    http = _mapping(top.get("http_server_config"), "http_server_config", _HTTP)
    _typed(http, "http_server_config", "http2", bool)
    headers = _headers(http.get("headers"))
    return WebConfig(path, tls, require, _users(top.get("basic_auth_users")), headers)


def _mapping(value: object, name: str, keys: frozenset[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Invalid(f"{name} must be a mapping, got {_show(value)}")
    for key in value:
        if key not in keys:
            raise _Invalid(f"unknown key {_show(key)} in {name} (known: {', '.join(sorted(keys))})")
    return value


def _typed(values: Mapping[str, Any], where: str, key: str, kind: type) -> Any:
    value = values.get(key)
    if value is not None and not isinstance(value, kind):
        want = {str: "a string", bool: "true or false", list: "a list"}[kind]
        raise _Invalid(f"{where}.{key} must be {want}, got {_show(value)}")
    return value


def _strings(values: Mapping[str, Any], key: str) -> list[str]:
    items = _typed(values, "tls_server_config", key, list) or []
    for item in items:
        if not isinstance(item, str):
            raise _Invalid(f"tls_server_config.{key} must be a list of names, got {_show(item)}")
    return list(items)


def _tls(values: Mapping[str, Any], base: Path) -> tuple[ssl.SSLContext | None, bool]:
    cert, key, auth, client_ca = (
        _typed(values, "tls_server_config", name, str) or ""
        for name in ("cert_file", "key_file", "client_auth_type", "client_ca_file")
    )
    if not (cert or key or auth or client_ca):
        return None, False  # as exporter-toolkit: no TLS settings, plain HTTP
    if not cert:
        raise _Invalid("tls_server_config: missing cert_file")
    if not key:
        raise _Invalid("tls_server_config: missing key_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    low = _version(values, "min_version", "TLS12")
    high = _version(values, "max_version", "TLS13")
    if low > high:
        raise _Invalid(
            f"tls_server_config: min_version {_show(values['min_version'])} is above "
            f"max_version {_show(values['max_version'])}: no handshake could succeed"
        )
    context.minimum_version, context.maximum_version = low, high
    try:
        context.load_cert_chain(base / cert, base / key)
    except (OSError, ssl.SSLError, ValueError) as e:
        raise _Invalid(f"tls_server_config: cert_file {cert} / key_file {key}: {_why(e)}") from None
    require = _client_auth(context, auth or "NoClientCert", client_ca, base)
    _ciphers(context, _strings(values, "cipher_suites"))
    curves = _strings(values, "curve_preferences")
    for curve in curves:
        if curve not in _CURVES:
            raise _Invalid(f"tls_server_config.curve_preferences: unknown curve {_show(curve)} "
                           f"(known: {', '.join(_CURVES)})")  # fmt: skip
    if len(curves) == 1:
        try:
            context.set_ecdh_curve(_CURVES[curves[0]])
        except ssl.SSLError:
            # Python before 3.11.5 (Debian 12's) sets only the NIST curves here, not X25519
            # (EC: UNKNOWN_GROUP); OpenSSL's own order, X25519 first, applies then.
            log.warning(
                "--web-config-file: curve_preferences %s cannot be set by this Python's ssl "
                "module; OpenSSL's default order applies (X25519 first)", curves[0],
            )  # fmt: skip
    if _typed(values, "tls_server_config", "prefer_server_cipher_suites", bool) is not False:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE  # exporter-toolkit's default
    return context, require


def _version(values: Mapping[str, Any], key: str, default: str) -> ssl.TLSVersion:
    name = values.get(key)
    if name is None:
        name = default
    if not isinstance(name, str) or name not in _VERSIONS:
        raise _Invalid(f"tls_server_config.{key}: unknown TLS version {_show(name)} "
                       f"(known: {', '.join(_VERSIONS)})")  # fmt: skip
    return _VERSIONS[name]


def _client_auth(context: ssl.SSLContext, auth: str, client_ca: str, base: Path) -> bool:
    """Sets how ``context`` asks for client certificates; whether one is required."""
    if auth not in _CLIENT_AUTH and auth != "RequireClientCert":
        raise _Invalid(f"tls_server_config.client_auth_type: unknown value {_show(auth)} "
                       f"(known: {', '.join(_CLIENT_AUTH)})")  # fmt: skip
    if auth in ("RequireAnyClientCert", "RequireClientCert"):
        raise _Invalid(
            f"tls_server_config.client_auth_type {auth} takes any certificate without "
            "verifying it, which this server does not do: use RequireAndVerifyClientCert "
            "with client_ca_file"
        )
    if client_ca and auth == "NoClientCert":
        raise _Invalid(
            "tls_server_config: client_ca_file is given without a client_auth_type: "
            "set client_auth_type RequireAndVerifyClientCert (or VerifyClientCertIfGiven)"
        )
    if auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert"):
        if not client_ca:
            # Go (exporter-toolkit) would verify against the system's roots: any publicly
            # trusted certificate, of anyone, would pass for Prometheus.
            raise _Invalid(
                f"tls_server_config.client_auth_type {auth} needs client_ca_file (the CA "
                "that issues the scrapers' certificates): without it any certificate of a "
                "publicly trusted CA would be taken"
            )
        # Optional at the handshake even when required: the probes must get through
        # without one; every other path asks for it (AdminServer).
        context.verify_mode = ssl.CERT_OPTIONAL
        try:
            context.load_verify_locations(cafile=base / client_ca)
        except (OSError, ssl.SSLError, ValueError) as e:
            raise _Invalid(f"tls_server_config.client_ca_file {client_ca}: {_why(e)}") from None
    # RequestClientCert asks for a certificate and never verifies or uses it: as none.
    return auth == "RequireAndVerifyClientCert"


def _ciphers(context: ssl.SSLContext, names: list[str]) -> None:
    chosen = []
    for name in names:
        if name in _TLS13_CIPHERS:
            continue
        if name not in _CIPHERS:
            raise _Invalid(f"tls_server_config.cipher_suites: unknown cipher {_show(name)} "
                           "(Go's names, e.g. TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256)")  # fmt: skip
        chosen.append(_CIPHERS[name])
    if not chosen:
        return
    try:
        context.set_ciphers(":".join(chosen))
    except ssl.SSLError:
        raise _Invalid(
            f"tls_server_config.cipher_suites: none of {', '.join(names)} is available in "
            f"this server's OpenSSL ({ssl.OPENSSL_VERSION})"
        ) from None


def _headers(value: object) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _Invalid(f"http_server_config.headers must be a mapping, got {_show(value)}")
    headers = []
    for name, text in value.items():
        if name not in _HEADERS:
            raise _Invalid(f"http_server_config.headers: {_show(name)} cannot be set "
                           f"(these can: {', '.join(_HEADERS)})")  # fmt: skip
        allowed = _HEADERS[name]
        if not isinstance(text, str) or "\r" in text or "\n" in text:
            raise _Invalid(f"http_server_config.headers.{name} must be one line, got {_show(text)}")
        if allowed is not None and text not in allowed:
            raise _Invalid(f"http_server_config.headers.{name} must be one of "
                           f"{', '.join(allowed)}, got {_show(text)}")  # fmt: skip
        headers.append((name, text))
    return tuple(headers)


def _users(value: object) -> dict[str, bytes]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Invalid(
            f"basic_auth_users must be a mapping of user to bcrypt hash, got {_show(value)}"
        )
    users = {}
    for name, hashed in value.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise _Invalid(f"basic_auth_users: {_show(name)} is not a user name (text without ':')")
        data = hashed.encode() if isinstance(hashed, str) else b""
        matched = _BCRYPT.fullmatch(data)
        if matched is None:
            raise _Invalid(
                f"basic_auth_users.{name}: not a bcrypt hash ($2b$10$ and 53 characters; "
                "make one with: htpasswd -nBC 10 '' | tr -d ':\\n', or Python's "
                "bcrypt.hashpw(password, bcrypt.gensalt()))"
            )
        cost = int(matched.group(1))
        if cost > MAX_BCRYPT_COST:
            raise _Invalid(
                f"basic_auth_users.{name}: bcrypt cost {cost} is above {MAX_BCRYPT_COST}: "
                f"each check would cost about {0.05 * 2 ** (cost - 10):.1f} s of CPU, so a "
                "few wrong passwords a second would take the server's CPU; hash it again "
                "with a cost of 10 (htpasswd -nBC 10)"
            )
        users[name] = data
    return users


def _why(error: Exception) -> str:
    if isinstance(error, ValueError):
        return f"not a path: {error}"
    if isinstance(error, ssl.SSLError):
        return f"cannot load it: not PEM, or the key does not match ({error.reason or error})"
    assert isinstance(error, OSError)
    return f"cannot read it: {error.strerror or error}"


class _Bucket:
    """A token bucket: ``rate`` tokens a second, at most ``burst`` held."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now

    def refill(self, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        return self.tokens


def client_key(address: str) -> str:
    """Whose budget a check from ``address`` spends: the address, an IPv6 one's /64
    (one host usually has a whole /64 to draw from)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class BasicAuth:
    """HTTP basic authentication against bcrypt hashes, its cost bounded and shared fairly.

    :meth:`remembered` answers from the cache (no bcrypt). Otherwise the caller
    asks for a check (:meth:`ask`) for a client, then calls :meth:`dispatch` (now, after each
    :meth:`checked`, and at :meth:`next_event`): it says which clients' checks start
    now and which were turned away (429). :meth:`check` runs one (about 50 ms; from a
    worker thread: bcrypt releases the GIL) and :meth:`checked` says it ended.

    Each client (its address, an IPv6 one's /64) has its own bucket
    (``client_checks_per_s``, a burst of 3) and one check in flight or waiting at
    most: a client guessing passwords spends its own budget. All clients together
    draw on one global bucket (``checks_per_s``) and at most ``max_pending`` checks
    run at once. When many addresses guess together they empty the global bucket:
    a check then waits, up to ``wait_s``, and the next global token goes to the
    waiting client whose last check started longest ago (never: first). A scraper
    checking once, among addresses that check every second, is therefore served
    within a token or two instead of being refused (429) as long as the flood lasts.
    Limits: an address not among the last ``max_clients`` to check ranks as never seen,
    so an attacker cycling through more addresses than that (a /52 of IPv6), or
    bringing a never-seen address for every token (six a second by default), ties
    with the scraper, arrival order first; a reload starts the ranking afresh. The
    scraper's password, once checked, is remembered: only its first scrape after a
    start or a reload waits. At most ``max_waiting`` wait; a newcomer that ranks before
    the last of them takes its place. All but :meth:`check` belong to one thread.
    """

    def __init__(
        self,
        users: Mapping[str, bytes],
        *,
        checks_per_s: float = 6.0,
        client_checks_per_s: float = 1.0,
        max_pending: int = 8,
        max_waiting: int = 32,
        wait_s: float = 1.0,
        max_clients: int = 4096,
        remember: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._users = dict(users)
        self._clock = clock
        self._global = _Bucket(checks_per_s, max(1.0, math.ceil(checks_per_s)), clock())
        self._client_rate = client_checks_per_s
        self._client_burst = max(1.0, math.ceil(3 * client_checks_per_s))
        # Least recently asking first; a full bucket is forgotten (a new one is the same).
        self._clients: collections.OrderedDict[str, _Bucket] = collections.OrderedDict()
        self._max_clients = max_clients
        self._in_flight: set[str] = set()
        self._max_pending = max_pending
        # Waiting clients in arrival order, with their deadlines; the turned away.
        self._waiting: dict[str, float] = {}
        self._max_waiting = max_waiting
        self._wait_s = wait_s
        self._turned_away: list[str] = []
        # When each client's last check started, least recent first: its rank in the wait.
        self._started: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._remember = remember
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        # Keyed digests: a memory dump shows no password, nor a hash to attack offline.
        self._key = os.urandom(32)
        # What an unknown user's password is checked against: the cost of the users'
        # hashes, so the time taken does not tell which users exist.
        costs = [int(h[4:6]) for h in self._users.values() if h[4:6].isdigit()]
        self._decoy = bcrypt.hashpw(
            os.urandom(16), bcrypt.gensalt(max(costs, default=_DEFAULT_COST))
        )

    @property
    def pending(self) -> int:
        """Checks in flight (started and not yet :meth:`checked`)."""
        return len(self._in_flight)

    @property
    def waiting(self) -> int:
        """Checks asked for and neither started nor turned away yet."""
        return len(self._waiting)

    def ask(self, client: str) -> bool:
        """Ask for a bcrypt check for ``client`` (an address, see :func:`client_key`):
        False if it is refused at once (its own budget is spent, or it has a check in
        flight or waiting); True if it waits, until :meth:`dispatch` starts it or turns
        it away. Its own token is taken either way it waits."""
        key = client_key(client)
        if key in self._in_flight or key in self._waiting:
            return False
        now = self._clock()
        bucket = self._clients.pop(key, None)
        if bucket is None:
            bucket = _Bucket(self._client_rate, self._client_burst, now)
        self._clients[key] = bucket  # the most recent last
        while len(self._clients) > self._max_clients:
            self._clients.popitem(last=False)
        if bucket.refill(now) < 1:
            return False
        if len(self._waiting) >= self._max_waiting:
            last = max(self._waiting, key=self._rank)
            if self._rank(key) >= self._rank(last):
                return False
            del self._waiting[last]
            self._turned_away.append(last)
        bucket.tokens -= 1
        self._waiting[key] = now + self._wait_s
        return True

    def _rank(self, key: str) -> float:
        # max() and min() keep the first of equals: arrival order breaks ties.
        return self._started.get(key, -math.inf)

    def dispatch(self) -> tuple[list[str], list[str]]:
        """The clients whose checks start now (in flight until :meth:`checked`), and
        those turned away (their wait ended, or a client ranking before them took their
        place): client keys, as :func:`client_key` makes them."""
        now = self._clock()
        away, self._turned_away = self._turned_away, []
        started: list[str] = []
        while (
            self._waiting
            and len(self._in_flight) < self._max_pending
            and self._global.refill(now) >= 1
        ):
            key = min(self._waiting, key=self._rank)
            del self._waiting[key]
            self._global.tokens -= 1
            self._in_flight.add(key)
            self._started.pop(key, None)
            self._started[key] = now
            while len(self._started) > self._max_clients:
                self._started.popitem(last=False)
            started.append(key)
        for key, deadline in list(self._waiting.items()):
            if deadline <= now:
                del self._waiting[key]
                away.append(key)
        return started, away

    def next_event(self) -> float | None:
        """When (on the clock) :meth:`dispatch` may next start or turn away a check:
        the next global token or the first deadline; None with no client waiting."""
        if not self._waiting:
            return None
        now = self._clock()
        event = min(self._waiting.values())
        if len(self._in_flight) < self._max_pending and self._global.rate > 0:
            short = 1 - self._global.refill(now)
            event = min(event, now + max(0.0, short) / self._global.rate)
        return event

    def checked(self, client: str) -> None:
        """The check that :meth:`dispatch` started for ``client`` ended (either way)."""
        key = client_key(client)
        self._in_flight.discard(key)
        self._forget_full(self._clock())

    def _forget_full(self, now: float) -> None:
        # Only the oldest few are looked at: a full bucket is as good as none.
        for key in list(self._clients)[:4]:
            if (
                key not in self._in_flight
                and key not in self._waiting
                and self._clients[key].refill(now) >= self._client_burst
            ):
                del self._clients[key]

    @property
    def enabled(self) -> bool:
        return bool(self._users)

    @staticmethod
    def credentials(header: str | None) -> tuple[str, bytes] | None:
        """The (user, password) of an ``Authorization: Basic ...`` value, or None."""
        if header is None:
            return None
        scheme, _, encoded = header.strip().partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        user, colon, password = decoded.partition(b":")
        if not colon:
            return None
        try:
            return user.decode("utf-8"), password
        except UnicodeDecodeError:
            return None

    def _digest(self, user: str, password: bytes) -> bytes:
        stored = self._users.get(user, b"")
        message = b"\0".join((user.encode(), password, stored))
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def remembered(self, user: str, password: bytes) -> bool:
        """Whether these credentials passed a check lately (no bcrypt)."""
        digest = self._digest(user, password)
        if digest in self._known:
            self._known.move_to_end(digest)
            return True
        return False

    def check(self, user: str, password: bytes) -> bool:
        """Whether ``password`` is ``user``'s: about 50 ms, safe from any thread (it
        touches no state; :meth:`remember` what passed, from the caller's thread)."""
        stored = self._users.get(user)
        if len(password) > _MAX_PASSWORD:
            return False
        ok = bcrypt.checkpw(password, stored if stored is not None else self._decoy)
        return ok and stored is not None

    def remember(self, user: str, password: bytes) -> None:
        """Let these credentials in without a check from now on (the oldest forgotten)."""
        self._known[self._digest(user, password)] = None
        while len(self._known) > self._remember:
            self._known.popitem(last=False)
