"""The fairness benchmark (bench/hostile.py): each hostile shape is the message it claims
to be, reaches a real server and gets the answer its size calls for; a client the server
closes comes back; the targets' verdicts; a whole run comparing two servers."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from thriftpy2.protocol import binary as _binary
from thriftpy2.thrift import TType

from bench import hostile
from bench.hostile import KINDS, Kind, Plan, Result, Source, Target, checks, measure
from bench.loadgen import Histogram
from bench.servers import start_ours
from snowflake_server._native import native_core
from snowflake_server._thrift.scanner import MAX_DEPTH, MAX_VALUES
from tests.support.endpoints import BytesReader

binary: Any = _binary  # thriftpy2's decoders, untyped
THRIFT_KINDS = [k for k in KINDS.values() if k.protocol == "thrift"]
_FIXED = {TType.BOOL, TType.BYTE, TType.DOUBLE, TType.I16, TType.I32, TType.I64}


def _walk(inbuf: BytesReader, ttype: int) -> int:
    """Values walked one by one inside a value of ``ttype`` (the scanner's count: fields and
    container elements; a container of fixed-size elements is skipped in one step)."""
    if ttype == TType.STRUCT:
        count = 0
        while True:
            ftype, _fid = binary.read_field_begin(inbuf)
            if ftype == TType.STOP:
                return count
            count += 1 + _walk(inbuf, ftype)
    if ttype in (TType.LIST, TType.SET):
        etype, size = binary.read_list_begin(inbuf)
        if etype in _FIXED:
            for _ in range(size):
                binary.skip(inbuf, etype)
            return 0
        return sum(1 + _walk(inbuf, etype) for _ in range(size))
    if ttype == TType.MAP:
        ktype, vtype, size = binary.read_map_begin(inbuf)
        return sum((t not in _FIXED) + _walk(inbuf, t) for _ in range(size) for t in (ktype, vtype))
    binary.skip(inbuf, ttype)
    return 0


@pytest.mark.parametrize("kind", THRIFT_KINDS, ids=lambda k: k.name)
def test_each_thrift_shape_is_one_whole_frame_of_the_values_it_claims(kind: Kind) -> None:
    frame = kind.build()
    (length,) = struct.unpack(">i", frame[:4])
    assert length == len(frame) - 4
    reader = BytesReader(frame[4:])
    assert binary.read_message_begin(reader)[0] in ("get_id", "get_ids")
    assert _walk(reader, TType.STRUCT) == kind.values
    assert reader.position == length, "thriftpy2 reads the frame to its last byte"
    assert len(frame) <= hostile.MAX_FRAME_SIZE


def test_the_issue_s_wide_list_and_the_http_heads() -> None:
    assert len(KINDS["wide_list"].build()) == 1068
    assert KINDS["wide_list"].values == 1024 and (KINDS["wide_list_small"].values or 64) < 64
    head = KINDS["http_head"].build()
    assert 7_500 <= len(head) <= 8_000 and head.endswith(b"\r\n\r\n")
    assert head.count(b"\r\n") - 1 <= 64, "under the old server's 64 header fields"


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, Target]]:
    """The working tree's server, plain and with TLS."""
    work = tmp_path_factory.mktemp("hostile")
    started = {
        tls: Source("tree", None).start(work, tls, worker_id=10 + tls) for tls in (False, True)
    }
    try:
        yield started
    finally:
        for target in started.values():
            target.server.stop()


def _expected(kind: Kind) -> set[str]:
    if kind.protocol == "tls":
        return {"handshake"}
    if kind.protocol == "http":
        return {"HTTP 200"}
    values = kind.values or 0
    if values > MAX_VALUES or (kind.name == "nested" and values > MAX_DEPTH):
        return {"refused (application exception)", "closed without a reply"}
    return {"reply"}


@pytest.mark.parametrize("kind", KINDS.values(), ids=lambda k: k.name)
def test_every_kind_gets_the_answer_its_shape_calls_for(
    kind: Kind, targets: dict[bool, Target]
) -> None:
    result = measure(targets[kind.protocol == "tls"], kind, 2, Plan(seconds=0.3, warmup_s=0.05))
    assert set(result.verdicts) <= _expected(kind) and result.verdicts, result.verdicts
    assert result.victim_calls > 0 and not result.victim_errors, result.victim_errors
    assert result.received_bytes > 0 or result.connects > 0, "the hostile clients were served"
    assert result.server_cpu_s > 0
    assert sum(result.readyz.values()) >= 1 and set(result.readyz) <= {"200", "503"}
    if _expected(kind) == {"reply"}:
        assert result.closed == 0


