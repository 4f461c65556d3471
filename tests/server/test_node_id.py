"""--worker-id ordinal, ip and mac: the node id read from a machine given as host names,
interface tables and name lookups; and the reader of this machine's real interfaces."""

from __future__ import annotations

import errno
import logging
import socket
import struct
from collections.abc import Callable, Sequence
from ipaddress import IPv4Address
from typing import NoReturn

import pytest

from snowflake_server import ConfigurationError, ServerSettings
from snowflake_server._app.node_id import (
    Interface,
    Machine,
    WorkerIdOrigin,
    configured_origin,
    ipv4_addresses,
    linux_interfaces,
    resolve_worker_id,
)
from snowflake_server._config.settings import AUTO_WORKER_ID, FromMachine

ORDINAL, IP, MAC = FromMachine.ORDINAL, FromMachine.IP, FromMachine.MAC

LO = Interface("lo", up=True, loopback=True, ipv4=IPv4Address("127.0.0.1"), mac=bytes(6))


def nic(
    name: str, ipv4: str | None, mac: str | None = "00:16:3e:12:34:56", *, up: bool = True
) -> Interface:
    return Interface(
        name,
        up=up,
        loopback=False,
        ipv4=IPv4Address(ipv4) if ipv4 else None,
        mac=bytes.fromhex(mac.replace(":", "")) if mac else None,
    )


def unread(*_args: object) -> NoReturn:
    raise AssertionError("read although the source does not need it")


def machine(
    hostname: str = "unused",
    interfaces: Sequence[Interface] | None = None,
    dns: dict[str, list[str]] | None = None,
) -> Machine:
    """A machine with this host name, these interfaces and these DNS answers; reading
    anything not given fails the test."""

    def lookup(host: str) -> list[str]:
        if dns is None:
            unread()
        if host not in dns:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return dns[host]

    def listed() -> Sequence[Interface]:
        if interfaces is None:
            unread()
        return interfaces

    return Machine(hostname=lambda: hostname, interfaces=listed, ipv4_addresses=lookup)


def resolve(m: Machine, **settings: object) -> tuple[int, int, WorkerIdOrigin]:
    """(datacenter id, worker id, origin) for ``settings``."""
    resolved, origin = resolve_worker_id(ServerSettings(**settings), m)  # type: ignore[arg-type]
    assert isinstance(resolved.worker_id, int), "handed on as a plain number"
    return resolved.datacenter_id, resolved.worker_id, origin


# -- a number, auto ----------------------------------------------------------------------


def test_a_number_and_auto_are_returned_as_they_are_without_reading_the_machine() -> None:
    idle = Machine(hostname=unread, interfaces=unread, ipv4_addresses=unread)
    settings = ServerSettings(datacenter_id=2, worker_id=9)
    assert resolve_worker_id(settings, idle) == (settings, WorkerIdOrigin("number", "the settings"))
    leased = ServerSettings(worker_id=AUTO_WORKER_ID, zookeeper="zk:2181")
    assert resolve_worker_id(leased, idle) == (
        leased,
        WorkerIdOrigin("auto", "a lease from ZooKeeper"),
    )


def test_settings_still_to_read_from_the_machine_have_no_origin_yet() -> None:
    with pytest.raises(ConfigurationError, match="worker_id ordinal is read from this machine"):
        configured_origin(ServerSettings(worker_id=ORDINAL))


def test_the_id_and_where_it_came_from_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="snowflake_server")
    resolve(machine("snowflake-7"), worker_id=ORDINAL)
    resolve(machine("snowflake-7"), worker_id=ORDINAL, processes=2)
    resolve(machine(), worker_id=AUTO_WORKER_ID, zookeeper="zk:2181")
    assert caplog.messages == [
        "worker id 7, datacenter 0, from the host name snowflake-7 (--worker-id ordinal)",
        "worker ids 14..15 (2 processes), datacenter 0, from the host name snowflake-7 "
        "(--worker-id ordinal)",
        "worker id to be leased from ZooKeeper, datacenter 0, from a lease from ZooKeeper "
        "(--worker-id auto)",
    ]
    assert caplog.records[0].worker_id_source == "ordinal"  # type: ignore[attr-defined]


# -- ordinal -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostname", "worker_id"),
    [
        ("snowflake-7", 7),
        ("snowflake-0", 0),
        ("snowflake-31", 31),
        ("ids-eu-2-07", 7),  # only the last number counts
        ("snowflake-7.snowflake.ids.svc.cluster.local", 7),  # the first label
    ],
)
def test_the_host_names_trailing_number_is_the_worker_id(hostname: str, worker_id: int) -> None:
    assert resolve(machine(hostname), worker_id=ORDINAL, datacenter_id=3) == (
        3,
        worker_id,
        WorkerIdOrigin("ordinal", f"the host name {hostname}"),
    )


