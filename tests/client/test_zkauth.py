"""The ZooKeeper credentials file that nodes, `snowflake` and ZooKeeperDiscovery read:
every bad file is a clear ConfigurationError that never shows a password."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from snowflake_thrift_client import ConfigurationError
from snowflake_thrift_client._zkauth import ZooKeeperCredentials, kazoo_auth, load_credentials

SECRET = "s3cret-do-not-show"


def written(tmp_path: Path, text: str | bytes, mode: int = 0o600) -> str:
    path = tmp_path / "zk.cred"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    path.chmod(mode)
    return str(path)


def test_a_good_file_gives_the_identity_and_hides_the_password(tmp_path: Path) -> None:
    path = written(
        tmp_path,
        f"# the service\nuser = snowflake\n\npassword = {SECRET}\nalso = sasl:snowflake2\n"
        "also = digest:ops:abc=\nreader = sasl:clients\nreader = digest:ro:xyz=\n",
    )
    found = load_credentials(path)
    assert found == ZooKeeperCredentials(
        "snowflake", SECRET, ("sasl:snowflake2", "digest:ops:abc="),
        ("sasl:clients", "digest:ro:xyz="),
    )  # fmt: skip
    assert SECRET not in repr(found)
    assert "readers=('sasl:clients', 'digest:ro:xyz=')" in repr(found)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (f"user = a\npassword {SECRET}\n", "line 2: expected user = ..., password = ..."),
        (f"user = a\npassword = {SECRET}\ncolour = red\n", "line 3: expected user"),
        (f"user = a\npassword = {SECRET}\nalso = ldap:x\n", "also must be sasl:USER or digest"),
        (f"user = a\npassword = {SECRET}\nalso = sasl:a:b\n", "also must be"),
        (f"user = a\npassword = {SECRET}\nalso = digest:ops\n", "also must be"),
        (f"user = a\npassword = {SECRET}\nreader = world:anyone\n", "reader must be sasl:USER"),
        (f"user = a\npassword = {SECRET}\nreader = sasl:\n", "reader must be"),
        (f"user = a\nuser = b\npassword = {SECRET}\n", "user given twice"),
        (f"password = {SECRET}\n", "no user = ..."),
        ("user = a\npassword =\n", "no password = ..."),
        (f"user = a:b\npassword = {SECRET}\n", "user may not hold ':'"),
        (b"user = a\npassword = \xff\n", "is not UTF-8"),
    ],
)
def test_a_malformed_file_is_refused_without_showing_the_password(
    tmp_path: Path, text: str | bytes, words: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_credentials(written(tmp_path, text))
    assert words in str(refused.value)
    assert SECRET not in str(refused.value)


OURS = os.geteuid()
OUR_GROUP = os.getegid()
ANOTHER = 54321  # a user and a group that are not this test's


@pytest.mark.parametrize(
    ("mode", "owner", "group"),
    [
        (0o604, OURS, OUR_GROUP),  # others: never
        (0o640, OURS, ANOTHER),  # a group not our own
        (0o440, 0, ANOTHER),  # a Secret of another group
        (0o660, OURS, OUR_GROUP),  # group write: a member could swap the identity
        (0o640, ANOTHER, OUR_GROUP),  # another user's file
    ],
)
def test_a_missing_file_or_one_open_to_others_is_refused(
    tmp_path: Path, mode: int, owner: int, group: int
) -> None:
    with pytest.raises(ConfigurationError, match="No such file"):
        load_credentials(str(tmp_path / "nowhere"))
    path = written(tmp_path, f"user = a\npassword = {SECRET}\n", mode)
    os.chown(path, owner, group)
    with pytest.raises(ConfigurationError, match=f"mode {mode:04o}, owner uid {owner}, group"):
        load_credentials(path)


@pytest.mark.parametrize(("mode", "owner"), [(0o440, 0), (0o640, OURS), (0o400, OURS)])
def test_a_secret_mounted_under_fs_group_is_accepted(tmp_path: Path, mode: int, owner: int) -> None:
    """kubelet mounts a Secret as root's, in the pod's fsGroup (the server's own group
    with runAsGroup = fsGroup), mode defaultMode (0440): the state directory's rule."""
    path = written(tmp_path, f"user = a\npassword = {SECRET}\n", mode)
    os.chown(path, owner, OUR_GROUP)
    assert load_credentials(path).user == "a"


def test_kazoo_is_given_sasl_or_digest_and_nothing_for_none() -> None:
    creds = ZooKeeperCredentials("svc", SECRET)
    assert kazoo_auth("none", None) == {}
    sasl = kazoo_auth("sasl", creds)["sasl_options"]
    assert sasl == {"mechanism": "DIGEST-MD5", "username": "svc", "password": SECRET}
    assert kazoo_auth("digest", creds) == {"auth_data": [("digest", f"svc:{SECRET}")]}
    with pytest.raises(ConfigurationError, match="must be one of"):
        kazoo_auth("kerberos", creds)
    with pytest.raises(ConfigurationError, match="needs a credentials file"):
        kazoo_auth("sasl", None)