def test_a_hostile_client_closed_by_the_server_connects_again(tmp_path: Path) -> None:
    flags = ("--max-frame-size", "1024", "--http-port", "0", "--worker-id", "12")
    server = start_ours("small-frames", tmp_path / "logs", tmp_path / "state", *flags)
    try:
        admin, http = hostile.ready_addresses(server)
        target = Target("small", server, (server.host, server.port), admin, http, tls=False)
        result = measure(target, KINDS["long_string"], 2, Plan(seconds=0.3, warmup_s=0.05))
    finally:
        server.stop()
    assert result.closed > 2 and result.connects > 2, "refused, and back again and again"
    assert result.victim_calls > 0 and not result.victim_errors


def _result(kind: str, n: int, p99_ms: float, readyz: dict[str, int] | None = None) -> Result:
    return Result(
        label="tree", kind=kind, connections=n, seconds=1.0,
        victim=Histogram.of([p99_ms / 1e3] * 100), victim_calls=100, victim_errors=[],
        censored=False, sent_bytes=1 << 20, received_bytes=0, server_cpu_s=0.5,
        client_cpu_s=0.5, hostile_processes=1, connects=n, closed=0, verdicts={},
        readyz={"200": 4} if readyz is None else readyz,
    )  # fmt: skip


def test_the_targets_pass_and_fail() -> None:
    found = {
        c.target: (c.verdict, c.goal)
        for c in checks([
            _result("plain", 16, 3.0),
            _result("nested", 16, 8.9),  # under 3 x 3 ms
            _result("map", 16, 9.5),
            _result("plain", 128, 15.0),
            _result("map", 128, 21.0),
            _result("nested", 128, 2.0, readyz={"200": 3, "503": 1}),
        ])
    }  # fmt: skip
    assert found["nested x16 victim p99"][0] == "PASS"
    assert found["nested x16 victim p99"][1].startswith("<= 9.0")
    assert found["map x16 victim p99"][0] == "FAIL"
    assert found["plain x128 victim p99, /readyz"][0] == "PASS"
    assert found["map x128 victim p99, /readyz"][0] == "FAIL"
    assert found["nested x128 victim p99, /readyz"][0] == "FAIL", "a 503 fails it"
    # The 5 ms floor: a plain flood of 1 ms leaves 5 ms, not 3.
    [(verdict, goal)] = [
        (c.verdict, c.goal) for c in checks([_result("plain", 16, 1.0), _result("map", 16, 4.5)])
    ]
    assert verdict == "PASS" and goal.startswith("<= 5.00")


def test_compare_runs_both_servers_interleaved(tmp_path: Path) -> None:
    """The revision's server, then the working tree's on each path, per kind."""
    out = tmp_path / "hostile.md"
    args = ["--compare", "HEAD", "--kinds", "plain,wide_list", "--connections", "2",
            "--seconds", "0.2", "--warmup", "0", "--out", str(out)]  # fmt: skip
    assert hostile.main(args) == 0
    rows = [line.split(" | ")[:3] for line in out.read_text().splitlines() if line.startswith("| ")]
    labels = [row[2] for row in rows[1:]]
    old = labels[0]
    assert old.startswith("HEAD@") and labels == [old, "tree-native", "tree-pure"] * 2
    assert [row[0] for row in rows[1:]] == ["| plain"] * 3 + ["| wide_list"] * 3
    runs = json.loads(out.with_suffix(".json").read_text())
    assert len(runs) == 6 and all(run["victim_calls"] > 0 for run in runs)
    [line] = [line for line in out.read_text().splitlines() if "answered natively" in line]
    assert "tree-pure: 0.0% of " in line and "(0 native threads)" in line
    if native_core() is not None:  # the victim's calls at least, after its first
        native = line.split("tree-native: ")[1].split("%")[0]
        assert float(native) > 0, line


def test_the_tree_runs_on_both_paths_tls_on_the_first_only() -> None:
    sources = hostile.sources_of(hostile.parse_args([]))
    assert [(s.label, s.args, s.tls) for s in sources] == [
        ("tree-native", (), True),
        ("tree-pure", ("--native-threads", "0"), False),
    ]
    [pure] = hostile.sources_of(hostile.parse_args(["--paths", "pure"]))
    assert pure.label == "tree-pure" and pure.tls, "alone, it runs the tls kinds itself"
    [rev] = hostile.sources_of(hostile.parse_args(["--rev", "HEAD"]))
    assert rev.args == () and rev.label.startswith("HEAD@"), "an old revision: as it is"
    with pytest.raises(SystemExit):
        hostile.parse_args(["--paths", "turbo"])


def test_a_tls_kind_runs_once_however_many_paths(tmp_path: Path) -> None:
    out = tmp_path / "hostile.md"
    args = ["--kinds", "tls_handshake", "--connections", "2", "--seconds", "0.2",
            "--warmup", "0", "--out", str(out)]  # fmt: skip
    assert hostile.main(args) == 0
    runs = json.loads(out.with_suffix(".json").read_text())
    assert [run["label"] for run in runs] == ["tree-native"]
    assert "tls kinds: on the first only" in out.read_text()
