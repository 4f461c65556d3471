"""--worker-id ordinal, ip and mac against real processes, each in namespaces of its own:
a host name set with ``unshare --uts``, and an interface made with ``unshare --net``.

They need root (the suite runs as root in CI and in the Debian chroot) and iproute2
(``make system-deps`` installs it). Where the kernel or the sandbox refuses the
namespace itself, the tests skip and say why.
"""

from __future__ import annotations

import functools
import json
import shlex
import subprocess
import sys

import pytest
from kazoo.client import KazooClient
from snowflake_thrift_client import decompose

from tests.support.processes import ServerDidNotStart, ServerProcess, parse_metrics, start_server
from tests.support.zookeeper import ZooKeeper

# d0 is a dummy interface; where the dummy module is missing, one end of a veth pair
# (its peer, d1, has no IPv4 address, so it is never chosen).
NETWORK = (
    "set -e; ip link set lo up; "
    "ip link add d0 type dummy 2>/dev/null || ip link add d0 type veth peer name d1; "
    "ip link set d0 address {mac}; ip addr add 10.9.8.7/24 dev d0; ip link set d0 up"
)
HARDWARE_MAC = "00:16:3e:12:34:56"  # Xen's prefix: globally administered, unicast


@functools.cache
def namespace_refusal(kind: str) -> str | None:
    """Why ``unshare --<kind>`` cannot run here, or None if it can."""
    try:
        ran = subprocess.run(
            ["unshare", f"--{kind}", "true"], capture_output=True, text=True, timeout=30
        )
    except FileNotFoundError:
        return "unshare (util-linux) is missing"
    if ran.returncode != 0:
        return f"unshare --{kind} fails here (not root, or a sandbox): {ran.stderr.strip()}"
    return None


def inside(kind: str, setup: str) -> list[str]:
    """A wrapper running the server in a new ``kind`` namespace after ``setup``."""
    why = namespace_refusal(kind)
    if why is not None:
        pytest.skip(why)
    return ["unshare", f"--{kind}", "sh", "-c", f'{setup} && exec "$@"', "sh"]


def host_named(name: str) -> list[str]:
    return inside("uts", f"hostname {shlex.quote(name)}")


def with_interface(mac: str) -> list[str]:
    return inside("net", NETWORK.format(mac=mac))


def readyz(server: ServerProcess) -> dict[str, object]:
    status, body = server.http_get("/readyz")
    assert status == 200, body
    answer: dict[str, object] = json.loads(body)
    return answer


