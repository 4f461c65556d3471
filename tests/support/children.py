"""Stand-ins for a supervised child, for the supervisor's tests in both tiers: a real
process to hold its place (``sleep``) and an admin port on 127.0.0.1 that answers as a
test says."""

from __future__ import annotations

import socket
import subprocess
import threading

__all__ = ["FakeAdmin", "sleeper"]


class FakeAdmin:
    """A stand-in for a child's admin port on 127.0.0.1: :meth:`answer` serves each
    request, one at a time on one thread (as a child's event loop does), or each on a
    thread of its own (``threaded``)."""

    def __init__(self, *, threaded: bool = False) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._threaded = threaded
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._sock.accept()
            except OSError:
                return
            if self._threaded:
                threading.Thread(target=self._serve, args=(connection,), daemon=True).start()
            else:
                self._serve(connection)

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            self.answer(connection, connection.recv(4096))

    def answer(self, connection: socket.socket, request: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._sock.close()


def sleeper() -> subprocess.Popen[str]:
    """A running process to stand for a child's (its state is what the checks read), in
    a process group of its own as a child is (the supervisor kills the group)."""
    return subprocess.Popen(["sleep", "60"], stdout=subprocess.PIPE, text=True, process_group=0)
