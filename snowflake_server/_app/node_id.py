"""``--worker-id ordinal``, ``ip`` and ``mac``: this machine's node id, read once at start-up.

The process entry point calls :func:`resolve_worker_id` before anything is built. It
reads what the source needs (the host name, the network interfaces, a DNS name), checks
the result against the layout, and returns settings that hold plain ids, so that the
rest (the supervisor's consecutive worker ids, cluster mode's registration and conflict
checks) sees a fixed worker id; and a :class:`WorkerIdOrigin` saying where the ids came
from, for the log, ``/readyz`` and ``snowflake_info``.

- ``ordinal``: the trailing ``-<N>`` of the host name (its first label): a StatefulSet's
  pod ``snowflake-7`` is worker 7. Under ``--processes P``, process i is worker N*P + i.
- ``ip``: the low ``datacenter_id_bits + worker_id_bits`` bits of this host's IPv4
  address (``--advertise-host``, resolved if it is a name; else the first non-loopback
  address of an interface that is up) as one node id, split over the datacenter and
  worker fields, as sonyflake takes 16 bits of the private IPv4 address.
- ``mac``: the same from the MAC address of the interface holding that IPv4 address.

An address many machines share gives them all one node id, so it is refused unless
``--force-node-id``: a loopback IPv4 address, and a MAC address that is all zeros,
multicast, or locally administered (made up by software: Docker's ``02:42:...``, the
generated or cloned ones of containers and VMs).

The interfaces are read by hand, with ioctl(2) on a datagram socket (Linux's own
interface requests), because no well-kept library gives each interface's IPv4 address,
MAC address and flags without a compiled dependency: psutil (``net_if_addrs``,
``net_if_stats``) is well kept but a C extension; netifaces, compiled too, has been
archived unmaintained since 2021; ifaddr is pure Python but gives no MAC addresses. The
host name, the interfaces and name resolution are injected (:class:`Machine`), so that
every branch runs in tests.
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import logging
import re
import socket
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from ipaddress import IPv4Address

from .._config.options import worker_id_text
from .._config.settings import FromMachine, ServerSettings
from .._errors import ConfigurationError

__all__ = [
    "Interface",
    "Machine",
    "WorkerIdOrigin",
    "configured_origin",
    "ipv4_addresses",
    "linux_interfaces",
    "resolve_worker_id",
]

log = logging.getLogger("snowflake_server")


@dataclass(frozen=True, slots=True)
class Interface:
    """One network interface, as far as the node id needs it."""

    name: str
    up: bool
    loopback: bool
    ipv4: IPv4Address | None = None
    """Its IPv4 address (the primary one), or None."""
    mac: bytes | None = None
    """Its 6-byte MAC address; None for a link without one (tun, WireGuard, InfiniBand)."""


IfReq = Callable[[int, str], bytes]
"""One interface request: the ioctl number and the interface's name in, the 40-byte
``struct ifreq`` the kernel filled out back (``OSError`` if it would not)."""

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_SIOCGIFHWADDR = 0x8927
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_ARPHRD_ETHER = 1
_ARPHRD_LOOPBACK = 772
_IFREQ_SIZE = 40  # struct ifreq: the name (IFNAMSIZ, 16 bytes), then a 24-byte union
_UNION = 16  # where the union starts: ifr_flags, or a struct sockaddr


def linux_interfaces(
    names: Callable[[], Iterable[tuple[int, str]]] = socket.if_nameindex,
    ask: IfReq | None = None,
) -> list[Interface]:
    """This network namespace's interfaces in index order: flags, IPv4 and MAC address.

    The MAC address comes from SIOCGIFHWADDR rather than ``/sys/class/net``: sysfs
    shows the network namespace of whoever mounted it (``unshare --net`` without a new
    mount still sees the host's), an ioctl always the caller's.
    """
    if ask is not None:
        return _read(names(), ask)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        return _read(names(), functools.partial(_ifreq, sock))


def _ifreq(sock: socket.socket, request: int, name: str) -> bytes:
    return bytes(fcntl.ioctl(sock.fileno(), request, name.encode().ljust(_IFREQ_SIZE, b"\0")))


def _read(names: Iterable[tuple[int, str]], ask: IfReq) -> list[Interface]:
    found = []
    for _index, name in names:
        try:
            (flags,) = struct.unpack_from("H", ask(_SIOCGIFFLAGS, name), _UNION)
            hardware = ask(_SIOCGIFHWADDR, name)
        except OSError:
            continue  # gone since it was listed
        try:
            # struct sockaddr_in: family (2 bytes), port (2), then the address.
            ipv4: IPv4Address | None = IPv4Address(ask(_SIOCGIFADDR, name)[20:24])
        except OSError:
            ipv4 = None  # EADDRNOTAVAIL: it has none
        (link,) = struct.unpack_from("H", hardware, _UNION)  # struct sockaddr's family
        mac = hardware[18:24] if link in (_ARPHRD_ETHER, _ARPHRD_LOOPBACK) else None
        found.append(Interface(name, bool(flags & _IFF_UP), bool(flags & _IFF_LOOPBACK), ipv4, mac))
    return found


def ipv4_addresses(host: str) -> list[str]:
    """The IPv4 addresses ``host`` resolves to (getaddrinfo: /etc/hosts, then DNS)."""
    found = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    return [str(sockaddr[0]) for _family, _kind, _proto, _name, sockaddr in found]


@dataclass(frozen=True, slots=True)
class Machine:
    """What the resolver reads about this machine; tests give their own."""

    hostname: Callable[[], str] = socket.gethostname
    interfaces: Callable[[], Sequence[Interface]] = linux_interfaces
    ipv4_addresses: Callable[[str], Sequence[str]] = ipv4_addresses


@dataclass(frozen=True, slots=True)
class WorkerIdOrigin:
    """Where a node's ids came from: ``source`` is ``--worker-id``'s kind (number,
    auto, ordinal, ip or mac), ``detail`` says from what, for people."""

    source: str
    detail: str


def configured_origin(settings: ServerSettings) -> WorkerIdOrigin:
    """The origin of a worker id given as a number, or leased (``auto``); settings that
    still read theirs from the machine raise ``ConfigurationError``."""
    if settings.worker_number < 0:
        return WorkerIdOrigin("auto", "a lease from ZooKeeper")
    return WorkerIdOrigin("number", "the settings")


def resolve_worker_id(
    settings: ServerSettings, machine: Machine | None = None
) -> tuple[ServerSettings, WorkerIdOrigin]:
    """``settings`` with the ids ``--worker-id`` stands for, and where they came from;
    logs both. A number or ``auto`` is returned as it is.

    Raises ``ConfigurationError`` (exit 2) saying what was read and why it cannot serve.
    """
    machine = Machine() if machine is None else machine
    source = settings.worker_id
    if not isinstance(source, FromMachine):
        resolved, origin = settings, configured_origin(settings)
    elif source is FromMachine.ORDINAL:
        resolved, origin = _from_ordinal(settings, machine.hostname())
    else:
        resolved, origin = _from_address(settings, source, machine)
    worker_id, processes = resolved.worker_number, resolved.processes
    if worker_id < 0:
        ids = "worker id to be leased from ZooKeeper"
    elif processes > 1:
        ids = f"worker ids {worker_id}..{worker_id + processes - 1} ({processes} processes)"
    else:
        ids = f"worker id {worker_id}"
    log.info(
        "%s, datacenter %d, from %s (--worker-id %s)",
        ids, resolved.datacenter_id, origin.detail, worker_id_text(source),
        extra={
            "worker_id": worker_id,
            "datacenter_id": resolved.datacenter_id,
            "worker_id_source": origin.source,
        },
    )  # fmt: skip
    return resolved, origin


_ORDINAL = re.compile(r"-([0-9]+)$")


def _from_ordinal(settings: ServerSettings, hostname: str) -> tuple[ServerSettings, WorkerIdOrigin]:
    # A fully qualified name's first label is the pod's (or host's) own name.
    match = _ORDINAL.search(hostname.split(".", 1)[0])
    if match is None:
        raise ConfigurationError(
            f"--worker-id ordinal: the host name {hostname!r} does not end in -<number>, "
            "as a StatefulSet's pods do (snowflake-7 is worker 7)"
        )
    ordinal, processes, top = int(match[1]), settings.processes, settings.layout.max_worker_id
    first, last = ordinal * processes, (ordinal + 1) * processes - 1
    if last > top:
        ids = (
            f"worker id {first}"
            if processes == 1
            else f"worker ids {first}..{last} (ordinal {ordinal} x --processes {processes})"
        )
        raise ConfigurationError(
            f"--worker-id ordinal: the host name {hostname!r} gives {ids}, outside "
            f"0..{top} (--worker-id-bits {settings.worker_id_bits})"
        )
    origin = WorkerIdOrigin("ordinal", f"the host name {hostname}")
    return replace(settings, worker_id=first), origin


def _from_address(
    settings: ServerSettings, source: FromMachine, machine: Machine
) -> tuple[ServerSettings, WorkerIdOrigin]:
    layout = settings.layout
    mask = (1 << (layout.datacenter_id_bits + layout.worker_id_bits)) - 1
    found = _ipv4_address(settings.advertise_host, source, machine)
    address = found.address
    if source is FromMachine.IP:
        node = int(address) & mask
        detail = f"the IPv4 address {address} {found.where}"
        if address.is_loopback or address.is_unspecified:
            kind = "loopback" if address.is_loopback else "unspecified"
            _refuse_unless_forced(
                settings,
                f"the {kind} address {address} {found.where}",
                f"every machine has it, so all would take node id {node}",
                "Set --advertise-host to this host's own address",
            )
    else:
        holder = found.interface or _holder(found, source, machine)
        if holder.mac is None:
            raise ConfigurationError(
                f"--worker-id mac: {holder.name}, which holds {address}, has no MAC "
                "address (a tunnel?); use --worker-id ip or ordinal"
            )
        node = int.from_bytes(holder.mac, "big") & mask
        detail = f"the MAC address {holder.mac.hex(':')} of {holder.name} ({address})"
        why = _shared_mac(holder.mac)
        if why is not None:
            _refuse_unless_forced(settings, detail, f"it is {why}", "Use --worker-id ip or ordinal")
    resolved = replace(
        settings, datacenter_id=node >> layout.worker_id_bits, worker_id=node & layout.max_worker_id
    )
    return resolved, WorkerIdOrigin(source.value, detail)


def _shared_mac(mac: bytes) -> str | None:
    """Why ``mac`` may well be another machine's too, or None for a card's own."""
    if not any(mac):
        return "all zeros, not a network card's address"
    if mac[0] & 0x01:
        return "a multicast address (bit 0x01 of its first octet), not a network card's"
    if mac[0] & 0x02:
        return (
            "locally administered (bit 0x02 of its first octet): made up by software, as "
            "containers and VMs make theirs (Docker's 02:42:...), so other machines may "
            "have it too"
        )
    return None


def _refuse_unless_forced(settings: ServerSettings, what: str, why: str, instead: str) -> None:
    source = worker_id_text(settings.worker_id)
    if not settings.force_node_id:
        raise ConfigurationError(
            f"--worker-id {source}: refusing {what}: {why}. {instead}, or give "
            "--force-node-id to use it anyway"
        )
    log.warning("--worker-id %s: using %s as --force-node-id says, although %s", source, what, why)


@dataclass(frozen=True, slots=True)
class _Found:
    """An IPv4 address the node id comes from."""

    address: IPv4Address
    where: str
    """Where it was found, for messages: "of eth0", "given as --advertise-host"."""
    interface: Interface | None = None
    """The interface it was read from; None if it came from --advertise-host."""


def _ipv4_address(advertise_host: str, source: FromMachine, machine: Machine) -> _Found:
    if advertise_host:
        return _advertised(advertise_host, source, machine)
    interfaces = _interfaces(source, machine)
    usable = [(i, i.ipv4) for i in interfaces if i.up and i.ipv4 is not None]
    own = [(i, ipv4) for i, ipv4 in usable if not i.loopback and not ipv4.is_loopback]
    if not usable:
        seen = ", ".join(
            f"{i.name} ({'up' if i.up else 'down'}, {i.ipv4 or 'no IPv4 address'})"
            for i in interfaces
        )
        raise ConfigurationError(
            f"--worker-id {source.value}: no network interface is up with an IPv4 address "
            f"(found: {seen or 'none'}); set --advertise-host to this host's address"
        )
    # Only loopback left: taken, so that the refusal names it (--force-node-id allows it).
    interface, ipv4 = (own or usable)[0]
    return _Found(ipv4, f"of {interface.name}", interface)


def _advertised(host: str, source: FromMachine, machine: Machine) -> _Found:
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        pass  # a name
    else:
        if isinstance(literal, IPv4Address):
            return _Found(literal, "given as --advertise-host")
        raise ConfigurationError(
            f"--worker-id {source.value} needs an IPv4 address: --advertise-host {host} is IPv6"
        )
    try:
        addresses = machine.ipv4_addresses(host)
    except OSError as e:
        raise ConfigurationError(
            f"--worker-id {source.value}: --advertise-host {host} does not resolve to an "
            f"IPv4 address: {e.strerror or e}"
        ) from None
    if not addresses:
        raise ConfigurationError(
            f"--worker-id {source.value}: --advertise-host {host} resolves to no IPv4 address"
        )
    return _Found(IPv4Address(addresses[0]), f"of --advertise-host {host}")


def _holder(found: _Found, source: FromMachine, machine: Machine) -> Interface:
    for interface in _interfaces(source, machine):
        if interface.ipv4 == found.address:
            return interface
    raise ConfigurationError(
        f"--worker-id {source.value}: no network interface of this host holds "
        f"{found.address} {found.where}, so it has no MAC address to take; set "
        "--advertise-host to an address of this host's own"
    )


def _interfaces(source: FromMachine, machine: Machine) -> Sequence[Interface]:
    try:
        return machine.interfaces()
    except OSError as e:
        raise ConfigurationError(
            f"--worker-id {source.value}: cannot list the network interfaces: {e}"
        ) from None