def readyz_in_its_network(server: ServerProcess) -> dict[str, object]:
    """/readyz of a server in a network namespace of its own, asked from inside it (the
    test's own 127.0.0.1 is another one)."""
    ask = (
        "import urllib.request; print(urllib.request.urlopen("
        f"'http://127.0.0.1:{server.metrics_port}/readyz', timeout=5).read().decode())"
    )
    answer = subprocess.run(
        ["nsenter", f"--net=/proc/{server.process.pid}/ns/net", sys.executable, "-c", ask],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    body: dict[str, object] = json.loads(answer.stdout)
    return body


# -- ordinal: the host name --------------------------------------------------------------


def test_the_pod_snowflake_7_serves_worker_7() -> None:
    server = start_server("--worker-id", "ordinal", "--datacenter-id", "1",
                          wrapper=host_named("snowflake-7"))  # fmt: skip
    try:
        assert server.raw_client().get_worker_id() == 7
        assert decompose(server.raw_client().get_id("ordinal")).worker_id == 7
        body = readyz(server)
        assert (body["worker_id"], body["datacenter_id"]) == (7, 1)
        assert body["worker_id_source"] == "ordinal"
        assert body["worker_id_from"] == "the host name snowflake-7"
        info = 'snowflake_info{datacenter_id="1",worker_id="7",worker_id_source="ordinal"}'
        assert parse_metrics(server.metrics())[info] == 1
        assert (
            "worker id 7, datacenter 1, from the host name snowflake-7 (--worker-id ordinal)"
            in server.log()
        )
    finally:
        assert server.stop() == 0, server.log()


def test_a_host_name_without_an_ordinal_exits_2_naming_it() -> None:
    with pytest.raises(ServerDidNotStart) as refused:
        start_server("--worker-id", "ordinal", wrapper=host_named("snowflake"))
    assert refused.value.returncode == 2, refused.value.log
    assert (
        "snowflake-server: error: --worker-id ordinal: the host name 'snowflake' does not "
        "end in -<number>" in refused.value.log
    )


def test_processes_of_pod_snowflake_7_serve_workers_14_and_15() -> None:
    server = start_server("--worker-id", "ordinal", "--processes", "2",
                          wrapper=host_named("snowflake-7"))  # fmt: skip
    try:
        workers = {server.raw_client().get_worker_id() for _ in range(40)}
        assert workers == {14, 15}, "the kernel spreads new connections over both"
        body = readyz(server)
        assert (body["worker_id_source"], body["worker_id_from"]) == (
            "ordinal",
            "the host name snowflake-7",
        )
        counts = parse_metrics(server.metrics())
        for process, worker in (("0", 14), ("1", 15)):
            info = (
                f'snowflake_info{{datacenter_id="0",process="{process}",worker_id="{worker}",'
                'worker_id_source="ordinal"}'
            )
            assert counts.get(info) == 1, sorted(k for k in counts if "info" in k)
        assert "worker ids 14..15 (2 processes), datacenter 0, from the host name" in server.log()
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.zookeeper
def test_with_zookeeper_an_ordinal_is_a_fixed_id_registered_and_checked(
    zookeeper: ZooKeeper, zk: KazooClient, zk_path: str
) -> None:
    """Two pods of one name (two StatefulSets, one ZooKeeper path): the second is
    refused, as a second node given one fixed worker id is."""
    flags = ("--worker-id", "ordinal", "--zookeeper", zookeeper.hosts, "--zk-path", zk_path,
             "--zk-connect-timeout", "5", "--advertise-host", "127.0.0.1")  # fmt: skip
    first = start_server(*flags, wrapper=host_named("snowflake-7"))
    try:
        assert zk.exists(f"{zk_path}/nodes/0/7") is not None
        assert readyz(first)["registered"] == f"{zk_path}/nodes/0/7"
        with pytest.raises(ServerDidNotStart) as refused:
            start_server(*flags, wrapper=host_named("snowflake-7"), timeout_s=30)
        assert refused.value.returncode == 75, refused.value.log  # a restart passes once it goes
        assert "worker id 7 of datacenter 0 is registered by 127.0.0.1:" in refused.value.log
    finally:
        assert first.stop() == 0, first.log()


# -- ip and mac: an interface of the test's own ------------------------------------------


def test_ip_takes_its_node_id_from_the_interfaces_address() -> None:
    # 10.9.8.7 = 0x0a090807: the low 10 bits are 7: datacenter 0, worker 7.
    server = start_server("--worker-id", "ip", wrapper=with_interface(HARDWARE_MAC))
    try:
        body = readyz_in_its_network(server)
        assert (body["datacenter_id"], body["worker_id"]) == (0, 7)
        assert body["worker_id_source"] == "ip"
        assert body["worker_id_from"] == "the IPv4 address 10.9.8.7 of d0"
    finally:
        assert server.stop() == 0, server.log()


def test_mac_takes_its_node_id_from_the_interfaces_mac_address() -> None:
    # ...:34:56: the low 10 bits are 0x056 = 86: datacenter 2 (86 >> 5), worker 22.
    server = start_server("--worker-id", "mac", wrapper=with_interface(HARDWARE_MAC))
    try:
        body = readyz_in_its_network(server)
        assert (body["datacenter_id"], body["worker_id"]) == (2, 22)
        assert body["worker_id_from"] == f"the MAC address {HARDWARE_MAC} of d0 (10.9.8.7)"
        assert "worker id 22, datacenter 2, from the MAC address" in server.log()
    finally:
        assert server.stop() == 0, server.log()


def test_a_locally_administered_mac_is_refused_unless_forced() -> None:
    docker_like = "02:42:0a:09:08:07"
    with pytest.raises(ServerDidNotStart) as refused:
        start_server("--worker-id", "mac", wrapper=with_interface(docker_like))
    assert refused.value.returncode == 2, refused.value.log
    assert (
        f"snowflake-server: error: --worker-id mac: refusing the MAC address {docker_like} "
        "of d0 (10.9.8.7): it is locally administered" in refused.value.log
    )
    server = start_server("--worker-id", "mac", "--force-node-id",
                          wrapper=with_interface(docker_like))  # fmt: skip
    try:
        body = readyz_in_its_network(server)
        assert (body["datacenter_id"], body["worker_id"]) == (0, 7)  # 0x807: low 10 bits 7
        assert "as --force-node-id says, although it is locally administered" in server.log()
    finally:
        assert server.stop() == 0, server.log()
