"""Servers of other protocols on free loopback ports, for clients pointed at the wrong port."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HTTP_400 = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"
TLS_ALERT = b"\x15\x03\x03\x00\x02\x02\x32"  # fatal decode_error, as a Java server sends it
SSH_BANNER = b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n"


@contextmanager
def foreign_server(*, banner: bytes = b"", answer: bytes = b"") -> Iterator[int]:
    """A port whose server sends ``banner`` on connecting and ``answer`` to the first
    bytes received (nothing if empty), then keeps each connection open until the client
    closes it: a client that waits for the rest of a "frame" waits for its timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def talk(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)  # bounded, whatever the client does
            try:
                if banner:
                    conn.sendall(banner)
                if conn.recv(65536) and answer:
                    conn.sendall(answer)
                while conn.recv(65536):
                    pass
            except OSError:
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=talk, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        listener.close()
        thread.join(5)
