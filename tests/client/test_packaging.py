"""The IDL is one file, shipped inside the client package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from snowflake_thrift_client._idl import idl_text, snowflake_thrift

ROOT = Path(__file__).parents[2]


def test_the_installed_idl_is_the_top_level_idl() -> None:
    assert idl_text() == (ROOT / "idl" / "snowflake.thrift").read_text(encoding="utf-8")
    shipped = ROOT / "clients" / "python" / "snowflake_thrift_client" / "idl"
    assert shipped.resolve() == (ROOT / "idl").resolve()


def test_the_wheel_ships_the_idl(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(ROOT / "clients" / "python")],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("snowflake_thrift_client-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("snowflake_thrift_client/idl/snowflake.thrift").decode()
        assert "snowflake_thrift_client/py.typed" in archive.namelist()
    assert shipped == idl_text()


def test_the_idl_keeps_the_original_contract() -> None:
    service = snowflake_thrift().Snowflake
    assert service.thrift_services[:4] == [
        "get_worker_id",
        "get_timestamp",
        "get_id",
        "get_datacenter_id",
    ]
    assert service.get_id_args.thrift_spec == {1: (11, "useragent", False)}
    assert service.get_id_result.thrift_spec[0] == (10, "success", False)
    entry = snowflake_thrift().AuditLogEntry.thrift_spec
    assert entry == {1: (10, "id", False), 2: (11, "useragent", False), 3: (10, "tag", False)}


def test_the_public_surface_is_importable() -> None:
    import snowflake_server

    missing = [name for name in snowflake_server.__all__ if not hasattr(snowflake_server, name)]
    assert missing == []
    for name in snowflake_server.__all__:
        if name.endswith("Error"):
            assert issubclass(getattr(snowflake_server, name), snowflake_server.SnowflakeError)
