"""The ZooKeeper credentials file that nodes, `snowflake` and ZooKeeperDiscovery read:
every bad file is a clear ConfigurationError that never shows a password."""

from __future__ import annotations

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
        "also = digest:ops:abc=\n",
    )
    found = load_credentials(path)
    assert found == ZooKeeperCredentials(
        "snowflake", SECRET, ("sasl:snowflake2", "digest:ops:abc=")
    )
    assert SECRET not in repr(found)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (f"user = a\npassword {SECRET}\n", "line 2: expected user = ..., password = ..."),
        (f"user = a\npassword = {SECRET}\ncolour = red\n", "line 3: expected user"),
        (f"user = a\npassword = {SECRET}\nalso = ldap:x\n", "also must be sasl:USER or digest"),
        (f"user = a\npassword = {SECRET}\nalso = sasl:a:b\n", "also must be"),
        (f"user = a\npassword = {SECRET}\nalso = digest:ops\n", "also must be"),
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


def test_a_missing_file_or_one_open_to_others_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="No such file"):
        load_credentials(str(tmp_path / "nowhere"))
    for mode in (0o640, 0o604, 0o660):
        with pytest.raises(ConfigurationError, match=f"mode {mode:04o}"):
            load_credentials(written(tmp_path, f"user = a\npassword = {SECRET}\n", mode))


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
