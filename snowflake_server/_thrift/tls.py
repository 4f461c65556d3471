"""The server's TLS context, optionally requiring client certificates (mutual TLS)."""

from __future__ import annotations

import ssl

from .._errors import ConfigurationError

__all__ = ["server_context"]


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
