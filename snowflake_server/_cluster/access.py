"""Who may write the service's znodes: checked once a node is connected, before it
registers.

With ``--zk-auth none`` anyone who reaches ZooKeeper can delete a registration or
lower a mark and so make two nodes hand out the same ids: said once, as a warning.
With ``sasl`` or ``digest`` a node refuses to start (``ConfigurationError``, exit 2)
when ZooKeeper refuses its credentials (SASL says so at once; digest never does,
so the node compares its identity with the ACLs it finds), or when an existing znode
of the service lets anyone else write or delete it. The tree's ACLs are read level by
level, all reads of a level at once, within ``--zk-connect-timeout``: a cluster may
hold thousands of marks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from kazoo.exceptions import AuthFailedError, NoAuthError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.security import ACL, Id, Permissions
from snowflake_thrift_client._zkauth import load_credentials

from .._config.settings import ZooKeeperAccess
from .._errors import ConfigurationError
from .zk import ZooKeeperSilent, service_ids, zk_call

__all__ = [
    "WRITE_RIGHTS",
    "TreeAcls",
    "check_access",
    "check_credentials",
    "check_parents",
    "credentials_refused",
    "describe_acl",
    "lock_tree",
    "read_tree_acls",
]

log = logging.getLogger(__name__)

WRITE_RIGHTS = Permissions.WRITE | Permissions.CREATE | Permissions.DELETE | Permissions.ADMIN
"""Rights that let their holder break uniqueness: change or delete a znode, create one
under it (a registration), or change its ACL."""
_ANYONE = Id("world", "anyone")
_SHOWN = 10  # znodes named in a refusal; the rest are counted
# Passes of lock_tree: each reaches one level further under znodes it could not list
# before; the service's tree is 4 levels deep (marks/<dc>/<worker>).
_PASSES = 8


@dataclass
class TreeAcls:
    """The ACL of each znode under a root (``None``: this node may not even read it), and
    the znodes whose children it may not list (what is under them went unread)."""

    acls: dict[str, list[ACL] | None]
    unlisted: list[str]


def describe_acl(acl: Iterable[ACL]) -> str:
    """``sasl:snowflake=ALL, world:anyone=READ``: an ACL in words. A digest id shows
    its user only (its hash is a password's)."""
    return ", ".join(f"{_show_id(entry.id)}={'|'.join(entry.acl_list) or 'none'}" for entry in acl)


def _show_id(ident: Id) -> str:
    if ident.scheme == "digest":
        return f"digest:{ident.id.split(':', 1)[0]}"
    return f"{ident.scheme}:{ident.id}"


def read_tree_acls(client: Any, root: str, timeout_s: float) -> TreeAcls:
    """The ACLs of ``root`` and every znode under it, read within ``timeout_s``
    (``ZooKeeperSilent`` otherwise): each level's listings and ACL reads are sent
    at once, then awaited."""
    what = f"reading the ACLs of the znodes under {root}"
    deadline = time.monotonic() + timeout_s
    found: dict[str, list[ACL] | None] = {}
    unlisted: list[str] = []

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    level = [root]
    while level:
        pending = [
            (path, client.get_acls_async(path), client.get_children_async(path)) for path in level
        ]
        level = []
        for path, acl_read, listing in pending:
            try:
                acl, _ = acl_read.get(timeout=left())
                found[path] = list(acl)
            except NoNodeError:
                continue  # gone meanwhile (an ephemeral registration)
            except NoAuthError:
                found[path] = None
            except KazooTimeoutError:
                raise ZooKeeperSilent(what, timeout_s) from None
            try:
                names = listing.get(timeout=left())
            except NoNodeError:
                continue
            except NoAuthError:
                unlisted.append(path)
                continue
            except KazooTimeoutError:
                raise ZooKeeperSilent(what, timeout_s) from None
            prefix = "" if path == "/" else path
            level += [f"{prefix}/{name}" for name in sorted(names)]
    return TreeAcls(found, unlisted)


def _grants(entry: ACL, ids: tuple[Id, ...]) -> bool:
    return entry.id in ids or entry.id == _ANYONE


def check_access(client: Any, access: ZooKeeperAccess, zk_path: str, timeout_s: float) -> None:
    """Refuse (``ConfigurationError``) to serve through a ZooKeeper that refuses this
    node's credentials or whose znodes under ``zk_path`` let others write; with
    ``access.open_acl`` (a migration) open znodes are only counted in a warning.
    Without auth, warn that anyone who reaches ZooKeeper can break uniqueness."""
    if not access.authenticated:
        log.warning(
            "ZooKeeper without authentication (--zk-auth none): anyone who can reach the "
            "ensemble can delete a registration or lower a mark, and so make two nodes "
            "hand out the same ids; see Securing ZooKeeper in docs/operations.md"
        )
        return
    check_credentials(client, access, zk_path, timeout_s)
    _check_tree(client, access, zk_path, timeout_s)


def check_parents(
    client: Any, access: ZooKeeperAccess, zk_path: str, parents: Iterable[str], timeout_s: float
) -> None:
    """Make ``parents`` (where a node's first writes go: ``nodes/<dc>``, ``marks/<dc>``
    under ``zk_path``) and read the ACLs of the whole tree again: ``ConfigurationError``
    as from :func:`check_access` if others could write any of it. Call it after
    :func:`check_access`, before the first registration.

    Why again: :func:`check_access` passes on a tree that does not exist yet, and
    whoever creates ``zk_path`` first owns it: someone who did so in between, with an
    open ACL, would keep it open (``ensure_path`` leaves an existing znode alone), or
    plant open znodes under it and then hand it our ACL. Once the parents exist and the
    whole tree is the service's alone, nobody else can create or change anything in it.
    Nothing to do without auth, or with ``--zk-open-acl``: open is what they ask for."""
    if not access.authenticated or access.open_acl:
        return
    for parent in parents:
        # Refused: someone else's znode on the way, which the check names.
        with suppress(NoAuthError):
            zk_call(client, timeout_s, f"creating {parent}", "ensure_path", parent)
    _check_tree(client, access, zk_path, timeout_s)


def _check_tree(client: Any, access: ZooKeeperAccess, zk_path: str, timeout_s: float) -> None:
    ids = service_ids(access, load_credentials(access.credentials_file))
    who = _who(access, ids[0])
    tree = read_tree_acls(client, zk_path, timeout_s)
    not_ours: list[str] = []
    open_to_others: list[str] = []
    for path, acl in tree.acls.items():
        if acl is None or not any(
            e.perms & WRITE_RIGHTS == WRITE_RIGHTS and _grants(e, ids) for e in acl
        ):
            shown = "not readable by it" if acl is None else describe_acl(acl)
            not_ours.append(f"{path} ({shown})")
            continue
        if any(e.perms & WRITE_RIGHTS and e.id not in ids for e in acl):
            open_to_others.append(f"{path} ({describe_acl(acl)})")
        if path in tree.unlisted:
            # What is under it went unchecked: it could be anyone's.
            not_ours.append(f"{path} ({describe_acl(acl)}: its children not listable by it)")
    if not_ours:
        # Digest credentials are never refused at connect: a wrong password just makes
        # another identity, and this is where it shows.
        raise ConfigurationError(
            f"ZooKeeper does not let this node, {who}, write or list the service's znodes: "
            f"{_some(not_ours)}; a wrong user or password in the credentials file, or "
            "znodes another service owns (is --zk-path right?)"
        )
    if not open_to_others:
        return
    if access.open_acl:
        log.warning(
            "%d znodes under %s let anyone write them (--zk-open-acl, a migration): once "
            "every node has credentials, lock them with snowflake zk-acl and restart the "
            "nodes without --zk-open-acl", len(open_to_others), zk_path,
        )  # fmt: skip
        return
    raise ConfigurationError(
        f"znodes of the service under {zk_path} let others than {_show_id(ids[0])} write or "
        f"delete them, so anyone could make two nodes hand out the same ids: "
        f"{_some(open_to_others)}; give them the service's ACL with snowflake zk-acl "
        "(see Securing ZooKeeper in docs/operations.md), or during a migration start with "
        "--zk-open-acl"
    )


def check_credentials(client: Any, access: ZooKeeperAccess, zk_path: str, timeout_s: float) -> None:
    """``ConfigurationError`` if ZooKeeper refused the SASL credentials of this started
    client: it does so right after the session opens, and the first call says so."""
    try:
        zk_call(client, timeout_s, "checking the ZooKeeper credentials", "exists", zk_path)
    except AuthFailedError:
        raise credentials_refused(access) from None


def lock_tree(
    client: Any, root: str, acl: list[ACL], timeout_s: float, *, dry_run: bool = False
) -> list[tuple[str, str, str]]:
    """Give ``root`` and every znode under it ``acl`` (``snowflake zk-acl``): the
    changes as (path, old ACL, new ACL) in words, each made unless ``dry_run``.
    Idempotent: a znode that has it already is left alone; one gone meanwhile (a
    registration that expired) is skipped. Raises what ZooKeeper raises
    (``NoAuthError``: this identity may not change that znode's ACL).

    The tree is read again after each pass that changed something, until one changes
    nothing (at most ``_PASSES``): a znode this identity could not list until its ACL
    was set has children the pass before could not see. A dry run makes one pass."""
    wanted = sorted(acl)
    changes: list[tuple[str, str, str]] = []
    for _ in range(1 if dry_run else _PASSES):
        tree = read_tree_acls(client, root, timeout_s)
        changed = False
        for path, found in tree.acls.items():
            if found is not None and sorted(found) == wanted:
                continue
            old = "not readable" if found is None else describe_acl(found)
            if not dry_run:
                try:
                    zk_call(client, timeout_s, f"setting the ACL of {path}", "set_acls", path, acl)
                except NoNodeError:
                    continue  # gone meanwhile (an ephemeral registration): nothing to lock
                changed = True
            changes.append((path, old, describe_acl(acl)))
        if not changed:
            break
    return changes


def _who(access: ZooKeeperAccess, own: Id) -> str:
    return (
        f"{_show_id(own)} (--zk-auth {access.auth}, --zk-credentials-file "
        f"{access.credentials_file})"
    )


def credentials_refused(access: ZooKeeperAccess) -> ConfigurationError:
    """The error of a node whose SASL credentials ZooKeeper refused."""
    own = service_ids(access, load_credentials(access.credentials_file))[0]
    return ConfigurationError(
        f"ZooKeeper refused the credentials of {_who(access, own)}: a wrong user or "
        "password, or a user the ensemble's JAAS file does not hold"
    )


def _some(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more
