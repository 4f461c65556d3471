"""The sockets and the loop every server of this process stands on: bound sockets,
the open-file limit that fits the connections, the event loop, and the threads
that take the calls that must wait.

Unlike thriftpy2's ``make_server`` a socket sets SO_REUSEPORT only when asked (a
port clash is otherwise an error, not a silent second server), and reports the
port it bound (so port 0 works).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

from snowflake_thrift_client._transports import address_family

from .._config.settings import PEER_CHECK_SLOTS
from .._errors import ConfigurationError

__all__ = [
    "SPARE_FDS",
    "check_open_files",
    "listen_socket",
    "new_event_loop",
    "started_threads",
]

log = logging.getLogger(__name__)

SPARE_FDS = 128
"""Files besides client connections: the admin endpoint's 64 connections and listener,
the listeners, logs, state files, ZooKeeper, the event loop's own."""
_THREADS_START_S = 10.0


def listen_socket(
    host: str, port: int, *, reuse_port: bool, backlog: int | None = None
) -> socket.socket:
    """A TCP socket bound to ``host:port``, listening if ``backlog`` is given.

    ``reuse_port`` lets several processes share the port (SO_REUSEPORT); without
    it a port in use is an error, not a silent second server. Raises
    ``ConfigurationError`` naming the address.
    """
    sock = socket.socket(address_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if backlog is not None:
            sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise ConfigurationError(
            f"cannot listen on {host}:{port}: {e.strerror or e}"
            + (" (another process has it: stop it, or choose another port)"
               if e.errno == errno.EADDRINUSE else "")
        ) from None  # fmt: skip
    return sock


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop if it is installed, else asyncio's (and a log line saying so)."""
    try:
        import uvloop
    except ImportError:
        log.info("uvloop is not installed: serving on asyncio's own event loop (slower)")
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def check_open_files(connections: int, native_threads: int = 0) -> None:
    """Raise this process's soft limit on open files to fit ``connections`` client
    connections and the files the server needs besides (``native_threads`` take two
    each, and their listener one more; never past the hard limit, never system-wide).
    Raises ``ConfigurationError`` if the hard limit is too low: a server out of files
    fails its high-water mark writes and its probes.

    Call it first thing: it waits for nothing."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    besides = SPARE_FDS + (2 * native_threads + 1 if native_threads else 0)
    wanted = connections + besides
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    if hard != resource.RLIM_INFINITY and hard < wanted:
        native = ", with --native-threads" if native_threads else ""
        raise ConfigurationError(
            f"serving {connections} connections (--max-connections, {PEER_CHECK_SLOTS} kept for "
            f"peer checks, --http-max-connections) needs {wanted} open files ({besides} "
            f"besides the connections{native}), but the open-file limit is {soft} (soft) / "
            f"{hard} (hard): raise it (`ulimit -n {wanted}`; LimitNOFILE={wanted} in a systemd "
            f"unit) or lower those limits by {wanted - hard} or more"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def started_threads(count: int, name: str) -> ThreadPoolExecutor:
    """An executor whose ``count`` threads are all running when it returns, for the
    calls that must wait; it never starts another (it has ``max_workers`` of them).

    A plain ThreadPoolExecutor starts its threads as calls arrive: on a host out of
    threads (a container's ``pids.max`` reached) that start failed inside the loop's
    callback, and the client was dropped unanswered with its slot never given back.
    So each thread is made to start now, held at a barrier until all have. Raises
    ``RuntimeError`` (and leaves none running) if they cannot all start.
    """
    executor = ThreadPoolExecutor(count, thread_name_prefix=name)
    ready = threading.Barrier(count + 1)
    try:
        for _ in range(count):
            executor.submit(ready.wait)  # busy until all arrive: each submit starts one
        ready.wait(_THREADS_START_S)
    except BaseException:
        ready.abort()
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    return executor
