"""The ``snowflake`` command: get and decode."""

from __future__ import annotations

import json

import pytest

from snowflake_server import decompose
from snowflake_server._cli import main
from tests.support.inprocess import InProcessServer


def test_decode_the_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "910499571847892992"]) == 0
    out = capsys.readouterr().out
    assert "2017-09-20T13:43:08.849Z (1505914988849 ms)" in out
    assert "datacenter  17" in out and "worker      25" in out and "sequence    0" in out


def test_decode_json_keeps_ids_as_strings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "--json", "910499571847892992", "0"]) == 0
    decoded = json.loads(capsys.readouterr().out)
    assert decoded[0] == {
        "id": "910499571847892992",
        "time": "2017-09-20T13:43:08.849Z",
        "timestamp_ms": 1505914988849,
        "datacenter_id": 17,
        "worker_id": 25,
        "sequence": 0,
    }
    assert decoded[1]["time"] == "2010-11-04T01:42:54.657Z"


def test_decode_with_another_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "--json", "--epoch", "0", "--sequence-bits", "10", "1025"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["sequence"] == 1


@pytest.mark.parametrize("bad", ["abc", "-1", str(2**63)])
def test_decode_rejects_non_ids(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", bad]) == 2
    assert "is not an id" in capsys.readouterr().err


def test_get_from_a_server(server: InProcessServer, capsys: pytest.CaptureFixture[str]) -> None:
    port = str(server.port)
    assert main(["get", "--port", port, "--count", "3", "--agent", "cli-test"]) == 0
    ids = [int(line) for line in capsys.readouterr().out.split()]
    assert len(ids) == 3 and ids == sorted(ids)
    assert main(["get", "--port", port, "--json"]) == 0
    (one,) = json.loads(capsys.readouterr().out)
    assert isinstance(one, str) and int(one) > ids[-1]
    assert decompose(int(one)).worker_id == 0


def test_get_reports_errors(server: InProcessServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["get", "--port", str(server.port), "--agent", "1bad"]) == 1
    assert "InvalidUserAgentError" in capsys.readouterr().err
    assert main(["get", "--port", str(server.port), "--count", "5000"]) == 1
    assert "1..4096" in capsys.readouterr().err


def test_get_from_nowhere(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["get", "--port", str(port), "--timeout", "2"]) == 1
    assert f"cannot reach 127.0.0.1:{port}" in capsys.readouterr().err


def test_get_fails_over_across_servers(
    server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    servers = ["--server", f"127.0.0.1:{dead}", "--server", f"127.0.0.1:{server.port}"]
    assert main(["get", *servers, "--count", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)) == 2 and err == ""
    assert main(["get", "--server", f"127.0.0.1:{dead}", "--timeout", "2"]) == 1
    assert f"cannot reach 127.0.0.1:{dead}" in capsys.readouterr().err


def test_get_explains_a_transport_mismatch(
    server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["get", "--port", str(server.port), "--transport", "buffered"]) == 1
    err = capsys.readouterr().err
    assert f"no valid reply from 127.0.0.1:{server.port}" in err
    assert "does it speak --transport buffered?" in err


@pytest.mark.parametrize(
    "args",
    [
        ["--server", "127.0.0.1:1", "--port", "2"],
        ["--server", "no:port:here"],
        ["--timeout", "0"],
    ],
)
def test_get_refuses_bad_arguments(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["get", *args])
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--port", "70000"], ["--host", ""]])
def test_get_with_a_bad_address_is_a_usage_error(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["get", *flags])
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err
