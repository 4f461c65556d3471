"""A TCP proxy on 127.0.0.1 that delays every byte by a set time each way: a ZooKeeper
across a slow network, with its pipelining kept (what is sent together arrives
together, ``delay_s`` later), so that calls issued at once take one delay, not one each.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from types import TracebackType

__all__ = ["DelayingProxy"]


class DelayingProxy:
    """``with DelayingProxy(("127.0.0.1", port), delay_s) as proxy: proxy.hosts``."""

    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self.delay_s = delay_s
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.hosts = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        self._threads: list[threading.Thread] = []
        self._start(self._accept)

    def _start(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                near, _ = self._listener.accept()
                far = socket.create_connection(self._target, timeout=10)
            except OSError:
                return  # closed
            far.settimeout(None)
            self._sockets += [near, far]
            self._pipe(near, far)
            self._pipe(far, near)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """Bytes read from ``source`` are written to ``sink`` ``delay_s`` after."""
        queued: deque[tuple[float, bytes]] = deque()
        ready = threading.Condition()

        def read() -> None:
            while True:
                try:
                    data = source.recv(65536)
                except OSError:
                    data = b""
                with ready:
                    queued.append((time.monotonic() + self.delay_s, data))
                    ready.notify()
                if not data:
                    return

        def write() -> None:
            while True:
                with ready:
                    ready.wait_for(lambda: bool(queued))
                    due, data = queued.popleft()
                # The delay itself: this proxy is the slow network the test is about.
                self._closed.wait(max(0.0, due - time.monotonic()))
                try:
                    if not data:
                        sink.shutdown(socket.SHUT_WR)
                        return
                    sink.sendall(data)
                except OSError:
                    return

        self._start(read)
        self._start(write)

    def close(self) -> None:
        self._closed.set()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(5)

    def __enter__(self) -> DelayingProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
