"""The ``snowflake`` command: get and decode, and the ZooKeeper flags of get and zk-acl."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import trustme

from snowflake_server import Layout, decompose
from snowflake_server._cli import main
from snowflake_server._cluster.zk import check_tls_files
from snowflake_server._config.options import load_settings
from snowflake_server._errors import ConfigurationError
from tests.support.endpoints import free_port
from tests.support.examples import SEED_003_JSON
from tests.support.inprocess import InProcessServer


def test_decode_the_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "910499571847892992"]) == 0
    out = capsys.readouterr().out
    assert "2017-09-20T13:43:08.849Z (1505914988849 ms)" in out
    assert "datacenter  17" in out and "worker      25" in out and "sequence    0" in out


def test_decode_json_keeps_ids_as_strings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "--json", "910499571847892992", "0"]) == 0
    decoded = json.loads(capsys.readouterr().out)
    assert decoded[0] == SEED_003_JSON
    assert decoded[1]["time"] == "2010-11-04T01:42:54.657Z"


def test_decode_with_another_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "--json", "--epoch", "0", "--sequence-bits", "10", "1025"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["sequence"] == 1


def test_decode_shows_the_clock_sequence_of_a_layout_with_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    layout = Layout(datacenter_id_bits=3, clock_sequence_bits=2)
    id_ = layout.compose(1505914988849, 5, 25, 7, clock_sequence=3)
    flags = ["--datacenter-id-bits=3", "--clock-sequence-bits=2"]
    assert main(["decode", *flags, str(id_)]) == 0
    out = capsys.readouterr().out
    assert "clock seq   3" in out and "datacenter  5" in out and "sequence    7" in out
    assert main(["decode", str(id_)]) == 0  # the default layout reads other fields
    assert "clock seq" not in capsys.readouterr().out
    assert main(["decode", "--clock-sequence-bits=2", str(id_)]) == 2
    assert "layout needs 65 bits" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["abc", "-1", str(2**63)])
def test_decode_rejects_non_ids(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", bad]) == 2
    assert "is not an id" in capsys.readouterr().err


def test_decode_goes_on_past_a_bad_id_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "--json", "abc", "910499571847892992", "-1"]) == 2
    out, err = capsys.readouterr()
    assert [d["id"] for d in json.loads(out)] == ["910499571847892992"]
    assert "'abc' is not an id: not a plain decimal integer" in err
    assert "'-1' is not an id: negative (ids are 0 .. 2^63-1" in err


def stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """Standard input with ``data`` in it, as bytes under text, as a real one is."""
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


@pytest.mark.parametrize("argv", [[], ["-"]], ids=["no ID", "-"])
def test_decode_reads_ids_from_standard_input(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stdin(monkeypatch, b"910499571847892992\n\n  0\t1\r\n4194304")
    assert main(["decode", "--json", *argv]) == 0
    out, err = capsys.readouterr()
    decoded = json.loads(out)
    assert [d["id"] for d in decoded] == ["910499571847892992", "0", "1", "4194304"]
    assert decoded[0]["time"] == "2017-09-20T13:43:08.849Z" and decoded[3]["sequence"] == 0
    assert err == ""


def test_decode_reads_standard_input_where_the_dash_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stdin(monkeypatch, b"1 2\n")
    assert main(["decode", "--json", "0", "-", "3"]) == 0
    assert [d["sequence"] for d in json.loads(capsys.readouterr().out)] == [0, 1, 2, 3]


def test_decode_names_the_line_of_each_bad_id_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stdin(monkeypatch, f"0\n1 x1\n{2**63}\n\xff2\n910499571847892992\n".encode("latin-1"))
    assert main(["decode"]) == 2
    out, err = capsys.readouterr()
    assert out.count("\n  time ") == 3 and "910499571847892992\n  time" in out
    errors = err.splitlines()
    assert len(errors) == 3
    assert errors[0] == (
        "snowflake decode: error: line 2 of standard input: 'x1' is not an id: not a plain "
        "decimal integer (ASCII digits 0-9 only: no sign, space or _)"
    )
    assert errors[1].startswith(
        f"snowflake decode: error: line 3 of standard input: '{2**63}' is not an id: too large"
    )
    # Not UTF-8: refused with its line, and the lines after it are still read.
    assert errors[2].startswith("snowflake decode: error: line 4 of standard input: '\ufffd2'")


def test_decode_of_empty_standard_input_decodes_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stdin(monkeypatch, b" \n")
    assert main(["decode", "--json"]) == 0
    assert capsys.readouterr() == ("[]\n", "")
    stdin(monkeypatch, b"")
    assert main(["decode"]) == 0
    assert capsys.readouterr() == ("", "")


def test_decode_reads_a_text_only_standard_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("910499571847892992 nope\n"))
    assert main(["decode", "--json"]) == 2
    out, err = capsys.readouterr()
    assert [d["worker_id"] for d in json.loads(out)] == [25]
    assert "line 1 of standard input: 'nope' is not an id" in err


def test_decode_without_standard_input_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", None)
    assert main(["decode"]) == 2
    assert "no standard input to read ids from" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_decode_says_it_reads_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", Terminal("0\n"))
    assert main(["decode"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("0\n") and "(end with Ctrl-D)" in err


def test_decode_refuses_a_time_past_year_9999(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "--epoch", "300000000000000", "0"]) == 2
    assert "'0' has a time that cannot be shown" in capsys.readouterr().err


def test_decode_refuses_two_dashes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stdin(monkeypatch, b"1\n")
    with pytest.raises(SystemExit) as info:
        main(["decode", "-", "-"])
    assert info.value.code == 2
    assert "give - once" in capsys.readouterr().err


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


def _zk_tls_cases(directory: Path) -> list[list[str]]:
    """Half-given or unloadable ``--zk-tls-*`` flags: with each, the server refuses to start."""
    pem = directory / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(pem))
    missing = str(directory / "missing.pem")
    return [
        ["--zk-tls-cert", str(pem), "--zk-tls-key", str(pem)],  # no CA: in the clear
        ["--zk-tls-ca", str(pem), "--zk-tls-cert", str(pem)],  # no key: dropped
        ["--zk-tls-ca", missing],
    ]


def _server_refusal(flags: list[str]) -> str:
    """The server's words for ``flags`` (its start-up check of the TLS files included)."""
    try:
        access = load_settings(["--zookeeper", "127.0.0.1:2181", *flags]).zk_access
        check_tls_files(access)
    except ConfigurationError as e:
        return str(e)
    raise AssertionError(f"the server accepts {flags}")


@pytest.mark.parametrize("command", ["zk-acl", "get"])
def test_zookeeper_tls_flags_are_checked_as_the_server_checks_them(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a connection in the clear (with a digest password in it), a certificate
    silently dropped, or a time-out: exit 2 with the server's words, before any
    connection (nothing listens at the address)."""
    credentials = tmp_path / "svc.cred"
    credentials.write_text("user = svc\npassword = secret\n")
    credentials.chmod(0o600)
    base = [command, "--zookeeper", f"127.0.0.1:{free_port()}", "--timeout", "1"]
    if command == "zk-acl":
        base += ["--zk-auth", "digest", "--zk-credentials-file", str(credentials)]
    for flags in _zk_tls_cases(tmp_path):
        assert main([*base, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err == f"snowflake {command}: error: {_server_refusal(flags)}\n"
