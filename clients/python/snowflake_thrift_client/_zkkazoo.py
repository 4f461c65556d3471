"""kazoo made safe for credentials and TLS: what every ZooKeeper client of the service
and of this package is made with (the server's ``client_options`` and
:class:`ZooKeeperDiscovery`).

- kazoo logs every request it sends at DEBUG, the digest ``Auth`` packet with its
  ``user:password`` included: :func:`hide_credentials_in_logs` rewrites those records
  on kazoo's own loggers, whatever level and handlers the application set up.
- kazoo's TLS loads the system's default CAs before the one it is given, so any
  publicly trusted certificate for the host dialled would pass: :func:`kazoo_tls`'s
  handler builds the SSL context itself, trusting the given CA only.

Imports kazoo: import this module only once kazoo is known to be installed.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Mapping
from typing import Any

from kazoo.handlers import utils
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol.serialization import SASL, Auth

__all__ = [
    "CaOnlyHandler",
    "HideCredentials",
    "hide_credentials_in_logs",
    "kazoo_tls",
    "tls_context",
]

KAZOO_LOGGERS = ("kazoo.client", "kazoo.protocol.connection")
"""Where kazoo logs the requests it sends: a client's logger (``kazoo.client`` unless
one is given) and the connection module's, its fallback."""


class HideCredentials(logging.Filter):
    """Hides the secret of every ``Auth`` (digest ``user:password``) and ``SASL`` (a
    DIGEST-MD5 response, open to an offline guess of the password) request in a record's
    message and arguments; passes every record on."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = _hidden(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_hidden(arg) for arg in record.args)
        elif isinstance(record.args, Mapping):
            record.args = {key: _hidden(value) for key, value in record.args.items()}
        return True


def _hidden(value: object) -> object:
    if isinstance(value, Auth):
        return f"Auth(auth_type={value.auth_type}, scheme={value.scheme!r}, auth=<hidden>)"
    if isinstance(value, SASL):
        return "SASL(challenge=<hidden>)"
    return value


_FILTER = HideCredentials()


def hide_credentials_in_logs() -> None:
    """Put :class:`HideCredentials` on kazoo's loggers (once): a filter on the logger
    that makes the record, so no level, handler or propagation can see the secret."""
    for name in KAZOO_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def tls_context(ca: str, certfile: str = "", keyfile: str = "", check_hostname: bool = True,
                keyfile_password: str | None = None) -> ssl.SSLContext:  # fmt: skip
    """A client context that trusts the CAs in ``ca`` only (never the system's),
    verifies the chain and, with ``check_hostname``, the host name; it presents
    ``certfile`` (with ``keyfile``) if given. Raises ``OSError`` or ``ssl.SSLError`` if
    a file cannot be loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = check_hostname
    context.load_verify_locations(ca)
    if certfile:
        context.load_cert_chain(certfile, keyfile or None, keyfile_password)
    return context


class CaOnlyHandler(SequentialThreadingHandler):  # type: ignore[misc] # kazoo is untyped
    """kazoo's threading handler, whose TLS connections trust only the CA kazoo is given
    (:func:`tls_context`, built from the files at each connection: files replaced in
    place are used from the next reconnection on). One per ``KazooClient``."""

    def create_connection(
        self,
        address: tuple[str, int],
        hostname: str | None = None,
        timeout: float | None = None,
        use_ssl: bool = False,
        ca: str | None = None,
        certfile: str | None = None,
        keyfile: str | None = None,
        keyfile_password: str | None = None,
        verify_certs: bool = True,
        check_hostname: bool = False,
        **options: Any,
    ) -> Any:
        if not use_ssl:
            return utils.create_tcp_connection(socket, address, hostname, timeout, **options)
        if not ca or not verify_certs:
            # Trusting nothing, or anything: neither is TLS worth the name.
            raise ValueError("CaOnlyHandler verifies every server against a CA: give ca")
        context = tls_context(ca, certfile or "", keyfile or "", check_hostname, keyfile_password)
        plain = utils.create_tcp_connection(socket, address, hostname, timeout)
        try:
            # The handshake, bounded by the connection's timeout.
            return context.wrap_socket(plain, server_hostname=hostname)
        except BaseException:
            plain.close()
            raise


def kazoo_tls(ca: str, certfile: str = "", keyfile: str = "",
              check_hostname: bool = True) -> dict[str, Any]:  # fmt: skip
    """``KazooClient`` keyword arguments for TLS that trusts only ``ca`` (a new
    :class:`CaOnlyHandler`: call once per client), presenting ``certfile`` and
    ``keyfile`` if given; none without ``ca``."""
    if not ca:
        return {}
    return {
        "handler": CaOnlyHandler(), "use_ssl": True, "ca": ca, "certfile": certfile or None,
        "keyfile": keyfile or None, "verify_certs": True, "check_hostname": check_hostname,
    }  # fmt: skip
