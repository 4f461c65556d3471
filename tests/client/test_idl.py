"""The IDL: one file, shipped inside the client package, and its mapping onto this
package's errors and Layout."""

from __future__ import annotations

from pathlib import Path

import pytest
from snowflake_thrift_client import ClockMovedBackwardsError, Layout, RequestError
from snowflake_thrift_client._idl import (
    DECLARED_ERRORS,
    declared_exceptions,
    idl_text,
    layout_from_thrift,
    layout_to_thrift,
    request_error,
    snowflake_thrift,
)

ROOT = Path(__file__).parents[2]


def test_the_installed_idl_is_the_top_level_idl() -> None:
    assert idl_text() == (ROOT / "idl" / "snowflake.thrift").read_text(encoding="utf-8")
    shipped = ROOT / "clients" / "python" / "snowflake_thrift_client" / "idl"
    assert shipped.resolve() == (ROOT / "idl").resolve()


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


def test_every_declared_error_travels_as_an_idl_exception_and_back() -> None:
    declared = {name for method in ("get_id", "get_ids") for name in declared_exceptions(method)}
    assert set(DECLARED_ERRORS.values()) == declared, "each one mapped, none left over"
    for ours, idl_name in DECLARED_ERRORS.items():
        raised = getattr(snowflake_thrift(), idl_name)(message=f"{idl_name}: 12 milliseconds")
        error = request_error(raised)
        assert type(error) is ours and str(error) == f"{idl_name}: 12 milliseconds"
        if isinstance(error, ClockMovedBackwardsError):
            assert error.behind_ms == 12, "read from the message: the IDL has no field for it"
    behind = request_error(snowflake_thrift().InvalidSystemClock(message="no number"))
    assert isinstance(behind, ClockMovedBackwardsError) and behind.behind_ms == 0


def test_an_exception_this_client_does_not_know_is_a_request_error() -> None:
    class FromANewerServer(Exception):
        message = "new reasons"

    error = request_error(FromANewerServer())
    assert type(error) is RequestError and str(error) == "FromANewerServer: new reasons"


@pytest.mark.parametrize(
    "layout",
    [
        Layout(),
        Layout(epoch_ms=0, timestamp_bits=40, sequence_bits=13),
        Layout(datacenter_id_bits=3, clock_sequence_bits=2),
    ],
)
def test_the_layout_struct_round_trips(layout: Layout) -> None:
    raw = layout_to_thrift(layout, 3, 17)
    assert (raw.datacenter_id, raw.worker_id) == (3, 17)
    assert raw.clock_sequence_bits == layout.clock_sequence_bits
    assert layout_from_thrift(raw) == (layout, 3, 17)


def test_a_layout_from_a_server_without_clock_sequences_has_none() -> None:
    raw = layout_to_thrift(Layout(), 0, 0)
    raw.clock_sequence_bits = None  # what thriftpy2 leaves for a field the server never sent
    assert layout_from_thrift(raw)[0].clock_sequence_bits == 0
