"""TLS for clients: a context that verifies the server and may present a certificate."""

from __future__ import annotations

import ssl

__all__ = ["client_context"]


def client_context(ca: str | None = None, cert: str = "", key: str = "") -> ssl.SSLContext:
    """Verify the server against ``ca`` (the system's CAs if None); present ``cert``
    (and ``key``) to a server that requires client certificates."""
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key or None)
    return context
