"""TLS for every client port (Thrift and HTTP): its context (optionally requiring
client certificates: mutual TLS), and :class:`TlsSession`, one connection's TLS over memory buffers.

The session is hand-written over ``ssl.MemoryBIO`` rather than the event loop's
own TLS (``create_server(ssl=...)`` or ``loop.start_tls``) because neither
fits: a failed handshake never reaches the connection's protocol, so it could
not be counted or logged as the server's other refusals are, and uvloop's
``start_tls`` handed bytes received during the switch to the plain protocol.
With the session the connection sees every handshake outcome, and its own
limits (connections, idle time, frame size) apply from the first byte.
"""

from __future__ import annotations

import contextlib
import ssl

from .._errors import ConfigurationError

__all__ = ["TlsSession", "server_context"]


def server_context(cert: str, key: str = "", client_ca: str = "") -> ssl.SSLContext:
    """Serve TLS 1.2+ with ``cert`` (and ``key``, if not in the same file); with
    ``client_ca``, only clients presenting a certificate signed by it get in."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigurationError(
            f"--tls-cert {cert} / --tls-key {key or cert}: {_why(e, 'a certificate and its key')}"
        ) from None
    if client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as e:
            raise ConfigurationError(
                f"--tls-client-ca {client_ca}: {_why(e, 'CA certificates')}"
            ) from None
    return context


def _why(error: OSError, expected: str) -> str:
    """What a person can act on: the file's problem, not Python's exception text."""
    if isinstance(error, ssl.SSLError):
        detail = error.reason or error.library or error
        return f"cannot load {expected} from it: not PEM, or they do not match ({detail})"
    return f"cannot read it: {error.strerror or error}"


class TlsSession:
    """One server-side TLS connection, bytes in and out through memory buffers.

    Feed what the peer sent to :meth:`receive`; send what :meth:`receive`,
    :meth:`encrypt` and :meth:`close` return. Raises ``ssl.SSLError`` for a
    failed handshake or a corrupt record.
    """

    def __init__(self, context: ssl.SSLContext) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self.established = False
        self.closed_by_peer = False
        self.buffered = False
        """The last bytes received after the handshake gave no plaintext: part of a
        record (a request in the making, for the request deadline)."""
        self._received = False

    @property
    def peer_certified(self) -> bool:
        """Whether the peer presented a certificate (verified, if the context verifies:
        one that failed verification failed the handshake)."""
        return self.established and self._tls.getpeercert(binary_form=True) is not None

    @property
    def mid_handshake(self) -> bool:
        """Whether the peer began a handshake that has not completed."""
        return self._received and not self.established

    def receive(self, data: bytes) -> tuple[bytes, bytes]:
        """Take ``data`` from the peer; return (plaintext received, bytes to send back)."""
        self._received = True
        self._incoming.write(data)
        was_established = self.established
        if not self.established:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                return b"", self._outgoing.read()
            self.established = True
        chunks = []
        try:
            while True:
                chunk = self._tls.read(65536)
                if not chunk:  # close_notify
                    self.closed_by_peer = True
                    break
                chunks.append(chunk)
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            self.closed_by_peer = True
        self.buffered = was_established and not chunks and not self.closed_by_peer
        return b"".join(chunks), self._outgoing.read()

    def encrypt(self, plaintext: bytes) -> bytes:
        """``plaintext`` as TLS records to send."""
        self._tls.write(plaintext)
        return self._outgoing.read()

    def close(self) -> bytes:
        """The close_notify alert to send, if the session got that far."""
        if self.established:
            with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLError):
                self._tls.unwrap()
        return self._outgoing.read()
