"""The nemesis's network (``tests/support/netns.py``) on its own: hosts reach each other
through the router, a partition silences exactly the pairs it names, and nothing is
left once it is closed, not even a process started in a namespace and forgotten."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.netns import Host, Network, Portal, portal

pytestmark = [pytest.mark.nemesis]

PORT = 5000
LISTEN = """
import socket, sys
with socket.create_server((sys.argv[1], int(sys.argv[2]))) as server:
    print("listening", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"hello")
"""


@contextlib.contextmanager
def listener(host: Host) -> Iterator[subprocess.Popen[str]]:
    """A TCP server in ``host``'s namespace that greets every connection."""
    command = host.command(sys.executable, "-c", LISTEN, host.address, str(PORT))
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as server:
        assert server.stdout is not None
        try:
            assert server.stdout.readline() == "listening\n"
            yield server
        finally:
            server.kill()


def greeting(door: Portal, host: Host) -> bytes | str:
    """What ``host``'s listener says when called from ``door``'s namespace, or why not."""

    def call() -> bytes | str:
        try:
            with socket.create_connection((host.address, PORT), timeout=0.5) as conn:
                return conn.recv(16)
        except OSError as e:
            return type(e).__name__

    return door.run(call)


def test_a_partition_silences_only_the_pairs_it_names() -> None:
    with (
        Network(["a", "b", "c"]) as net,
        listener(net["a"]),
        portal(net["b"]) as b,
        portal(net["c"]) as c,
    ):
        assert greeting(b, net["a"]) == greeting(c, net["a"]) == b"hello"
        net.partition(["a"], ["b"])
        # Dropped in the network, as in a real partition: no refusal, a timeout.
        assert greeting(b, net["a"]) == "TimeoutError"
        assert greeting(c, net["a"]) == b"hello"
        net.heal()
        assert greeting(b, net["a"]) == b"hello"


def test_nothing_is_left_once_the_network_is_closed() -> None:
    with Network(["a"]) as net:
        holder = net["a"].holder
        inode = Path(net["a"].netns).stat().st_ino
        forgotten = subprocess.Popen(net["a"].command("sleep", "300"))
    try:
        assert forgotten.wait(10) == -9, "killed by the network's close"
        assert holder.poll() is not None
        left = []
        for task in Path("/proc").glob("[0-9]*/task/[0-9]*/ns/net"):
            with contextlib.suppress(OSError):
                if task.stat().st_ino == inode:
                    left.append(task)
        assert not left, "the namespace is gone with its last process"
        assert Path(f"/proc/{os.getpid()}/ns/net").stat().st_ino != inode
    finally:
        if forgotten.poll() is None:
            forgotten.kill()
            forgotten.wait()
