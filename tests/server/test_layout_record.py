"""The cluster's layout record against a real ZooKeeper: what each stage does with a
record that is ours, another layout's, missing or not a layout, and why ids are held.
The settle time runs on a fake clock."""

from __future__ import annotations

import json
import re

import pytest
from kazoo.client import KazooClient

from snowflake_server import Layout, StartupRefused
from snowflake_server._cluster.layout_record import LayoutRecord, Stage
from snowflake_server._errors import StartupDeferred
from snowflake_server._ids.layouts import layout_from_record, layout_to_json, layout_to_record
from tests.support.fakes import SecondsClock

pytestmark = pytest.mark.zookeeper

OURS = Layout()
OTHER = Layout(epoch_ms=0)
SESSION = 4.0


def record_of(zk: KazooClient, zk_path: str, clock: SecondsClock | None = None) -> LayoutRecord:
    return LayoutRecord(
        lambda: zk, zk_path, OURS, 5.0,
        clock=clock or SecondsClock(), session_timeout=lambda: SESSION,
    )  # fmt: skip


def recorded(zk: KazooClient, zk_path: str) -> Layout | None:
    stat = zk.exists(f"{zk_path}/layout")
    return None if stat is None else layout_from_record(zk.get(f"{zk_path}/layout")[0])


def write(zk: KazooClient, zk_path: str, layout: Layout | bytes) -> None:
    data = layout if isinstance(layout, bytes) else layout_to_record(layout)
    if zk.exists(f"{zk_path}/layout") is None:
        zk.create(f"{zk_path}/layout", data, makepath=True)
    else:
        zk.set(f"{zk_path}/layout", data)


def mark(zk: KazooClient, zk_path: str, name: str, layout: Layout) -> None:
    value = {"mark_ms": 1_700_000_000_000, "layout": layout_to_json(layout)}
    zk.create(f"{zk_path}/marks/{name}", json.dumps(value).encode(), makepath=True)


def test_a_first_start_reads_ours_and_writes_nothing_when_it_is_missing(
    zk: KazooClient, zk_path: str
) -> None:
    record = record_of(zk, zk_path)
    record.check(Stage.FIRST_START)
    assert recorded(zk, zk_path) is None, "nothing written before the first mark"
    write(zk, zk_path, OURS)
    record.check(Stage.FIRST_START)
    assert record.hold is None and record.last == OURS


@pytest.mark.parametrize("stage", [Stage.FIRST_START, Stage.AGAIN])
def test_another_layout_is_refused_before_serving_and_held(
    zk: KazooClient, zk_path: str, stage: Stage
) -> None:
    write(zk, zk_path, OTHER)
    record = record_of(zk, zk_path)
    with pytest.raises(StartupRefused, match="Layout insanity"):
        record.check(stage)
    assert record.hold is not None and "is not the cluster's" in record.hold


def test_a_serving_node_is_held_by_another_layout_and_serves_again_after_the_settle_time(
    zk: KazooClient, zk_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = SecondsClock(100.0)
    record = record_of(zk, zk_path, clock)
    write(zk, zk_path, OTHER)
    record.check(Stage.SERVING)  # never raised while serving
    assert record.hold is not None and "zkCli.sh set" in caplog.text
    write(zk, zk_path, OURS)
    record.check(Stage.SERVING)
    assert record.hold is not None and "this node's again; serving 3.6 s after" in record.hold
    clock.advance(0.9 * SESSION - 0.01)
    record.check(Stage.SERVING)
    assert record.hold is not None, "the other layout's nodes may still serve"
    clock.advance(0.01)
    record.check(Stage.SERVING)
    assert record.hold is None


def test_a_record_that_is_not_a_layout_refuses_a_first_start_and_defers_a_registration(
    zk: KazooClient, zk_path: str
) -> None:
    write(zk, zk_path, b"garbage")
    record = record_of(zk, zk_path)
    with pytest.raises(StartupRefused, match="is not a layout"):
        record.check(Stage.FIRST_START)
    with pytest.raises(StartupDeferred, match="was not checked"):
        record.check(Stage.AGAIN)
    record.check(Stage.SERVING)
    assert record.hold is None, "a serving node stays as it is"


def test_a_deleted_record_is_written_back_as_last_read_but_never_from_nothing(
    zk: KazooClient, zk_path: str
) -> None:
    record = record_of(zk, zk_path)
    record.check(Stage.SERVING)
    assert recorded(zk, zk_path) is None, "nothing read yet: nothing to vouch for"
    write(zk, zk_path, OTHER)
    record.check(Stage.SERVING)
    zk.delete(f"{zk_path}/layout")
    record.check(Stage.SERVING)
    assert recorded(zk, zk_path) == OTHER, "the record that held it, not its own"


def test_a_first_start_confirmation_records_the_marks_layout_not_the_newcomers(
    zk: KazooClient, zk_path: str
) -> None:
    mark(zk, zk_path, "0/1", OTHER)
    record = record_of(zk, zk_path)
    with pytest.raises(StartupRefused, match="recorded from its marks"):
        record.confirm(Stage.FIRST_START)
    assert recorded(zk, zk_path) == OTHER


def test_a_first_start_confirmation_with_no_mark_records_ours(
    zk: KazooClient, zk_path: str
) -> None:
    record_of(zk, zk_path).confirm(Stage.FIRST_START)
    assert recorded(zk, zk_path) == OURS


def test_marks_of_two_layouts_refuse_naming_them(zk: KazooClient, zk_path: str) -> None:
    mark(zk, zk_path, "0/1", OTHER)
    mark(zk, zk_path, "1/10", OURS)
    record = record_of(zk, zk_path)
    assert record.marks_layouts() == {OTHER: ["marks/0/1"], OURS: ["marks/1/10"]}
    with pytest.raises(StartupRefused, match=re.escape("made under 2 layouts")):
        record.confirm(Stage.FIRST_START)
    assert recorded(zk, zk_path) is None


def test_a_confirmation_while_registering_again_writes_back_what_it_read_or_defers(
    zk: KazooClient, zk_path: str
) -> None:
    record = record_of(zk, zk_path)
    with pytest.raises(StartupDeferred, match="read no record to write back"):
        record.confirm(Stage.AGAIN)
    write(zk, zk_path, OURS)
    record.check(Stage.AGAIN)
    zk.delete(f"{zk_path}/layout")
    record.confirm(Stage.AGAIN)
    assert recorded(zk, zk_path) == OURS
