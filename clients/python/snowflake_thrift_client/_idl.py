"""The service's Thrift definitions, loaded from the IDL shipped in this package.

``idl/snowflake.thrift`` is the single source of truth: the server, this
client and the stubs for other languages are all made from that one file.
This module is also the one place that maps the IDL's exceptions onto this
package's errors and the IDL's ``Layout`` struct onto :class:`Layout`.
"""

from __future__ import annotations

import functools
import io
import re
from importlib import resources
from types import ModuleType
from typing import Any

import thriftpy2
from thriftpy2.thrift import TType

from ._errors import (
    ClockMovedBackwardsError,
    ConfigurationError,
    InvalidCountError,
    InvalidUserAgentError,
    RequestError,
    UnavailableError,
)
from ._layout import Layout

__all__ = [
    "DECLARED_ERRORS",
    "count_arg",
    "declared_exceptions",
    "idl_text",
    "layout_from_thrift",
    "layout_to_thrift",
    "request_error",
    "snowflake_thrift",
]

_I32_MAX = 2**31 - 1


def count_arg(count: object) -> int:
    """``get_ids``' count, checked before it is sent: the IDL's ``i32``. Past it the
    encoder fails (a local mistake pools took for a server failure) or wraps; the server
    judges what lies within (:class:`InvalidCountError` beyond its batch limit)."""
    if (
        isinstance(count, bool)
        or not isinstance(count, int)
        or not -_I32_MAX - 1 <= count <= _I32_MAX
    ):
        raise ConfigurationError(f"count must be an integer (an i32 in the IDL), got {count!r}")
    return count


DECLARED_ERRORS: dict[type[RequestError], str] = {
    ClockMovedBackwardsError: "InvalidSystemClock",
    InvalidUserAgentError: "InvalidUserAgentError",
    InvalidCountError: "InvalidCountError",
    UnavailableError: "UnavailableError",
}
"""Each request error and the name of the IDL exception it travels as."""


def idl_text() -> str:
    """The text of ``snowflake.thrift`` as installed with the package."""
    idl = resources.files(__package__).joinpath("idl").joinpath("snowflake.thrift")
    return idl.read_text(encoding="utf-8")


@functools.cache
def snowflake_thrift() -> ModuleType:
    """The IDL as a thriftpy2 module (``Snowflake`` service, exceptions, ``Layout``)."""
    return thriftpy2.load_fp(io.StringIO(idl_text()), module_name="snowflake_thrift")


@functools.cache
def declared_exceptions(method: str) -> dict[str, tuple[str, Any]]:
    """The exceptions ``method`` declares: IDL name -> (result field, exception class)."""
    result_cls = getattr(snowflake_thrift().Snowflake, f"{method}_result")
    return {
        spec[2].__name__: (spec[1], spec[2])
        for field_id, spec in result_cls.thrift_spec.items()
        if field_id != 0 and spec[0] == TType.STRUCT
    }


def request_error(error: Exception) -> RequestError:
    """This package's error for an IDL exception a server raised (same name, or
    ``ClockMovedBackwardsError`` for ``InvalidSystemClock``), with its message."""
    message = str(getattr(error, "message", "") or "")
    name = type(error).__name__
    for ours, idl_name in DECLARED_ERRORS.items():
        if idl_name == name:
            if ours is ClockMovedBackwardsError:
                found = re.search(r"(\d+) milli", message)
                return ClockMovedBackwardsError(int(found[1]) if found else 0, message)
            return ours(message)
    return RequestError(f"{name}: {message}")


def layout_to_thrift(layout: Layout, datacenter_id: int, worker_id: int) -> Any:
    """The IDL's ``Layout`` struct for a server with these ids."""
    return snowflake_thrift().Layout(
        epoch_ms=layout.epoch_ms,
        timestamp_bits=layout.timestamp_bits,
        datacenter_id_bits=layout.datacenter_id_bits,
        worker_id_bits=layout.worker_id_bits,
        sequence_bits=layout.sequence_bits,
        datacenter_id=datacenter_id,
        worker_id=worker_id,
        clock_sequence_bits=layout.clock_sequence_bits,
    )


def layout_from_thrift(raw: Any) -> tuple[Layout, int, int]:
    """``(layout, datacenter_id, worker_id)`` from the IDL's ``Layout`` struct."""
    layout = Layout(
        epoch_ms=raw.epoch_ms,
        timestamp_bits=raw.timestamp_bits,
        datacenter_id_bits=raw.datacenter_id_bits,
        worker_id_bits=raw.worker_id_bits,
        sequence_bits=raw.sequence_bits,
        # A server from before clock sequences leaves the field out: it has none.
        clock_sequence_bits=raw.clock_sequence_bits or 0,
    )
    return layout, raw.datacenter_id, raw.worker_id
