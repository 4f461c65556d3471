"""compose/decompose: the worked example, the round-trip law, validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from snowflake_thrift_client import (
    DEFAULT_LAYOUT,
    TWITTER_EPOCH_MS,
    ConfigurationError,
    Layout,
    compose,
    decompose,
)

from tests.support.examples import SEED_003_JSON


def test_worked_example_from_seed_003() -> None:
    decoded = decompose(910499571847892992)
    assert decoded.timestamp_ms == 1505914988849
    assert (decoded.datacenter_id, decoded.worker_id, decoded.sequence) == (17, 25, 0)
    assert compose(1505914988849, 17, 25, 0) == 910499571847892992
    assert decoded.datetime.isoformat() == "2017-09-20T13:43:08.849000+00:00"
    assert decoded.to_json() == SEED_003_JSON
    assert Layout(epoch_ms=TWITTER_EPOCH_MS) == DEFAULT_LAYOUT
    assert DEFAULT_LAYOUT.node_bits(17, 25) == (17 << 17) | (25 << 12)


@st.composite
def layouts_and_parts(draw: st.DrawFn) -> tuple[Layout, int, int, int, int]:
    dc_bits = draw(st.integers(0, 10))
    worker_bits = draw(st.integers(0, 10))
    seq_bits = draw(st.integers(1, 16))
    ts_bits = draw(st.integers(1, 63 - dc_bits - worker_bits - seq_bits))
    layout = Layout(
        epoch_ms=draw(st.integers(0, 2**45)),
        timestamp_bits=ts_bits,
        datacenter_id_bits=dc_bits,
        worker_id_bits=worker_bits,
        sequence_bits=seq_bits,
    )
    return (
        layout,
        draw(st.integers(layout.epoch_ms, layout.max_timestamp_ms)),
        draw(st.integers(0, layout.max_datacenter_id)),
        draw(st.integers(0, layout.max_worker_id)),
        draw(st.integers(0, layout.max_sequence)),
    )


@given(layouts_and_parts())
def test_decompose_inverts_compose(case: tuple[Layout, int, int, int, int]) -> None:
    layout, ts, dc, worker, seq = case
    id_ = layout.compose(ts, dc, worker, seq)
    assert 0 <= id_ < 2**63
    decoded = layout.decompose(id_)
    assert (decoded.timestamp_ms, decoded.datacenter_id, decoded.worker_id, decoded.sequence) == (
        ts,
        dc,
        worker,
        seq,
    )


@given(st.integers(0, 2**63 - 1))
def test_compose_inverts_decompose(id_: int) -> None:
    d = decompose(id_)
    assert compose(d.timestamp_ms, d.datacenter_id, d.worker_id, d.sequence) == id_


@given(st.integers(DEFAULT_LAYOUT.epoch_ms, DEFAULT_LAYOUT.max_timestamp_ms - 1))
def test_later_ms_always_gives_larger_ids(ts: int) -> None:
    assert compose(ts, 31, 31, 4095) < compose(ts + 1, 0, 0, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timestamp_bits": 42}, "layout needs 64 bits"),
        ({"sequence_bits": 0}, r"sequence_bits must be in 1\.\.63"),
        ({"worker_id_bits": -1}, "worker_id_bits"),
        ({"epoch_ms": -5}, "epoch_ms"),
        ({"datacenter_id_bits": "5"}, "must be an integer"),
    ],
)
def test_bad_layouts_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Layout(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((DEFAULT_LAYOUT.epoch_ms - 1, 0, 0, 0), "timestamp_ms"),
        ((DEFAULT_LAYOUT.max_timestamp_ms + 1, 0, 0, 0), "timestamp_ms"),
        ((DEFAULT_LAYOUT.epoch_ms, 32, 0, 0), "datacenter_id"),
        ((DEFAULT_LAYOUT.epoch_ms, 0, 32, 0), "worker_id"),
        ((DEFAULT_LAYOUT.epoch_ms, 0, 0, 4096), "sequence"),
    ],
)
def test_compose_refuses_parts_that_do_not_fit(
    args: tuple[int, int, int, int], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        compose(*args)


@pytest.mark.parametrize("bad", [-1, 2**63])
def test_decompose_refuses_out_of_range_ids(bad: int) -> None:
    with pytest.raises(ConfigurationError, match="id must be in"):
        decompose(bad)


def test_a_clock_sequence_sits_between_the_timestamp_and_the_datacenter() -> None:
    layout = Layout(datacenter_id_bits=3, clock_sequence_bits=2)
    assert (layout.clock_sequence_shift, layout.timestamp_shift) == (20, 22)
    assert layout.max_clock_sequence == 3
    id_ = layout.compose(TWITTER_EPOCH_MS + 1, 5, 25, 7, clock_sequence=2)
    assert id_ == (1 << 22) | (2 << 20) | (5 << 17) | (25 << 12) | 7
    decoded = layout.decompose(id_)
    assert (decoded.clock_sequence, decoded.datacenter_id, decoded.worker_id) == (2, 5, 25)
    assert decoded.to_json()["clock_sequence"] == 2
    # The time is where Twitter's layout has it: a decoder unaware of the field reads it.
    assert DEFAULT_LAYOUT.decompose(id_).timestamp_ms == decoded.timestamp_ms
    with pytest.raises(ConfigurationError, match=r"clock_sequence must be in 0\.\.3, got 4"):
        layout.compose(TWITTER_EPOCH_MS, 0, 0, 0, clock_sequence=4)
    with pytest.raises(ConfigurationError, match=r"clock_sequence must be in 0\.\.0, got 1"):
        DEFAULT_LAYOUT.compose(TWITTER_EPOCH_MS, 0, 0, 0, clock_sequence=1)


def test_a_clock_sequence_must_fit_63_bits_with_the_rest() -> None:
    with pytest.raises(ConfigurationError) as info:
        Layout(clock_sequence_bits=2)
    assert str(info.value) == (
        "layout needs 65 bits (timestamp_bits 41 + clock_sequence_bits 2 + datacenter_id_bits "
        "5 + worker_id_bits 5 + sequence_bits 12) but an id has 63; take the clock sequence's "
        "bits from the node id (fewer datacenter_id_bits or worker_id_bits)"
    )
    with pytest.raises(ConfigurationError, match="clock_sequence_bits must be an integer"):
        Layout(clock_sequence_bits=True)
