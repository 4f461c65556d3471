"""ZooKeeper calls as every part of cluster mode makes them: bounded in time, and
their failures said in an operator's words.

kazoo's plain calls wait for a reconnection and retry with backoff, so a start-up
against a vanished ZooKeeper took half a minute; :func:`zk_call` gives each call a
deadline instead and turns a silence into ``ZooKeeperSilent`` (a ``StartupDeferred``:
nothing unsafe happened, try again).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable
from typing import Any

from kazoo.exceptions import (
    BadVersionError,
    ConnectionClosedError,
    ConnectionLoss,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    OperationTimeoutError,
    SessionExpiredError,
    ZookeeperStoppedError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry, RetryFailedError
from kazoo.security import ACL, Id, Permissions, make_digest_acl_credential
from snowflake_thrift_client._zkauth import ZooKeeperCredentials, kazoo_auth, load_credentials
from snowflake_thrift_client._zkkazoo import hide_credentials_in_logs, kazoo_tls

from .._config.settings import ZooKeeperAccess
from .._errors import ConfigurationError, StartupDeferred
from .._ids.clocks import pause

__all__ = [
    "OP_TIMEOUT_S",
    "ZooKeeperSilent",
    "check_tls_files",
    "children",
    "client_options",
    "describe_zk_error",
    "numeric_order",
    "service_acl",
    "service_ids",
    "session_id",
    "tls_hint",
    "zk_call",
]

OP_TIMEOUT_S = 2.0
"""What a call outside start-up waits for its reply (a mark's write, a deletion)."""


# What each kazoo failure means, in an operator's words (most specific first).
_ZK_ERRORS: tuple[tuple[type[BaseException], str], ...] = (
    (KazooTimeoutError, "ZooKeeper did not answer in time"),
    (OperationTimeoutError, "ZooKeeper did not answer in time"),
    (RetryFailedError, "ZooKeeper did not answer in time, though asked again"),
    (ConnectionClosedError, "the connection to ZooKeeper was closed"),
    (ZookeeperStoppedError, "the connection to ZooKeeper was closed"),
    (ConnectionLoss, "the connection to ZooKeeper was lost"),
    (SessionExpiredError, "the ZooKeeper session expired"),
    (NoNodeError, "a znode it needed does not exist (deleted meanwhile?)"),
    (NodeExistsError, "a znode it creates exists already"),
    (BadVersionError, "a znode was changed meanwhile by someone else"),
    (NoAuthError, "ZooKeeper denied access: a znode's ACL does not let this node in"),
)


def describe_zk_error(error: BaseException) -> str:
    """What a kazoo exception means, in words; an unexpected one is named in parentheses."""
    for kind, words in _ZK_ERRORS:
        if isinstance(error, kind):
            return words
    detail = f": {error}" if str(error) else ""
    return f"ZooKeeper failed ({type(error).__name__}{detail})"


class ZooKeeperSilent(StartupDeferred):
    """ZooKeeper did not answer within the time a call was given: ``what`` was being
    done, with ``timeout_s``; ``why`` adds what else happened (a closed connection)."""

    def __init__(self, what: str, timeout_s: float, why: str = "") -> None:
        also = f" ({why})" if why else ""
        super().__init__(
            f"ZooKeeper did not answer within {timeout_s:g} s (--zk-connect-timeout) while "
            f"{what}{also}; is it running? start again once it is"
        )
        self.what = what
        self.timeout_s = timeout_s
        self.why = why


def zk_call(client: Any, timeout_s: float, what: str, method: str, *args: Any, **kw: Any) -> Any:
    """``client.<method>_async(...)``, retried through a dropped connection but ended
    within ``timeout_s`` (``--zk-connect-timeout``): ``ZooKeeperSilent``, a
    ``StartupDeferred`` (nothing unsafe happened: try again) saying ``what`` was being
    done. A plain kazoo call waits for reconnection and retries with backoff, which
    stretched a start-up against a vanished ZooKeeper to half a minute.
    """
    deadline = time.monotonic() + timeout_s

    def attempt() -> Any:
        left = max(0.05, deadline - time.monotonic())
        return getattr(client, f"{method}_async")(*args, **kw).get(timeout=left)

    # Our own sleep, not kazoo's time.sleep: under libfaketime (the black-box clock
    # tests) time.sleep can fail with EINVAL; see _ids/clocks.pause.
    retry = KazooRetry(max_tries=-1, delay=0.1, max_delay=1.0, deadline=timeout_s, sleep_func=pause)
    try:
        return retry(attempt)
    except (KazooTimeoutError, RetryFailedError):
        raise ZooKeeperSilent(what, timeout_s) from None
    except ConnectionClosedError as e:
        raise ZooKeeperSilent(what, timeout_s, describe_zk_error(e)) from None


def session_id(client: Any, what: str) -> int:
    """Our session's id; ``StartupDeferred`` while kazoo is disconnected (it has none)."""
    ids = client.client_id if client is not None else None
    if ids is None:
        raise StartupDeferred(f"the ZooKeeper connection dropped while {what}; start again")
    return int(ids[0])


def numeric_order(names: Iterable[str]) -> list[str]:
    """Znode names of ids (worker, datacenter) in numeric order: ``2`` before ``10``."""
    return sorted(names, key=lambda n: (len(n), n))


def children(client: Any, path: str, what: str, timeout_s: float = 10.0) -> list[str]:
    """The children of ``path`` in numeric order (none if it does not exist), read
    within ``timeout_s`` (``StartupDeferred`` otherwise, saying ``what`` was done)."""
    try:
        names = zk_call(client, timeout_s, what, "get_children", path)
        return numeric_order(names)
    except NoNodeError:
        return []


def client_options(access: ZooKeeperAccess) -> dict[str, Any]:
    """``KazooClient``'s keyword arguments for ``access``, besides hosts, timeout and
    retries: every ZooKeeper client of the server is made with them.

    Identity: how it authenticates (credentials read from ``access.credentials_file``
    now, never logged) and the ACL of every znode it creates (``default_acl``: kazoo gives
    it to ``create`` and to each parent ``ensure_path`` and ``makepath`` make);
    ``ConfigurationError`` if the credentials file cannot be used.

    TLS: trusting only ``access.tls_ca`` (kazoo's own TLS would trust the system's CAs
    too), with a new SSL context from the files at every connection attempt, so
    certificate files replaced in place are used from the next reconnection on, in the
    same session. Hostname verification is on (kazoo's default is off: a certificate
    issued to any host would do). A new dict, with its own handler, for each client.

    kazoo's log never shows the credentials (it logs the digest ``Auth`` request at
    DEBUG): its loggers get a filter that hides them."""
    hide_credentials_in_logs()
    options: dict[str, Any] = {}
    if access.authenticated:
        credentials = load_credentials(access.credentials_file)
        options.update(kazoo_auth(access.auth, credentials))
        options["default_acl"] = service_acl(access, credentials)
    if access.tls:
        options.update(
            kazoo_tls(access.tls_ca, access.tls_cert, access.tls_key, access.tls_verify_hostname)
        )
    return options


def service_ids(access: ZooKeeperAccess, credentials: ZooKeeperCredentials) -> tuple[Id, ...]:
    """The ACL ids of the service: this node's own first, then those the credentials
    file trusts as the same service (``also``, during a rotation)."""
    if access.auth == "sasl":
        own = Id("sasl", credentials.user)
    else:
        own = Id("digest", make_digest_acl_credential(credentials.user, credentials.password))
    also = [Id(*each.split(":", 1)) for each in credentials.also]
    return (own, *[i for i in also if i != own])


def service_acl(access: ZooKeeperAccess, credentials: ZooKeeperCredentials) -> list[ACL]:
    """The ACL of the service's znodes: all rights for its identities, reading for
    the credentials' ``readers`` (the discovery clients' identities) and, with
    ``read_acl`` world, for anyone; anyone may do anything with ``open_acl`` (a
    migration: nodes without credentials must keep writing)."""
    if access.open_acl:
        return [ACL(Permissions.ALL, Id("world", "anyone"))]
    acl = [ACL(Permissions.ALL, each) for each in service_ids(access, credentials)]
    acl += [ACL(Permissions.READ, Id(*each.split(":", 1))) for each in credentials.readers]
    if access.read_acl == "world":
        acl.append(ACL(Permissions.READ, Id("world", "anyone")))
    return acl


def check_tls_files(access: ZooKeeperAccess) -> None:
    """Load ``access``'s TLS files as kazoo will at each connection: a file missing,
    unreadable, not PEM, or a key that does not fit the certificate raises
    ``ConfigurationError`` naming the flag (kazoo would only time out, again and again)."""
    if not access.tls:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(access.tls_ca)
    except (OSError, ssl.SSLError) as e:
        why = _unusable(e, "CA certificates")
        raise ConfigurationError(f"--zk-tls-ca {access.tls_ca}: {why}") from None
    if access.tls_cert:
        try:
            context.load_cert_chain(access.tls_cert, access.tls_key)
        except (OSError, ssl.SSLError) as e:
            why = _unusable(e, "a certificate and its key")
            raise ConfigurationError(
                f"--zk-tls-cert {access.tls_cert} / --zk-tls-key {access.tls_key}: {why}"
            ) from None


def _unusable(error: OSError, expected: str) -> str:
    if isinstance(error, ssl.SSLError):
        detail = error.reason or error.library or error
        return f"cannot load {expected} from it: not PEM, or they do not match ({detail})"
    return f"cannot read it: {error.strerror or error}"


def tls_hint(access: ZooKeeperAccess) -> str:
    """What to check when a TLS connection to ZooKeeper fails (kazoo says only that it
    timed out, whatever the handshake met); empty without TLS."""
    if not access.tls:
        return ""
    client = (
        "the client certificate --zk-tls-cert must be one the servers trust"
        if access.tls_cert
        else "no client certificate is presented (--zk-tls-cert, --zk-tls-key): the "
        "servers must not require one (ssl.clientAuth=none)"
    )
    return (
        "; over TLS: --zookeeper must name the servers' secureClientPort, their "
        f"certificates must be signed by the CA in --zk-tls-ca {access.tls_ca} and name "
        f"the host dialled (hostname verification), and {client}; kazoo's warnings in "
        "the log say what the last attempt met"
    )
