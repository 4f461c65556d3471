"""TLS contexts for the server (optionally requiring client certificates) and clients."""

from __future__ import annotations

import ssl

from .errors import ConfigurationError

__all__ = ["client_context", "server_context"]


def server_context(cert: str, key: str = "", client_ca: str = "") -> ssl.SSLContext:
    """Serve TLS 1.2+ with ``cert`` (and ``key``, if not in the same file); with
    ``client_ca``, only clients presenting a certificate signed by it get in."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigurationError(f"--tls-cert {cert} / --tls-key {key or cert}: {e}") from None
    if client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as e:
            raise ConfigurationError(f"--tls-client-ca {client_ca}: {e}") from None
    return context


def client_context(ca: str | None = None, cert: str = "", key: str = "") -> ssl.SSLContext:
    """Verify the server against ``ca`` (the system's CAs if None); present ``cert``
    (and ``key``) to a server that requires client certificates."""
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key or None)
    return context
