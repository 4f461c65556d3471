"""Network namespaces of the tests' own, joined by a router namespace, made without mounts.

Each namespace is held by a process of its own (``unshare --net -- sleep infinity``)
and named by ``/proc/<pid>/ns/net``; ``ip netns`` is not used, since it bind-mounts
``/run/netns`` and remounts ``/sys``, which a chroot or a container may refuse while
``unshare --net`` works. Commands run inside with ``nsenter --net=...``; every veth is
made inside the router's namespace and its other end moved straight into a host's, so
the test machine's own network is never touched.

Topology: host ``i`` is ``10.215.<i>.2/24`` on ``eth0``, a veth whose other end is the
router's ``r-<name>`` (``10.215.<i>.1``, the host's default route). The router forwards
between the links; a partition is a pair of ``ip rule ... blackhole`` rules in the
router, so the packets between two hosts vanish in the network as in a real partition
(no error reaches either end: TCP retransmits and times out) while each host keeps its
links to everyone else.

Cleanup is guaranteed by the kernel: a network namespace disappears, with its veths,
when the last process in it exits and nothing else refers to it (nothing does: no bind
mount, no open descriptor kept). :meth:`Network.close` kills whatever still runs in the
namespaces, then the holders, and checks that no process is left in any of them; every
process started here also gets SIGKILL if the test process dies (``setpriv --pdeathsig``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tests.support.waiting import wait_until

__all__ = ["Host", "NamespacesRefused", "Network", "Portal"]

PREFIX = "10.215"  # the hosts' addresses exist only inside these namespaces
_CLONE_NEWNET = 0x40000000
_T = TypeVar("_T")


class NamespacesRefused(AssertionError):
    """The machine refused a namespace or a link: the nemesis cannot run here, and says why
    (a failure, not a skip: the suite must not pass without it)."""


def _run(argv: Sequence[str], what: str, stdin: str | None = None) -> str:
    try:
        done = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=30, check=False
        )
    except FileNotFoundError as e:
        raise NamespacesRefused(f"{what}: {e.filename} is missing (util-linux, iproute2)") from e
    if done.returncode != 0:
        raise NamespacesRefused(
            f"{what}: `{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}"
        )
    return done.stdout


def _netns_inode(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


@dataclass(frozen=True)
class Host:
    """A network namespace with one address on the router."""

    name: str
    index: int
    holder: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"{PREFIX}.{self.index}.2"

    @property
    def gateway(self) -> str:
        return f"{PREFIX}.{self.index}.1"

    @property
    def netns(self) -> str:
        return f"/proc/{self.holder.pid}/ns/net"

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this namespace; it is killed if the test process dies.
        nsenter and setpriv exec it, so the process started has ``argv``'s pid."""
        return ["nsenter", f"--net={self.netns}", "--",
                "setpriv", "--pdeathsig", "KILL", "--", *argv]  # fmt: skip

    def ip(self, *lines: str) -> None:
        """iproute2 commands (``ip -batch`` lines) inside this namespace."""
        _run(self.command("ip", "-batch", "-"), f"ip in {self.name}", "\n".join(lines) + "\n")