@pytest.mark.parametrize("hostname", ["snowflake", "snowflake7", "snowflake-", "node-3x", ""])
def test_a_host_name_without_a_trailing_number_is_refused_by_name(hostname: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        resolve(machine(hostname), worker_id=ORDINAL)
    assert str(refused.value) == (
        f"--worker-id ordinal: the host name {hostname!r} does not end in -<number>, as a "
        "StatefulSet's pods do (snowflake-7 is worker 7)"
    )


def test_an_ordinal_outside_the_worker_range_is_refused() -> None:
    with pytest.raises(ConfigurationError) as refused:
        resolve(machine("snowflake-32"), worker_id=ORDINAL)
    assert str(refused.value) == (
        "--worker-id ordinal: the host name 'snowflake-32' gives worker id 32, outside 0..31 "
        "(--worker-id-bits 5)"
    )
    # Wider worker ids (the datacenter narrower, to keep the layout's 63 bits) hold it.
    assert resolve(machine("snowflake-32"), worker_id=ORDINAL, worker_id_bits=6,
                   datacenter_id_bits=4)[1] == 32  # fmt: skip


def test_processes_take_ordinal_times_processes_plus_their_index() -> None:
    """--processes 4 on pod snowflake-3: the supervisor starts from 12, its children
    are 12, 13, 14, 15; pod snowflake-4 starts at 16: no overlap."""
    assert resolve(machine("snowflake-3"), worker_id=ORDINAL, processes=4)[1] == 12
    assert resolve(machine("snowflake-4"), worker_id=ORDINAL, processes=4)[1] == 16
    assert resolve(machine("snowflake-7"), worker_id=ORDINAL, processes=4)[1] == 28
    with pytest.raises(ConfigurationError) as refused:
        resolve(machine("snowflake-8"), worker_id=ORDINAL, processes=4)
    assert str(refused.value) == (
        "--worker-id ordinal: the host name 'snowflake-8' gives worker ids 32..35 "
        "(ordinal 8 x --processes 4), outside 0..31 (--worker-id-bits 5)"
    )


# -- ip ----------------------------------------------------------------------------------


def test_ip_splits_the_low_bits_over_the_datacenter_and_worker_ids() -> None:
    # 10.9.8.7 is 0x0a090807: its low 10 bits are 0x007, datacenter 0 and worker 7.
    interfaces = [LO, nic("eth0", "10.9.8.7")]
    assert resolve(machine(interfaces=interfaces), worker_id=IP) == (
        0,
        7,
        WorkerIdOrigin("ip", "the IPv4 address 10.9.8.7 of eth0"),
    )
    # 10.0.1.5: 0x105 = 261 = datacenter 8 (261 >> 5), worker 5 (261 & 31).
    assert resolve(machine(interfaces=[nic("eth0", "10.0.1.5")]), worker_id=IP)[:2] == (8, 5)
    # Other widths, the same 10 bits: 261 >> 7 = 2, 261 & 127 = 5.
    assert resolve(machine(interfaces=[nic("eth0", "10.0.1.5")]), worker_id=IP,
                   datacenter_id_bits=3, worker_id_bits=7)[:2] == (2, 5)  # fmt: skip


def test_addresses_alike_in_their_low_bits_collide() -> None:
    """What docs/operations.md warns about: 10.0.1.5 and 10.0.5.5 differ only above the
    low 10 bits (the third octets 1 and 5 end in the same two bits)."""
    ids = {
        resolve(machine(interfaces=[nic("eth0", address)]), worker_id=IP)[:2]
        for address in ("10.0.1.5", "10.0.5.5", "192.168.253.5")
    }
    assert ids == {(8, 5)}


def test_ip_takes_the_first_interface_up_with_an_address_of_its_own() -> None:
    interfaces = [
        LO,
        nic("eth0", "10.0.0.1", up=False),
        nic("eth1", None),
        nic("eth2", "10.0.0.2"),
        nic("eth3", "10.0.0.3"),
    ]
    assert resolve(machine(interfaces=interfaces), worker_id=IP)[2].detail == (
        "the IPv4 address 10.0.0.2 of eth2"
    )


def test_ip_refuses_loopback_unless_forced(caplog: pytest.LogCaptureFixture) -> None:
    alone = machine(interfaces=[nic("eth0", None), LO])
    with pytest.raises(ConfigurationError) as refused:
        resolve(alone, worker_id=IP)
    assert str(refused.value) == (
        "--worker-id ip: refusing the loopback address 127.0.0.1 of lo: every machine has "
        "it, so all would take node id 1. Set --advertise-host to this host's own address, "
        "or give --force-node-id to use it anyway"
    )
    assert resolve(alone, worker_id=IP, force_node_id=True)[:2] == (0, 1)
    assert "using the loopback address 127.0.0.1 of lo as --force-node-id says" in caplog.text


def test_advertise_host_is_the_address_when_given() -> None:
    not_read = machine(dns={})
    assert resolve(not_read, worker_id=IP, advertise_host="10.0.1.5") == (
        8,
        5,
        WorkerIdOrigin("ip", "the IPv4 address 10.0.1.5 given as --advertise-host"),
    )
    named = machine(dns={"ids-3.example.com": ["10.0.1.5", "10.0.9.9"]})
    assert resolve(named, worker_id=IP, advertise_host="ids-3.example.com")[2].detail == (
        "the IPv4 address 10.0.1.5 of --advertise-host ids-3.example.com"
    )


@pytest.mark.parametrize(
    ("advertise_host", "message"),
    [
        ("nowhere.example", "--worker-id ip: --advertise-host nowhere.example does not resolve "
         "to an IPv4 address: Name or service not known"),
        ("v6only.example", "--worker-id ip: --advertise-host v6only.example resolves to no IPv4 "
         "address"),
        ("fd00::5", "--worker-id ip needs an IPv4 address: --advertise-host fd00::5 is IPv6"),
        ("debian-host", "--worker-id ip: refusing the loopback address 127.0.1.1 of "
         "--advertise-host debian-host: every machine has it"),
        ("0.0.0.0", "--worker-id ip: refusing the unspecified address 0.0.0.0 given as "
         "--advertise-host: every machine has it, so all would take node id 0"),
    ],
)  # fmt: skip
def test_an_advertise_host_that_gives_no_address_of_this_host_is_refused(
    advertise_host: str, message: str
) -> None:
    # Debian maps the host's own name to 127.0.1.1 in /etc/hosts.
    dns = {"v6only.example": [], "debian-host": ["127.0.1.1"]}
    with pytest.raises(ConfigurationError) as refused:
        resolve(machine(dns=dns), worker_id=IP, advertise_host=advertise_host)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("source", [IP, MAC])
def test_no_usable_interface_is_refused(source: FromMachine) -> None:
    with pytest.raises(ConfigurationError) as refused:
        resolve(machine(interfaces=[]), worker_id=source)
    assert str(refused.value) == (
        f"--worker-id {source.value}: no network interface is up with an IPv4 address "
        "(found: none); set --advertise-host to this host's address"
    )
    down = [Interface("lo", up=False, loopback=True), nic("eth0", "10.0.0.1", up=False)]
    with pytest.raises(ConfigurationError, match=r"\(found: lo \(down, no IPv4 address\), "
                       r"eth0 \(down, 10\.0\.0\.1\)\)"):  # fmt: skip
        resolve(machine(interfaces=down), worker_id=source)


def test_interfaces_that_cannot_be_listed_are_a_configuration_error() -> None:
    def fails() -> list[Interface]:
        raise OSError(errno.EACCES, "Permission denied")

    m = Machine(hostname=unread, interfaces=fails, ipv4_addresses=unread)
    with pytest.raises(ConfigurationError, match=r"--worker-id mac: cannot list the network "
                       r"interfaces: .*Permission denied"):  # fmt: skip
        resolve(m, worker_id=MAC)


# -- mac ---------------------------------------------------------------------------------


def test_mac_takes_the_low_bits_of_the_interface_holding_the_address() -> None:
    # 0x3456: the low 10 bits are 0x056 = 86: datacenter 2 (86 >> 5), worker 22 (86 & 31).
    interfaces = [
        LO,
        nic("eth0", "10.9.8.7", "00:16:3e:12:34:56"),
        nic("eth1", "10.1.1.1", "00:16:3e:00:00:01"),
    ]
    assert resolve(machine(interfaces=interfaces), worker_id=MAC) == (
        2,
        22,
        WorkerIdOrigin("mac", "the MAC address 00:16:3e:12:34:56 of eth0 (10.9.8.7)"),
    )
    # --advertise-host picks the interface; a name is looked up first.
    named = machine(interfaces=interfaces, dns={"ids-1": ["10.1.1.1"]})
    assert resolve(named, worker_id=MAC, advertise_host="ids-1")[:2] == (0, 1)


@pytest.mark.parametrize(
    ("mac", "why"),
    [
        ("00:00:00:00:00:00", "all zeros, not a network card's address"),
        ("01:00:5e:00:00:fb", "a multicast address (bit 0x01 of its first octet)"),
        ("02:42:ac:11:00:02", "locally administered (bit 0x02 of its first octet): made up "
         "by software, as containers and VMs make theirs (Docker's 02:42:...), so other "
         "machines may have it too"),
        ("52:54:00:12:34:56", "locally administered"),  # QEMU/libvirt's prefix
    ],
)  # fmt: skip
def test_mac_refuses_addresses_other_machines_may_share_unless_forced(
    mac: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    m = machine(interfaces=[nic("eth0", "172.17.0.2", mac)])
    with pytest.raises(ConfigurationError) as refused:
        resolve(m, worker_id=MAC)
    message = str(refused.value)
    assert message.startswith(
        f"--worker-id mac: refusing the MAC address {mac} of eth0 (172.17.0.2): it is {why}"
    )
    assert message.endswith(
        "Use --worker-id ip or ordinal, or give --force-node-id to use it anyway"
    )
    low = int(mac.replace(":", "")[-3:], 16) & 0x3FF
    assert resolve(m, worker_id=MAC, force_node_id=True)[:2] == (low >> 5, low & 31)
    assert (
        f"using the MAC address {mac} of eth0 (172.17.0.2) as --force-node-id says" in caplog.text
    )


def test_mac_of_loopback_is_all_zeros() -> None:
    with pytest.raises(ConfigurationError, match=r"00:00:00:00:00:00 of lo .* all zeros"):
        resolve(machine(interfaces=[LO]), worker_id=MAC)


def test_mac_needs_an_interface_holding_the_address_and_a_mac_on_it() -> None:
    interfaces = [LO, nic("eth0", "10.0.0.1"), nic("wg0", "10.8.0.1", None)]
    with pytest.raises(ConfigurationError) as refused:
        resolve(machine(interfaces=interfaces), worker_id=MAC, advertise_host="192.0.2.1")
    assert str(refused.value) == (
        "--worker-id mac: no network interface of this host holds 192.0.2.1 given as "
        "--advertise-host, so it has no MAC address to take; set --advertise-host to an "
        "address of this host's own"
    )
    with pytest.raises(ConfigurationError) as refused:
        resolve(machine(interfaces=interfaces), worker_id=MAC, advertise_host="10.8.0.1")
    assert str(refused.value) == (
        "--worker-id mac: wg0, which holds 10.8.0.1, has no MAC address (a tunnel?); use "
        "--worker-id ip or ordinal"
    )


# -- reading the interfaces --------------------------------------------------------------


def ifreq(*, flags: int = 0, family: int = 0, data: bytes = b"") -> bytes:
    """A filled-out struct ifreq: flags, or a struct sockaddr (family, then its data)."""
    union = struct.pack("H", flags) if not family else struct.pack("H", family) + data
    return bytes(16) + union.ljust(24, b"\0")


def kernel(replies: dict[tuple[int, str], bytes | OSError]) -> Callable[[int, str], bytes]:
    def ask(request: int, name: str) -> bytes:
        reply = replies[(request, name)]
        if isinstance(reply, OSError):
            raise reply
        return reply

    return ask


FLAGS, ADDR, HWADDR = 0x8913, 0x8915, 0x8927


def test_interfaces_are_read_from_the_kernels_replies() -> None:
    gone = OSError(errno.ENODEV, "No such device")
    none = OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
    replies: dict[tuple[int, str], bytes | OSError] = {
        (FLAGS, "lo"): ifreq(flags=0x49),  # UP, LOOPBACK, RUNNING
        (HWADDR, "lo"): ifreq(family=772, data=bytes(14)),
        (ADDR, "lo"): ifreq(family=socket.AF_INET, data=bytes(2) + bytes([127, 0, 0, 1])),
        (FLAGS, "gone0"): gone,
        (FLAGS, "eth0"): ifreq(flags=0x1003),  # UP, BROADCAST, MULTICAST
        (HWADDR, "eth0"): ifreq(family=1, data=bytes.fromhex("00163e123456") + bytes(8)),
        (ADDR, "eth0"): ifreq(family=socket.AF_INET, data=bytes(2) + bytes([10, 9, 8, 7])),
        (FLAGS, "tun0"): ifreq(flags=0x10),  # down, POINTOPOINT
        (HWADDR, "tun0"): ifreq(family=0xFFFE),  # ARPHRD_NONE: no link-layer address
        (ADDR, "tun0"): none,
    }
    names = [(1, "lo"), (2, "gone0"), (3, "eth0"), (4, "tun0")]
    assert linux_interfaces(lambda: names, kernel(replies)) == [
        LO,
        Interface("eth0", True, False, IPv4Address("10.9.8.7"), bytes.fromhex("00163e123456")),
        Interface("tun0", False, False, None, None),
    ]


def test_this_machines_interfaces_include_loopback() -> None:
    """The real reader, on whatever this machine has: loopback at least."""
    interfaces = {i.name: i for i in linux_interfaces()}
    assert interfaces["lo"] == LO, interfaces
    for interface in interfaces.values():
        assert interface.mac is None or len(interface.mac) == 6


def test_names_are_resolved_to_ipv4_addresses() -> None:
    # A literal needs no resolver (the tests may run without DNS).
    assert ipv4_addresses("127.0.0.1") == ["127.0.0.1"]
