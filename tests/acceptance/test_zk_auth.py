"""A real server process against a SASL ZooKeeper: it serves with its credentials and
exits 2, naming the cause, when they are refused or the tree is open to others."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from snowflake_server._app.exits import ExitCode
from tests.support.processes import spawned, start_server
from tests.support.zookeeper import ZooKeeper

pytestmark = [pytest.mark.zookeeper, pytest.mark.slow]


@pytest.fixture(scope="module")
def sasl_zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeper]:
    zk = ZooKeeper(tmp_path_factory.mktemp("sasl-zk"), sasl_users={"snowflake": "s3cret"})
    zk.start()
    yield zk
    zk.stop()


def credentials(tmp_path: Path, password: str) -> str:
    path = tmp_path / f"zk-{len(list(tmp_path.glob('*.cred')))}.cred"
    path.write_text(f"user = snowflake\npassword = {password}\n")
    path.chmod(0o600)
    return str(path)


def test_a_node_with_credentials_serves_and_wrong_ones_exit_2(
    sasl_zk: ZooKeeper, zk_path: str, tmp_path: Path
) -> None:
    good = ("--zk-auth", "sasl", "--zk-credentials-file", credentials(tmp_path, "s3cret"))
    server = start_server(*sasl_zk.node_flags(zk_path), "--worker-id", "1", *good)
    try:
        assert server.client().next_id() > 0
    finally:
        assert server.stop() == 0
    wrong = ("--zk-auth", "sasl", "--zk-credentials-file", credentials(tmp_path, "not-s3cret"))
    with spawned(*sasl_zk.node_flags(zk_path), "--worker-id", "2", *wrong) as refused:
        code, _ = refused.end(30)
    print(refused.log().strip().splitlines()[-1])
    assert code == ExitCode.CONFIGURATION
    assert "ZooKeeper refused the credentials of sasl:snowflake" in refused.log()
    assert "s3cret" not in refused.log(), "no password in the log"


def test_a_node_with_auth_exits_2_on_a_tree_open_to_others(
    sasl_zk: ZooKeeper, zk_path: str, tmp_path: Path
) -> None:
    server = start_server(*sasl_zk.node_flags(zk_path), "--worker-id", "1")  # no auth: open
    try:
        good = ("--zk-auth", "sasl", "--zk-credentials-file", credentials(tmp_path, "s3cret"))
        with spawned(*sasl_zk.node_flags(zk_path), "--worker-id", "2", *good) as refused:
            code, _ = refused.end(30)
        print(refused.log().strip().splitlines()[-1])
        assert code == 2
        assert f"{zk_path}/nodes/0/1 (world:anyone=ALL)" in refused.log()
        assert "anyone who can reach the ensemble" in server.log()
    finally:
        server.stop()
