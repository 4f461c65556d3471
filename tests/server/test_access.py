"""Who may touch the ids in ZooKeeper: SASL and digest identities, the service's ACL on
every znode it creates, the start-up checks, and the migration of an open tree.

Against real ZooKeepers with SASL (a JAAS file of users) and a digest superuser; the
nodes are ``Cluster``s in this process (``test_membership``'s ``member``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import ACL, Id, Permissions, make_digest_acl_credential
from snowflake_thrift_client import ZooKeeperDiscovery
from snowflake_thrift_client._zkkazoo import KAZOO_LOGGERS, HideCredentials

from snowflake_server import UnavailableError, decompose
from snowflake_server._cli import main as snowflake
from snowflake_server._cluster.access import describe_acl, lock_tree, read_tree_acls
from snowflake_server._errors import ConfigurationError
from tests.server.test_membership import (  # noqa: F401 - fixtures
    T0,
    Make,
    member,
    own_zookeeper,
)
from tests.support.zookeeper import KAZOO_TLS_SOCKETS, ZkTls, ZooKeeper

pytestmark = pytest.mark.zookeeper

USERS = {
    "snowflake": "service-secret",
    "snowflake2": "next-secret",
    "other": "other-secret",
    "reader": "reader-secret",
}
SUPER = "break-glass-secret"
ALL_SERVICE = ACL(Permissions.ALL, Id("sasl", "snowflake"))
WORLD_READ = ACL(Permissions.READ, Id("world", "anyone"))

log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def sasl_zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeper]:
    zk = ZooKeeper(tmp_path_factory.mktemp("sasl-zk"), sasl_users=USERS, super_password=SUPER)
    zk.start()
    yield zk
    zk.stop()


def credentials(
    directory: Path, user: str, password: str, *also: str, mode: int = 0o600, reader: str = ""
) -> str:
    """A credentials file of ``user`` (chmod ``mode``), trusting ``also``, letting
    ``reader`` read."""
    path = directory / f"{user}-{len(list(directory.glob('*.cred')))}.cred"
    lines = [f"user = {user}", f"password = {password}", *(f"also = {a}" for a in also)]
    lines += [f"reader = {reader}"] if reader else []
    path.write_text("# test credentials\n" + "\n".join(lines) + "\n")
    path.chmod(mode)
    return str(path)


def sasl(user: str, password: str | None = None) -> dict[str, Any]:
    pw = USERS[user] if password is None else password
    return {"sasl_options": {"mechanism": "DIGEST-MD5", "username": user, "password": pw}}


@pytest.fixture
def clients(sasl_zk: ZooKeeper) -> Iterator[Any]:
    """``clients(**options)``: started clients of the SASL ZooKeeper, closed after."""
    made: list[KazooClient] = []

    def make(**options: Any) -> KazooClient:
        client = sasl_zk.client(**options)
        client.start(10)
        made.append(client)
        return client

    yield make
    for client in made:
        client.stop()
        client.close()


def service_node(member: Make, sasl_zk: ZooKeeper, tmp_path: Path, **overrides: Any) -> Any:  # noqa: F811
    settings: dict[str, Any] = {
        "zk_auth": "sasl",
        "zk_credentials_file": credentials(tmp_path, "snowflake", USERS["snowflake"]),
    }
    return member(hosts=sasl_zk.hosts, **{**settings, **overrides})


def tree(client: KazooClient, root: str) -> dict[str, list[ACL] | None]:
    return read_tree_acls(client, root, 10.0).acls


def every_write_refused(client: KazooClient, who: str, paths: list[str]) -> list[str]:
    """Try every write on each of ``paths`` as ``client``: each must raise NoAuthError.
    The attempts, one line each (printed: the closing note shows them)."""
    attempts: tuple[tuple[str, Callable[[str], object]], ...] = (
        ("set", lambda p: client.set(p, b"0")),
        ("delete", lambda p: client.delete(p, recursive=False)),
        ("create under", lambda p: client.create(f"{p}/intruder", b"")),
        ("set ACL of", lambda p: client.set_acls(p, [ACL(31, Id("world", "anyone"))])),
    )
    refused = []
    for path in paths:
        for attempt, call in attempts:
            with pytest.raises(NoAuthError):
                call(path)
            refused.append(f"{who}: {attempt} {path}: NoAuthError")
    print("\n".join(refused))
    return refused


def test_every_znode_the_service_creates_lets_only_the_service_write(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    clients: Any,
    zk_path: str,
    tmp_path: Path,
) -> None:
    # --zk-path below a parent the nodes make: ensure_path gives it their ACL too.
    root = f"{zk_path}/cluster"
    first = service_node(member, sasl_zk, tmp_path, worker_id=1, zk_path=root).join()
    second = service_node(member, sasl_zk, tmp_path, worker_id=2, zk_path=root).join()
    for node in (first, second):
        node.clock.now += 3000
        assert decompose(node.slot.next_id()).timestamp_ms == node.clock.now  # renews the mark
    anonymous = clients()
    acls = tree(anonymous, zk_path)
    expected = {
        zk_path, root, f"{root}/layout", f"{root}/nodes", f"{root}/nodes/0",
        f"{root}/nodes/0/1", f"{root}/nodes/0/2", f"{root}/marks",
        f"{root}/marks/0", f"{root}/marks/0/1", f"{root}/marks/0/2",
    }  # fmt: skip
    assert set(acls) == expected
    for path, acl in sorted(acls.items()):
        # For the closing note: run with -s to see every znode's getAcl.
        print(f"getAcl {path}: {acl}")
        assert acl == [ALL_SERVICE, WORLD_READ], path


@pytest.mark.parametrize("who", ["anonymous", "other sasl user", "digest user"])
def test_others_read_but_cannot_set_delete_or_create_any_znode_of_the_service(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    clients: Any,
    zk_path: str,
    tmp_path: Path,
    who: str,
) -> None:
    # Deleting a znode is its parent's right: under "/" (anyone's) --zk-path itself could
    # be deleted once empty, so the service's tree sits below a parent the nodes made.
    root = f"{zk_path}/c"
    node = service_node(member, sasl_zk, tmp_path, worker_id=4, zk_path=root).join()
    options = {
        "anonymous": {},
        "other sasl user": sasl("other"),
        "digest user": {"auth_data": [("digest", "snowflake:service-secret")]},
    }[who]
    intruder = clients(**options)
    paths = sorted(tree(intruder, zk_path))
    paths.remove(zk_path)  # "/"'s child: deleting it is "/"'s right (it is not empty)
    for path in paths:
        intruder.get(path)  # world may read
    refused = every_write_refused(intruder, who, paths)
    assert len(refused) == 4 * 8  # c, layout, nodes, nodes/0, nodes/0/4, marks, marks/0, marks/0/4
    assert node.slot.serving and decompose(node.slot.next_id()).worker_id == 4


def test_with_service_read_others_cannot_even_read(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    clients: Any,
    zk_path: str,
    tmp_path: Path,
) -> None:
    service_node(member, sasl_zk, tmp_path, worker_id=1, zk_read_acl="service").join()
    path = f"{zk_path}/nodes/0/1"
    for options in ({}, sasl("other")):
        with pytest.raises(NoAuthError):
            clients(**options).get(path)
    assert clients(**sasl("snowflake")).get_acls(path)[0] == [ALL_SERVICE]
    # Discovery: with the service's credentials it finds the node; without, ZooKeeper refuses.
    file = credentials(tmp_path, "snowflake", USERS["snowflake"])
    with ZooKeeperDiscovery(sasl_zk.hosts, zk_path, auth="sasl", credentials_file=file) as found:
        assert len(found()) == 1
    with (
        ZooKeeperDiscovery(sasl_zk.hosts, zk_path) as anonymous,
        pytest.raises(ConfigurationError, match="their ACL lets only the service read"),
    ):
        anonymous()


def test_a_reader_identity_lists_the_nodes_and_can_change_nothing(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    clients: Any,
    zk_path: str,
    tmp_path: Path,
) -> None:
    """--zk-read-acl service: discovery clients log in as a reader the nodes' file names,
    never as the service (which may write)."""
    root = f"{zk_path}/c"  # below a parent the nodes make: see the test above
    nodes_file = credentials(tmp_path, "snowflake", USERS["snowflake"], reader="sasl:reader")
    settings = {"zk_auth": "sasl", "zk_credentials_file": nodes_file, "zk_read_acl": "service"}
    node = member(hosts=sasl_zk.hosts, worker_id=3, zk_path=root, **settings).join()
    reader_file = credentials(tmp_path, "reader", USERS["reader"])
    as_reader: dict[str, Any] = {"auth": "sasl", "credentials_file": reader_file}
    with ZooKeeperDiscovery(sasl_zk.hosts, root, **as_reader) as found:
        assert found() == [node.address]
    reader = clients(**sasl("reader"))
    paths = sorted(tree(reader, zk_path))
    assert len(paths) == 9  # zk_path, c, layout, nodes, nodes/0, nodes/0/3, marks, ...
    for path in paths[1:]:  # zk_path is "/"'s child: deleting it is "/"'s right
        acl, _ = reader.get_acls(path)
        assert acl == [ALL_SERVICE, ACL(Permissions.READ, Id("sasl", "reader"))], path
    assert len(every_write_refused(reader, "reader", paths[1:])) == 4 * len(paths[1:])
    # The start-up check counts the reader neither as the service nor as a writer.
    other = member(hosts=sasl_zk.hosts, worker_id=4, zk_path=root, **settings).join()
    assert other.slot.serving


def test_discovery_reads_world_readable_registrations_without_credentials(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    zk_path: str,
    tmp_path: Path,
) -> None:
    node = service_node(member, sasl_zk, tmp_path, worker_id=3).join()
    with ZooKeeperDiscovery(sasl_zk.hosts, zk_path) as found:
        assert found() == [node.address]


def test_wrong_sasl_credentials_are_a_configuration_error(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    tmp_path: Path,
) -> None:
    file = credentials(tmp_path, "snowflake", "not-the-password")
    node = member(hosts=sasl_zk.hosts, zk_auth="sasl", zk_credentials_file=file)
    with pytest.raises(ConfigurationError) as refused:
        node.cluster.connect()
    print(refused.value)
    assert str(refused.value).startswith("ZooKeeper refused the credentials of sasl:snowflake")
    assert "not-the-password" not in str(refused.value)


def test_a_wrong_digest_password_is_found_by_the_acls(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    zk_path: str,
    tmp_path: Path,
) -> None:
    right = credentials(tmp_path, "svc", "right")
    member(hosts=sasl_zk.hosts, worker_id=1, zk_auth="digest", zk_credentials_file=right).join()
    wrong = credentials(tmp_path, "svc", "wrong")
    node = member(hosts=sasl_zk.hosts, worker_id=2, zk_auth="digest", zk_credentials_file=wrong)
    with pytest.raises(ConfigurationError) as refused:
        node.cluster.connect()
    print(refused.value)
    assert "does not let this node, digest:svc" in str(refused.value)
    assert f"{zk_path} (digest:svc=ALL, world:anyone=READ)" in str(refused.value)


def test_a_tree_open_to_others_is_refused_naming_the_znodes(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    zk_path: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    open_node = member(hosts=sasl_zk.hosts, worker_id=1).join()  # no auth: an open tree
    assert "anyone who can reach the ensemble can delete a registration" in caplog.text
    node = service_node(member, sasl_zk, tmp_path, worker_id=2)
    with pytest.raises(ConfigurationError) as refused:
        node.cluster.connect()
    print(refused.value)
    message = str(refused.value)
    assert message.startswith(f"znodes of the service under {zk_path} let others than sasl:")
    assert f"{zk_path}/nodes/0/1 (world:anyone=ALL)" in message
    assert f"{zk_path}/marks/0/1 (world:anyone=ALL)" in message
    assert open_node.slot.serving


OPEN = [ACL(Permissions.ALL, Id("world", "anyone"))]


@pytest.mark.parametrize("made", ["open", "open below, the service's on top", "another's"])
def test_a_zk_path_someone_else_made_since_the_first_check_is_refused(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    clients: Any,
    zk_path: str,
    tmp_path: Path,
    made: str,
) -> None:
    """The first start's race: the check at connect passes on a tree not made yet; an
    intruder makes --zk-path before the node does; the node must not register in it."""
    node = service_node(member, sasl_zk, tmp_path, worker_id=1)
    node.cluster.connect()
    # Meanwhile (between the check and the first registration), the intruder moves.
    intruder = clients(**sasl("other"))
    if made == "open":
        intruder.create(zk_path, b"", acl=OPEN)
        named = f"{zk_path} (world:anyone=ALL)"
    elif made == "open below, the service's on top":
        # A mark to lower later, then the root handed the service's ACL to look right.
        intruder.create(f"{zk_path}/marks/0/1", b"0", acl=OPEN, makepath=True)
        intruder.set_acls(zk_path, [ALL_SERVICE, WORLD_READ])
        named = f"{zk_path}/marks/0/1 (world:anyone=ALL)"
    else:
        intruder.create(zk_path, b"", acl=[ACL(Permissions.ALL, Id("sasl", "other"))])
        named = f"{zk_path} (not readable by it)"
    with pytest.raises(ConfigurationError) as refused:
        node.cluster.register()
    print(refused.value)
    assert named in str(refused.value)
    assert not node.slot.serving
    glass = clients(auth_data=[("digest", f"super:{SUPER}")])
    assert glass.exists(f"{zk_path}/nodes/0/1") is None, "nothing registered"


def test_a_znode_whose_children_the_service_may_not_list_is_refused(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    clients: Any,
    zk_path: str,
    tmp_path: Path,
) -> None:
    """What is under it went unread, so it could be anyone's: refused, not skipped."""
    service_node(member, sasl_zk, tmp_path, worker_id=1).join()
    glass = clients(auth_data=[("digest", f"super:{SUPER}")])
    glass.create(f"{zk_path}/marks/0/9", b"0", acl=OPEN)
    no_read = Permissions.ALL & ~Permissions.READ
    glass.set_acls(f"{zk_path}/marks/0", [ACL(no_read, Id("sasl", "snowflake"))])
    node = service_node(member, sasl_zk, tmp_path, worker_id=2)
    with pytest.raises(ConfigurationError) as refused:
        node.cluster.connect()
    print(refused.value)
    assert f"{zk_path}/marks/0 (sasl:snowflake=" in str(refused.value)
    assert "its children not listable by it" in str(refused.value)


