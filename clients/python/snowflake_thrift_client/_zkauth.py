"""ZooKeeper credentials, read from a file: the service's and its clients' one format.

The file holds ``key = value`` lines (``#`` starts a comment line)::

    # the snowflake service's identity in ZooKeeper (chmod 600)
    user = snowflake
    password = a long random secret
    # during a credential rotation only: another identity that shares the service's znodes
    also = sasl:snowflake-2
    # the discovery clients' identity: it may read the service's znodes, nothing else
    reader = sasl:snowflake-reader

``password`` is everything after the first ``=``, spaces around it dropped. ``also``
(repeatable) names an ACL id, ``sasl:USER`` or ``digest:USER:BASE64-SHA1`` (see
docs/operations.md), that the service trusts as itself; ``reader`` (repeatable) one
the service lets read its znodes only (with ``--zk-read-acl service``, the identity to
give discovery clients). The file must not be readable by others, nor by a group
other than this user's own in a file of root or this user (the shape of a Kubernetes
Secret mounted under ``fsGroup``: root, the pod's group, mode 0440): credentials
never come from the command line or the environment, where ``ps`` and ``/proc`` show
them.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any

from ._errors import ConfigurationError

__all__ = [
    "AUTH_SCHEMES",
    "ZooKeeperCredentials",
    "kazoo_auth",
    "load_credentials",
    "private_file",
]

AUTH_SCHEMES = ("none", "sasl", "digest")
"""``none``: anonymous; ``sasl``: SASL DIGEST-MD5 (the server's JAAS users);
``digest``: ZooKeeper's digest scheme (``addauth digest user:password``)."""


@dataclass(frozen=True)
class ZooKeeperCredentials:
    """A ZooKeeper identity: ``user`` and ``password``, and the ``also`` ACL ids trusted
    as the same service. Its ``repr`` hides the password."""

    user: str
    password: str
    also: tuple[str, ...] = ()
    readers: tuple[str, ...] = ()
    """ACL ids (``sasl:USER``, ``digest:USER:HASH``) allowed to read the service's znodes."""

    def __repr__(self) -> str:
        return (
            f"ZooKeeperCredentials(user={self.user!r}, password=<hidden>, also={self.also!r}, "
            f"readers={self.readers!r})"
        )


def load_credentials(path: str) -> ZooKeeperCredentials:
    """The credentials in ``path``; ``ConfigurationError`` (never showing the password)
    if it cannot be read, is readable or writable by group or others, or is malformed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ConfigurationError(f"ZooKeeper credentials file {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(file.fileno())
        if not private_file(st):
            raise ConfigurationError(
                f"ZooKeeper credentials file {path} is open to group or others "
                f"(mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, group gid "
                f"{st.st_gid}): anyone who reads it can break the uniqueness of ids; chmod "
                f"600 {path} (group-readable is accepted only in a file of root or this user "
                f"whose group is this user's own, gid {os.getegid()}: a Kubernetes Secret "
                "mounted under fsGroup)"
            )
        raw = file.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigurationError(f"ZooKeeper credentials file {path} is not UTF-8") from None
    values: dict[str, str] = {}
    ids: dict[str, list[str]] = {"also": [], "reader": []}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, sep, value = stripped.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in ("user", "password", "also", "reader"):
            # The line is not shown: it may be a password.
            raise ConfigurationError(
                f"ZooKeeper credentials file {path}, line {number}: expected user = ..., "
                "password = ..., also = or reader = sasl:USER / digest:USER:HASH"
            )
        if key in ids:
            if not _acl_id(value):
                raise ConfigurationError(
                    f"ZooKeeper credentials file {path}, line {number}: {key} must be "
                    f"sasl:USER or digest:USER:BASE64-SHA1, got {value!r}"
                )
            ids[key].append(value)
        elif key in values:
            raise ConfigurationError(f"ZooKeeper credentials file {path}: {key} given twice")
        else:
            values[key] = value
    for key in ("user", "password"):
        if not values.get(key):
            raise ConfigurationError(f"ZooKeeper credentials file {path}: no {key} = ...")
    if ":" in values["user"]:
        raise ConfigurationError(f"ZooKeeper credentials file {path}: user may not hold ':'")
    return ZooKeeperCredentials(
        values["user"], values["password"], tuple(ids["also"]), tuple(ids["reader"])
    )


def private_file(st: os.stat_result) -> bool:
    """Whether the file ``st`` describes is readable by this user (and root) only: no
    bit for others; group read only if root or this user owns it and its group is this
    user's own (``getegid``), as kubelet mounts a Secret under ``fsGroup`` (root, the
    pod's group, ``defaultMode`` 0440). Never group write: a member could swap the
    identity."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IRWXO:
        return False
    group = mode & stat.S_IRWXG
    if not group:
        return True
    return group == stat.S_IRGRP and st.st_uid in (0, os.geteuid()) and st.st_gid == os.getegid()


def _acl_id(text: str) -> bool:
    scheme, _, rest = text.partition(":")
    if scheme == "sasl":
        return bool(rest) and ":" not in rest
    if scheme == "digest":
        user, _, digest = rest.partition(":")
        return bool(user) and bool(digest)
    return False


def kazoo_auth(auth: str, credentials: ZooKeeperCredentials | None) -> dict[str, Any]:
    """``KazooClient`` keyword arguments that authenticate as ``credentials`` by ``auth``."""
    if auth not in AUTH_SCHEMES:
        raise ConfigurationError(f"ZooKeeper auth must be one of {', '.join(AUTH_SCHEMES)}")
    if auth == "none":
        return {}
    if credentials is None:
        raise ConfigurationError(f"ZooKeeper auth {auth} needs a credentials file")
    if auth == "sasl":
        return {
            "sasl_options": {
                "mechanism": "DIGEST-MD5",
                "username": credentials.user,
                "password": credentials.password,
            }
        }
    return {"auth_data": [("digest", f"{credentials.user}:{credentials.password}")]}
