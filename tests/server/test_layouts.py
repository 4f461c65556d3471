"""The layout's forms (``_ids/layouts.py``), and every format they were written in.

The golden files in ``tests/data/formats/`` are the bytes each version wrote: today's
code must read every one of them into the marks and layout it holds, and today's
writers must write the current formats byte for byte (a changed key order, a
``clock_sequence_bits: 0`` recorded, and a server of the version before reads the file
as another layout's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kazoo.client import KazooClient
from snowflake_thrift_client import TWITTER_EPOCH_MS, Layout

from snowflake_server import StartupRefused
from snowflake_server._cluster.layout_record import parse_record
from snowflake_server._cluster.zkmarks import MarkOfAnotherLayout, ZkMarkStore, mark_layout
from snowflake_server._config.options import load_settings
from snowflake_server._ids.layouts import (
    LAYOUT_FIELDS,
    describe_layout,
    describe_layout_json,
    layout_fields,
    layout_from,
    layout_from_json,
    layout_to_json,
    layout_to_record,
    valid_layout_json,
)
from snowflake_server._state.statefile import StateFile

FORMATS = Path(__file__).parent.parent / "data" / "formats"

TWITTER = Layout()
"""The layout of the format-2 files."""
CLOCK_SEQUENCE = Layout(
    epoch_ms=1_700_000_000_000, datacenter_id_bits=4, worker_id_bits=4, clock_sequence_bits=2
)
"""The layout of the format-3 files: a clock sequence of 2 bits, taken from the node id."""
DATACENTER, WORKER = 1, 2
MARK_MS = 1_764_000_001_234  # the state files' of formats 1 and 2
ZK_MARK_MS = 1_764_000_002_000  # a mark in ZooKeeper: whole seconds
NEWEST_MS, IN_USE_MS = 1_764_000_005_000, 1_764_000_003_000  # format 3: values 0 and 1
CLOCK_SEQUENCE_MARKS = (NEWEST_MS, IN_USE_MS, -1, -1)


def golden(name: str) -> bytes:
    return (FORMATS / name).read_bytes()


def test_every_golden_file_is_listed_in_the_readme() -> None:
    readme = (FORMATS / "README.md").read_text()
    files = sorted(p.name for p in FORMATS.iterdir() if p.name != "README.md")
    assert len(files) == 8
    assert [name for name in files if f"`{name}`" not in readme] == []


# The state file


@contextlib.contextmanager
def state_file(tmp_path: Path, name: str | None, layout: Layout) -> Iterator[StateFile]:
    """The state file of a state directory holding a copy of the golden file ``name``
    (None: no file), open."""
    if name is not None:
        shutil.copyfile(FORMATS / name, tmp_path / f"worker-{DATACENTER}-{WORKER}.json")
    state = StateFile.open(tmp_path, DATACENTER, WORKER, layout)
    try:
        yield state
    finally:
        state.close()


def state_bytes(tmp_path: Path) -> bytes:
    return (tmp_path / f"worker-{DATACENTER}-{WORKER}.json").read_bytes()


def test_state_file_format_1_of_0_1_0_is_read_as_the_layout_in_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with state_file(tmp_path, "statefile-format-1.json", TWITTER) as state:
        with caplog.at_level(logging.WARNING):
            mark = state.load()
        assert (mark, state.marks, state.clock_sequence) == (MARK_MS, (MARK_MS,), 0)
        assert "records no id layout (format 1, from 0.1.0)" in caplog.text
        state.finish(MARK_MS)  # the next write records the layout: format 2, as 0.2.0 wrote it
    assert state_bytes(tmp_path) == golden("statefile-format-2.json")


def test_state_file_format_1_under_a_clock_sequence_is_value_0s_mark(tmp_path: Path) -> None:
    with state_file(tmp_path, "statefile-format-1.json", CLOCK_SEQUENCE) as state:
        mark = state.load()
        assert (mark, state.marks, state.clock_sequence) == (MARK_MS, (MARK_MS, -1, -1, -1), 0)


def test_state_file_format_2_is_read(tmp_path: Path) -> None:
    with state_file(tmp_path, "statefile-format-2.json", TWITTER) as state:
        mark = state.load()
        assert (mark, state.marks, state.clock_sequence) == (MARK_MS, (MARK_MS,), 0)
    other = Layout(epoch_ms=TWITTER_EPOCH_MS + 1)
    refused = pytest.raises(StartupRefused, match="written under another id layout")
    with state_file(tmp_path, "statefile-format-2.json", other) as state, refused:
        state.load()


def test_state_file_format_3_is_read(tmp_path: Path) -> None:
    with state_file(tmp_path, "statefile-format-3.json", CLOCK_SEQUENCE) as state:
        mark = state.load()
        assert (mark, state.marks, state.clock_sequence) == (NEWEST_MS, CLOCK_SEQUENCE_MARKS, 1)
        assert state.mark_ms == IN_USE_MS
    refused = pytest.raises(StartupRefused, match="written under another id layout")
    with state_file(tmp_path, "statefile-format-3.json", TWITTER) as state, refused:
        state.load()


def test_state_file_format_2_is_written_byte_for_byte(tmp_path: Path) -> None:
    with state_file(tmp_path, None, TWITTER) as state:
        assert state.load() is None
        state.advance(MARK_MS)
    assert state_bytes(tmp_path) == golden("statefile-format-2.json")


def test_state_file_format_3_is_written_byte_for_byte(tmp_path: Path) -> None:
    with state_file(tmp_path, None, CLOCK_SEQUENCE) as state:
        assert state.load() is None
        state.advance(NEWEST_MS, 0)
        state.advance(IN_USE_MS, 1, switching=True)  # the clock went back: value 1, lower mark
    assert state_bytes(tmp_path) == golden("statefile-format-3.json")


# A mark in ZooKeeper (marks/<datacenter>/<worker>), read and written through a real one


def lost(why: str) -> None:
    raise AssertionError(f"the store lost its worker id: {why}")


def load_mark(zk: KazooClient, path: str, layout: Layout) -> ZkMarkStore:
    return ZkMarkStore.load(lambda: zk, path, lost, layout)


@pytest.mark.zookeeper
@pytest.mark.parametrize(
    ("name", "layout", "marks", "in_use"),
    [
        ("zk-mark-format-1.txt", TWITTER, (ZK_MARK_MS,), 0),
        ("zk-mark-format-1.txt", CLOCK_SEQUENCE, (ZK_MARK_MS, -1, -1, -1), 0),
        ("zk-mark-format-2.json", TWITTER, (ZK_MARK_MS,), 0),
        ("zk-mark-format-3.json", CLOCK_SEQUENCE, CLOCK_SEQUENCE_MARKS, 1),
    ],
)
def test_zookeeper_mark_is_read(
    zk: KazooClient,
    zk_path: str,
    name: str,
    layout: Layout,
    marks: tuple[int, ...],
    in_use: int,
) -> None:
    path = f"{zk_path}/marks/{DATACENTER}/{WORKER}"
    zk.create(path, golden(name), makepath=True)
    store = load_mark(zk, path, layout)
    assert (store.marks, store.clock_sequence) == (marks, in_use)
    assert mark_layout(golden(name)) == (None if name.endswith(".txt") else layout)


@pytest.mark.zookeeper
@pytest.mark.parametrize("name", ["zk-mark-format-2.json", "zk-mark-format-3.json"])
def test_zookeeper_mark_of_another_layout_is_refused(
    zk: KazooClient, zk_path: str, name: str
) -> None:
    path = f"{zk_path}/marks/{DATACENTER}/{WORKER}"
    zk.create(path, golden(name), makepath=True)
    other = Layout(epoch_ms=0)
    with pytest.raises(MarkOfAnotherLayout, match="recorded under another layout"):
        load_mark(zk, path, other)


@pytest.mark.zookeeper
def test_zookeeper_mark_format_2_is_written_byte_for_byte(zk: KazooClient, zk_path: str) -> None:
    path = f"{zk_path}/marks/{DATACENTER}/{WORKER}"
    store = load_mark(zk, path, TWITTER)
    store.advance(ZK_MARK_MS)
    assert zk.get(path)[0] == golden("zk-mark-format-2.json")


@pytest.mark.zookeeper
def test_zookeeper_mark_format_3_is_written_byte_for_byte(zk: KazooClient, zk_path: str) -> None:
    path = f"{zk_path}/marks/{DATACENTER}/{WORKER}"
    store = load_mark(zk, path, CLOCK_SEQUENCE)
    store.advance(NEWEST_MS, 0)
    store.advance(IN_USE_MS, 1, switching=True)
    assert zk.get(path)[0] == golden("zk-mark-format-3.json")


@pytest.mark.zookeeper
def test_zookeeper_mark_format_1_is_rewritten_with_its_layout(
    zk: KazooClient, zk_path: str
) -> None:
    path = f"{zk_path}/marks/{DATACENTER}/{WORKER}"
    zk.create(path, golden("zk-mark-format-1.txt"), makepath=True)
    store = load_mark(zk, path, TWITTER)
    store.finish(ZK_MARK_MS)
    assert zk.get(path)[0] == golden("zk-mark-format-2.json")


# The cluster's layout record (<zk-path>/layout)


@pytest.mark.parametrize(
    ("name", "layout"),
    [("zk-layout-record.json", TWITTER), ("zk-layout-record-clock-sequence.json", CLOCK_SEQUENCE)],
)
def test_layout_record_is_read_and_written_byte_for_byte(name: str, layout: Layout) -> None:
    assert parse_record("/snowflake/layout", golden(name)) == layout
    assert layout_to_record(layout) == golden(name)


# Every form round-trips


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    """Any valid layout: every width within the 63 bits an id has, any epoch."""
    left = 63
    widths = {}
    for name, least in (("sequence_bits", 1), ("timestamp_bits", 1)):
        widths[name] = draw(st.integers(least, left - (1 if name == "sequence_bits" else 0)))
        left -= widths[name]
    for name in ("datacenter_id_bits", "worker_id_bits", "clock_sequence_bits"):
        widths[name] = draw(st.integers(0, left) | st.just(0))
        left -= widths[name]
    return Layout(epoch_ms=draw(st.integers(0, 2**63 - 1)), **widths)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_layout_round_trips_through_every_form(layout: Layout) -> None:
    recorded = layout_to_json(layout)
    assert valid_layout_json(recorded)
    assert ("clock_sequence_bits" in recorded) == (layout.clock_sequence_bits != 0)
    assert layout_from_json(recorded) == layout
    assert layout_from_json(json.loads(json.dumps(recorded))) == layout
    assert layout_fields(layout) == {**recorded, "clock_sequence_bits": layout.clock_sequence_bits}
    assert list(layout_fields(layout)) == list(LAYOUT_FIELDS)
    options = argparse.Namespace(
        epoch=layout.epoch_ms,
        timestamp_bits=layout.timestamp_bits,
        datacenter_id_bits=layout.datacenter_id_bits,
        worker_id_bits=layout.worker_id_bits,
        sequence_bits=layout.sequence_bits,
        clock_sequence_bits=layout.clock_sequence_bits,
    )
    assert layout_from(options) == layout


def test_layout_from_reads_the_settings() -> None:
    argv = ["--epoch", "1700000000000", "--datacenter-id-bits", "4", "--worker-id-bits", "4",
            "--clock-sequence-bits", "2"]  # fmt: skip
    assert layout_from(load_settings(argv, {"HOME": "/nonexistent"})) == CLOCK_SEQUENCE


@pytest.mark.parametrize(
    "recorded",
    [
        None,
        [],
        {"epoch_ms": 0},
        {**layout_to_json(TWITTER), "extra": 1},
        {**layout_to_json(TWITTER), "sequence_bits": True},
        {**layout_to_json(TWITTER), "sequence_bits": "12"},
    ],
)
def test_what_is_not_a_recorded_layout(recorded: object) -> None:
    assert not valid_layout_json(recorded)
    with pytest.raises(ValueError, match="not a layout"):
        layout_from_json(recorded)


def test_a_recorded_layout_that_cannot_be_is_a_value_error() -> None:
    too_wide = {**layout_to_json(TWITTER), "timestamp_bits": 60}
    assert valid_layout_json(too_wide)
    with pytest.raises(ValueError, match="layout needs 82 bits"):
        layout_from_json(too_wide)


def test_the_operators_words() -> None:
    assert describe_layout(TWITTER) == (
        "epoch 1288834974657 ms, bits 41/5/5/12 (timestamp/datacenter/worker/sequence)"
    )
    assert describe_layout(CLOCK_SEQUENCE) == (
        "epoch 1700000000000 ms, bits 41/2/4/4/12 "
        "(timestamp/clock sequence/datacenter/worker/sequence)"
    )
    assert describe_layout_json(layout_to_json(TWITTER)) == (
        "epoch_ms 1288834974657, timestamp_bits 41, datacenter_id_bits 5, worker_id_bits 5, "
        "sequence_bits 12, clock_sequence_bits 0"
    )
    assert describe_layout_json({"epoch_ms": "x"}) == (
        "epoch_ms 'x', timestamp_bits 0, datacenter_id_bits 0, worker_id_bits 0, "
        "sequence_bits 0, clock_sequence_bits 0"
    )