def test_one_zk_acl_run_locks_children_unlistable_until_their_parent_was_locked(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    clients: Any,
    zk_path: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    member(hosts=sasl_zk.hosts, worker_id=1).join()  # no auth: an open tree
    glass = clients(auth_data=[("digest", f"super:{SUPER}")])
    # The service may change this one's ACL, not list its children (yet).
    glass.set_acls(f"{zk_path}/marks/0", [ACL(Permissions.ADMIN, Id("sasl", "snowflake"))])
    file = credentials(tmp_path, "snowflake", USERS["snowflake"])
    command = ["zk-acl", "--zookeeper", sasl_zk.hosts, "--zk-path", zk_path, "--zk-auth", "sasl",
               "--zk-credentials-file", file]  # fmt: skip
    assert snowflake(command) == 0
    print(capsys.readouterr().out)
    acls = tree(glass, zk_path)
    assert f"{zk_path}/marks/0/1" in acls
    assert all(acl == [ALL_SERVICE, WORLD_READ] for acl in acls.values()), acls
    assert snowflake(command) == 0
    assert f"changed 0 znodes under {zk_path}" in capsys.readouterr().out


def test_a_registration_that_expires_while_zk_acl_runs_is_skipped(
    sasl_zk: ZooKeeper, clients: Any, zk_path: str
) -> None:
    holder = clients()  # an old node without credentials: its registration is open
    registration = f"{zk_path}/nodes/0/7"
    holder.create(registration, b"10.0.0.7:7609", ephemeral=True, makepath=True)

    class ExpiresMeanwhile(KazooClient):  # type: ignore[misc]  # kazoo ships no types
        """The service's client; the holder's session ends right before its
        registration's ACL is set (after the tree was read)."""

        def set_acls_async(self, path: str, acls: list[ACL], version: int = -1) -> Any:
            if path == registration:
                holder.stop()
            return super().set_acls_async(path, acls, version)

    client = ExpiresMeanwhile(hosts=sasl_zk.hosts, **sasl("snowflake"))
    client.start(10)
    try:
        changes = lock_tree(client, zk_path, [ALL_SERVICE, WORLD_READ], 10.0)
    finally:
        client.stop()
        client.close()
    assert [path for path, _, _ in changes] == [zk_path, f"{zk_path}/nodes", f"{zk_path}/nodes/0"]
    assert all(acl == [ALL_SERVICE, WORLD_READ] for acl in tree(clients(), zk_path).values())


def test_a_credentials_file_open_to_others_is_refused(member: Make, tmp_path: Path) -> None:  # noqa: F811
    file = credentials(tmp_path, "snowflake", "secret", mode=0o640)
    os.chown(file, -1, os.getegid() + 1)  # a group not this user's own
    with pytest.raises(ConfigurationError, match=r"open to group or others \(mode 0640,"):
        member(zk_auth="sasl", zk_credentials_file=file).cluster.connect()


def test_migration_open_tree_then_locked_then_an_old_node_stops(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    clients: Any,
    zk_path: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 1. Today: nodes without credentials, an open tree.
    old = member(hosts=sasl_zk.hosts, worker_id=1).join()
    # 2. The rollout: a node restarted with credentials and --zk-open-acl joins the open
    # tree; the znodes it makes stay open, so an old node could lease its worker id later.
    new = service_node(member, sasl_zk, tmp_path, worker_id=2, zk_open_acl=True).join()
    open_zk = clients()
    opened = [ACL(Permissions.ALL, Id("world", "anyone"))]
    assert tree(open_zk, zk_path)[f"{zk_path}/marks/0/2"] == opened
    for node in (old, new):
        node.clock.now += 3000
        assert node.slot.next_id()
    # 3. Every node has credentials: lock the tree (a dry run first changes nothing).
    file = credentials(tmp_path, "snowflake", USERS["snowflake"])
    command = ["zk-acl", "--zookeeper", sasl_zk.hosts, "--zk-path", zk_path, "--zk-auth", "sasl",
               "--zk-credentials-file", file]  # fmt: skip
    assert snowflake([*command, "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert f"would change 10 znodes under {zk_path}" in dry
    assert tree(open_zk, zk_path)[zk_path] == opened
    assert snowflake(command) == 0
    done = capsys.readouterr().out
    print(done)
    assert f"set {zk_path}/marks/0/1: world:anyone=ALL -> sasl:snowflake=ALL, " in done
    assert all(acl == [ALL_SERVICE, WORLD_READ] for acl in tree(open_zk, zk_path).values())
    assert snowflake(command) == 0, "idempotent"
    assert f"changed 0 znodes under {zk_path}" in capsys.readouterr().out
    # 4. An old node without credentials cannot write its next mark: it stops serving.
    old.clock.now += 3000
    with pytest.raises(UnavailableError) as refused:
        old.slot.next_id()
    print(f"old node: {refused.value}")
    assert "ZooKeeper refused this node's write of" in str(refused.value)
    assert "ACL" in (old.slot.unavailable_reason() or ""), "/readyz says why"
    # The new one goes on, and a node with credentials and no --zk-open-acl starts.
    new.clock.now += 3000
    assert decompose(new.slot.next_id()).worker_id == 2
    locked = service_node(member, sasl_zk, tmp_path, worker_id=3).join()
    assert locked.slot.serving


def test_the_break_glass_superuser_repairs_and_deletes_a_locked_znode(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    clients: Any,
    zk_path: str,
    tmp_path: Path,
) -> None:
    node = service_node(member, sasl_zk, tmp_path, worker_id=5).join()
    node.cluster.close()
    marks = f"{zk_path}/marks/0/5"
    with pytest.raises(NoAuthError):
        clients(auth_data=[("digest", "super:wrong")]).delete(marks)
    glass = clients(auth_data=[("digest", f"super:{SUPER}")])
    glass.set(marks, str(T0 + 60_000).encode())
    glass.delete(marks)
    assert glass.exists(marks) is None


def test_rotation_to_a_new_identity_without_stopping_the_fleet(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    clients: Any,
    zk_path: str,
    tmp_path: Path,
) -> None:
    both = [ACL(Permissions.ALL, Id("sasl", "snowflake")),
            ACL(Permissions.ALL, Id("sasl", "snowflake2")), WORLD_READ]  # fmt: skip
    # 1. The old identity trusts the new one: nodes restarted so, then the tree relocked.
    old_file = credentials(tmp_path, "snowflake", USERS["snowflake"], "sasl:snowflake2")
    old = member(hosts=sasl_zk.hosts, worker_id=1, zk_auth="sasl", zk_credentials_file=old_file)
    old.join()
    command = ["zk-acl", "--zookeeper", sasl_zk.hosts, "--zk-path", zk_path, "--zk-auth", "sasl",
               "--zk-credentials-file", old_file]  # fmt: skip
    assert snowflake(command) == 0
    assert all(sorted(acl or []) == sorted(both) for acl in tree(clients(), zk_path).values())
    # 2. Nodes move to the new identity, trusting the old one, one by one: the new one
    # takes over the old one's worker id and writes its mark.
    new_file = credentials(tmp_path, "snowflake2", USERS["snowflake2"], "sasl:snowflake")
    old.cluster.close()
    new = member(hosts=sasl_zk.hosts, worker_id=1, zk_auth="sasl", zk_credentials_file=new_file)
    new.join()
    new.clock.now += 60_000
    assert decompose(new.slot.next_id()).worker_id == 1
    # 3. Every node uses the new identity: drop the old one (and from the ensemble's JAAS).
    final = credentials(tmp_path, "snowflake2", USERS["snowflake2"])
    assert snowflake([*command[:-1], final]) == 0
    only_new = [ACL(Permissions.ALL, Id("sasl", "snowflake2")), WORLD_READ]
    assert all(acl == only_new for acl in tree(clients(), zk_path).values())
    retired = credentials(tmp_path, "snowflake", USERS["snowflake"])
    stale = member(hosts=sasl_zk.hosts, worker_id=2, zk_auth="sasl", zk_credentials_file=retired)
    with pytest.raises(ConfigurationError, match="does not let this node, sasl:snowflake "):
        stale.cluster.connect()


def test_describe_acl_hides_digest_hashes() -> None:
    digest = Id("digest", make_digest_acl_credential("svc", "pw"))
    assert describe_acl([ACL(Permissions.ALL, digest), WORLD_READ]) == (
        "digest:svc=ALL, world:anyone=READ"
    )


def test_snowflake_get_finds_the_nodes_with_the_service_s_credentials(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    zk_path: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With --zk-read-acl service only the service reads the registrations: `snowflake get`
    takes its credentials as the nodes do (here the node registered listens nowhere, so the
    call fails at its address: discovery found it)."""
    node = service_node(member, sasl_zk, tmp_path, worker_id=5, zk_read_acl="service").join()
    file = credentials(tmp_path, "snowflake", USERS["snowflake"])
    find = ["get", "--zookeeper", sasl_zk.hosts, "--zk-path", zk_path, "--timeout", "1"]
    assert snowflake([*find, "--zk-auth", "sasl", "--zk-credentials-file", file]) == 1
    assert node.address in capsys.readouterr().err, "the registered node was tried"
    assert snowflake(find) == 1
    anonymous = capsys.readouterr().err
    assert node.address not in anonymous and "their ACL lets only the service read" in anonymous


@pytest.mark.filterwarnings(*KAZOO_TLS_SOCKETS)
def test_the_migration_command_reaches_an_ensemble_over_tls_with_sasl(
    tmp_path: Path, zk_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An ensemble that speaks only TLS (and SASL): `snowflake zk-acl` takes the same
    --zk-tls-* flags as the nodes, and locks the tree through it."""
    tls = ZkTls.make(tmp_path / "tls")
    zk = ZooKeeper(tmp_path / "zk", sasl_users=USERS, tls=tls)
    zk.start()
    try:
        client = zk.client()
        client.start(timeout=10)
        try:
            client.create(f"{zk_path}/nodes/0/1", b"10.0.0.1:7609", makepath=True)
            file = credentials(tmp_path, "snowflake", USERS["snowflake"])
            command = ["zk-acl", "--zookeeper", zk.hosts, "--zk-path", zk_path, "--zk-auth",
                       "sasl", "--zk-credentials-file", file, *tls.node_flags()]  # fmt: skip
            assert snowflake(command) == 0, capsys.readouterr().err
            assert "changed 4 znodes" in capsys.readouterr().out
            assert client.get_acls(f"{zk_path}/nodes/0/1")[0] == [ALL_SERVICE, WORLD_READ]
            with pytest.raises(NoAuthError):
                client.delete(f"{zk_path}/nodes/0/1")
        finally:
            client.stop()
            client.close()
    finally:
        zk.stop()


def logged_at_debug(caplog: pytest.LogCaptureFixture, step: Callable[[], object]) -> list[str]:
    """Every message logged, by any logger at DEBUG, while ``step`` makes its clients:
    kazoo's loggers first lose the filter an earlier client put there, so each maker
    must put it back itself."""
    for name in KAZOO_LOGGERS:
        logger = logging.getLogger(name)
        for each in [f for f in logger.filters if isinstance(f, HideCredentials)]:
            logger.removeFilter(each)
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        step()
    return [record.getMessage() for record in caplog.records]


def discover(hosts: str, zk_path: str, file: str) -> list[str]:
    with ZooKeeperDiscovery(hosts, zk_path, auth="digest", credentials_file=file) as found:
        return found()


def test_no_digest_password_is_logged_even_at_debug(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    zk_path: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kazoo logs each request it sends at DEBUG, the digest Auth one with its
    ``user:password``: not one of the three makers of clients (a node, discovery, the
    migration command) lets it through, whatever the level."""
    secret = "digest-secret-in-no-log"
    file = credentials(tmp_path, "svc", secret)
    acl_command = [
        "zk-acl",
        "--zookeeper",
        sasl_zk.hosts,
        "--zk-path",
        zk_path,
        "--zk-auth",
        "digest",
    ]
    steps: dict[str, Callable[[], object]] = {
        "node": lambda: member(
            hosts=sasl_zk.hosts, worker_id=1, zk_auth="digest", zk_credentials_file=file
        ).join(),
        "discovery": lambda: discover(sasl_zk.hosts, zk_path, file),
        "zk-acl": lambda: snowflake([*acl_command, "--zk-credentials-file", file]),
    }
    for maker, step in steps.items():
        messages = logged_at_debug(caplog, step)
        assert not [m for m in messages if secret in m], maker
        sent = [m for m in messages if "Auth(auth_type=0, scheme='digest', auth=<hidden>)" in m]
        assert sent, f"{maker}: the Auth request, logged without its password"


def test_no_sasl_response_is_logged_even_at_debug(
    member: Make,  # noqa: F811
    sasl_zk: ZooKeeper,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SASL DIGEST-MD5 sends no password, but its response (logged as the request at
    DEBUG) is a hash of it, open to an offline guess: it is hidden too."""
    messages = logged_at_debug(caplog, lambda: service_node(member, sasl_zk, tmp_path).join())
    assert not [m for m in messages if USERS["snowflake"] in m or "response=" in m]
    assert [m for m in messages if "SASL(challenge=<hidden>)" in m]