def _hold(name: str, index: int) -> Host:
    """A new network namespace, held by a sleeping process until it is killed."""
    holder = subprocess.Popen(
        ["setpriv", "--pdeathsig", "KILL", "--", "unshare", "--net", "--", "sleep", "infinity"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    ours = _netns_inode("self")

    def inside() -> bool:
        if holder.poll() is not None:
            assert holder.stderr is not None
            raise NamespacesRefused(
                f"unshare --net refused a network namespace here (exit {holder.returncode}): "
                f"{holder.stderr.read().decode(errors='replace').strip()}; the nemesis tests "
                "need root and a kernel that allows network namespaces"
            )
        # unshare runs after Popen returns: the namespace is there once sleep runs.
        with contextlib.suppress(OSError):
            comm = Path(f"/proc/{holder.pid}/comm").read_text().strip()
            return comm == "sleep" and _netns_inode(holder.pid) != ours
        return False

    try:
        wait_until(inside, f"the holder of namespace {name} sleeps in a namespace of its own", 10)
    except BaseException:
        holder.kill()
        holder.wait()
        assert holder.stderr is not None
        holder.stderr.close()
        raise
    return Host(name, index, holder)


class Network:
    """Hosts on one router, each in a network namespace; :meth:`partition` cuts some off.

    Use as a context manager: the namespaces are gone when it exits, whatever happened.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self._names = list(names)
        self.router: Host | None = None
        self.hosts: dict[str, Host] = {}
        self._rules: list[str] = []

    def __enter__(self) -> Network:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _build(self) -> None:
        self.router = _hold("router", 0)
        for index, name in enumerate(self._names, start=1):
            self.hosts[name] = _hold(name, index)
        links: list[str] = []
        for host in self.hosts.values():
            link = f"r-{host.name}"
            links += [
                f"link add name {link} type veth peer name eth0 netns {host.holder.pid}",
                f"addr add {host.gateway}/24 dev {link}",
                f"link set {link} up",
            ]
        self.router.ip("link set lo up", *links)
        # Per namespace: /proc/sys/net is the namespace of the process that opens it.
        _run(self.router.command("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"),
             "forwarding in the router namespace")  # fmt: skip
        for host in self.hosts.values():
            host.ip(
                "link set lo up",
                f"addr add {host.address}/24 dev eth0",
                "link set eth0 up",
                f"route add default via {host.gateway}",
            )

    # -- faults ---------------------------------------------------------------

    def partition(self, side: Iterable[str], other: Iterable[str]) -> None:
        """Drop every packet between a host of ``side`` and a host of ``other``, both
        ways, in the router; :meth:`heal` ends every partition."""
        assert self.router is not None
        rules = [
            f"from {self.hosts[a].address} to {self.hosts[b].address} blackhole priority 100"
            for x in side
            for y in other
            for a, b in ((x, y), (y, x))
        ]
        self.router.ip(*(f"rule add {rule}" for rule in rules))
        self._rules += rules

    def heal(self) -> None:
        assert self.router is not None
        rules, self._rules = self._rules, []
        if rules:
            self.router.ip(*(f"rule del {rule}" for rule in rules))

    # -- cleanup --------------------------------------------------------------

    def _holders(self) -> list[subprocess.Popen[bytes]]:
        hosts = [*self.hosts.values(), *([self.router] if self.router else [])]
        return [host.holder for host in hosts]

    def close(self) -> None:
        """Kill every process still in the namespaces, then the holders; check that no
        process is left in any of them (the kernel then removes them and their links)."""
        holders = self._holders()
        inodes = set()
        for holder in holders:
            with contextlib.suppress(OSError):
                inodes.add(_netns_inode(holder.pid))
        left: set[int] = set()

        def emptied() -> bool:
            # SIGKILL is delivered, not done, when kill() returns: a loaded machine
            # shows a killed process in its namespace a while longer (CI saw one).
            left.clear()
            left.update(_tasks_in(inodes))
            for pid in left - {os.getpid()}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return not left

        emptied()
        for holder in holders:
            if holder.poll() is None:
                holder.kill()
            holder.wait(10)
            if holder.stderr is not None:
                holder.stderr.close()
        with contextlib.suppress(AssertionError):
            wait_until(emptied, "the test's network namespaces empty", 10)
        assert not left, f"processes left in the test's network namespaces: {sorted(left)}"


def _tasks_in(inodes: set[int]) -> set[int]:
    """The processes with a thread in one of the network namespaces ``inodes``
    (a thread of this process counts: a :class:`Portal` keeps its namespace alive)."""
    found: set[int] = set()
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*/ns/net") if inodes else ():
        with contextlib.suppress(OSError):
            if task.stat().st_ino in inodes:
                found.add(int(task.parts[2]))
    return found


class Portal:
    """A thread of this process inside a host's namespace, for the test's own calls
    (``srvr`` to a ZooKeeper server, a ZooKeeper session): the rest of the process, and
    the threads it starts elsewhere, stay in the machine's namespace. Threads started
    from the portal's thread (kazoo's) are in the namespace too. :meth:`close` ends it,
    which the namespace needs to go away."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._pool = ThreadPoolExecutor(1, f"netns-{host.name}", self._enter, (host.netns,))

    @staticmethod
    def _enter(netns: str) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(netns, os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise NamespacesRefused(f"setns into {netns}: {os.strerror(errno)}")
        finally:
            os.close(fd)

    def run(self, call: Callable[[], _T], timeout_s: float = 30.0) -> _T:
        return self._pool.submit(call).result(timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@contextlib.contextmanager
def portal(host: Host) -> Iterator[Portal]:
    door = Portal(host)
    try:
        yield door
    finally:
        door.close()
