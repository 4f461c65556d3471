"""Every form the server gives the id layout (the client's :class:`Layout`), in one place.

The forms:

- the options' form, :func:`layout_from`: ``--epoch`` and the ``--*-bits`` options,
  as settings or as ``snowflake decode``'s parsed arguments;
- every field by name, :func:`layout_fields` (in :data:`LAYOUT_FIELDS`' order): what
  ``/v1/layout`` and the OpenAPI document show;
- the recorded JSON form, :func:`layout_to_json` and back, :func:`layout_from_json`
  (:func:`valid_layout_json` checks its shape): what the state file, a mark in
  ZooKeeper and the cluster's layout record hold; the record's bytes are
  :func:`layout_to_record` and back, :func:`layout_from_record`;
- the operator's words: :func:`describe_layout` for a layout, and
  :func:`describe_layout_json` for a recorded one that may not be a valid layout.

Which format wrote what (``tests/data/formats/`` holds one file of each, never edited):

- state file format 1 (0.1.0): no layout; read as made under the layout in use;
- state file format 2 (0.2.0): ``"layout"``, the JSON form;
- state file format 3: a layout with a clock sequence, with a mark per value;
- a mark in ZooKeeper: a plain number (0.1.0), then ``{"mark_ms", "layout"}``
  (0.2.0), then ``"marks_ms"`` and ``"clock_sequence"`` added for a clock sequence;
- the cluster's layout record, ``<zk-path>/layout`` (0.2.0): the JSON form, keys sorted.

The JSON form omits ``clock_sequence_bits`` when it is 0: a server from before the
clock sequence (0.2.0) knows five fields and takes a record with a sixth for another
layout, or for none; a layout without a clock sequence is recorded as 0.2.0 wrote it,
so that such a server still reads it.

The Thrift form (``get_layout``'s struct) stays in the client
(``snowflake_thrift_client._idl``): the client decodes it without the server
installed, and the server depends on the client, never the reverse.
"""

from __future__ import annotations

import json
from typing import Any

from snowflake_thrift_client import Layout

from .._errors import ConfigurationError

__all__ = [
    "LAYOUT_FIELDS",
    "MAX_ID",
    "describe_layout",
    "describe_layout_json",
    "layout_fields",
    "layout_from",
    "layout_from_json",
    "layout_from_record",
    "layout_to_json",
    "layout_to_record",
    "parse_id",
    "valid_layout_json",
]

LAYOUT_FIELDS = ("epoch_ms", "timestamp_bits", "datacenter_id_bits", "worker_id_bits",
                 "sequence_bits", "clock_sequence_bits")  # fmt: skip
"""What the state file (and a mark in ZooKeeper) records of the layout, by ``Layout``'s
field names. ``clock_sequence_bits`` is recorded only when it is not 0, so that a
server from before it reads what a layout without one records."""


def layout_from(values: Any) -> Layout:
    """The :class:`Layout` named by the layout options' attributes of ``values``
    (settings, or parsed ``snowflake decode`` arguments)."""
    return Layout(
        epoch_ms=values.epoch,
        timestamp_bits=values.timestamp_bits,
        datacenter_id_bits=values.datacenter_id_bits,
        worker_id_bits=values.worker_id_bits,
        sequence_bits=values.sequence_bits,
        clock_sequence_bits=values.clock_sequence_bits,
    )


def layout_fields(layout: Layout) -> dict[str, int]:
    """Every field of the layout, by name (what ``get_layout`` and the HTTP API show)."""
    return {name: int(getattr(layout, name)) for name in LAYOUT_FIELDS}


def layout_to_json(layout: Layout) -> dict[str, int]:
    """The layout as the state file and ZooKeeper marks record it."""
    recorded = layout_fields(layout)
    if not layout.clock_sequence_bits:
        del recorded["clock_sequence_bits"]
    return recorded


def valid_layout_json(recorded: object) -> bool:
    """Whether ``recorded`` has the shape :func:`layout_to_json` gives."""
    return (
        isinstance(recorded, dict)
        and set(LAYOUT_FIELDS) - {"clock_sequence_bits"} <= set(recorded) <= set(LAYOUT_FIELDS)
        and all(type(value) is int for value in recorded.values())
    )


def layout_from_json(value: object) -> Layout:
    """The layout of a JSON object; ``ValueError`` if it is not one."""
    if not valid_layout_json(value):
        raise ValueError(f"not a layout: {value!r}")
    assert isinstance(value, dict)
    try:
        return Layout(**value)
    except ConfigurationError as e:
        raise ValueError(str(e)) from None


def describe_layout(layout: Layout) -> str:
    """``epoch 1288834974657 ms, bits 41/5/5/12 (timestamp/datacenter/worker/sequence)``;
    a clock sequence adds its bits after the timestamp's."""
    if layout.clock_sequence_bits:
        return (
            f"epoch {layout.epoch_ms} ms, bits {layout.timestamp_bits}/"
            f"{layout.clock_sequence_bits}/{layout.datacenter_id_bits}/{layout.worker_id_bits}/"
            f"{layout.sequence_bits} (timestamp/clock sequence/datacenter/worker/sequence)"
        )
    return (
        f"epoch {layout.epoch_ms} ms, bits {layout.timestamp_bits}/{layout.datacenter_id_bits}/"
        f"{layout.worker_id_bits}/{layout.sequence_bits} (timestamp/datacenter/worker/sequence)"
    )


def describe_layout_json(recorded: dict[str, Any]) -> str:
    """``epoch_ms 1288834974657, timestamp_bits 41, ...``: every field of a recorded
    layout as it was recorded (an absent one as 0), valid or not."""
    return ", ".join(f"{name} {recorded.get(name, 0)!r}" for name in LAYOUT_FIELDS)


def layout_to_record(layout: Layout) -> bytes:
    """The bytes of the cluster's layout record (``<zk-path>/layout``) for ``layout``."""
    return json.dumps(layout_to_json(layout), sort_keys=True).encode()


def layout_from_record(data: bytes) -> Layout:
    """The layout a layout record's bytes hold; ``ValueError`` if they hold none."""
    try:
        return layout_from_json(json.loads(data.decode()))
    except UnicodeDecodeError as e:
        raise ValueError(str(e)) from None


MAX_ID = 2**63 - 1
"""The largest id: ids are signed 64-bit integers (Thrift's i64), never negative."""


def parse_id(text: str) -> int:
    """The id ``text`` writes in plain ASCII decimal, 0 .. 2^63-1 (leading zeros allowed);
    else ``ConfigurationError`` whose message is the reason in a few words
    (``negative (ids are 0 .. 2^63-1 = ...)``). One parser for the command line and the
    HTTP API: ``int()`` would also take ``+5``, ``1_0``, `` 5`` and other scripts'
    digits (Arabic-Indic five, say)."""
    if not text:
        return _refuse("empty (an id is a decimal integer)")
    signed = text[0] in "+-"
    digits = text[1:] if signed else text
    plain = digits.isascii() and digits.isdigit()
    if plain and text[0] == "-" and digits.strip("0"):
        return _refuse(f"negative (ids are 0 .. 2^63-1 = {MAX_ID})")
    if signed or not plain:
        return _refuse("not a plain decimal integer (ASCII digits 0-9 only: no sign, space or _)")
    # Only the significant digits reach int(): thousands of leading zeros are a number
    # int() refuses to convert (its 4300-digit limit), not a reason to fail.
    significant = text.lstrip("0") or "0"
    if len(significant) > len(str(MAX_ID)) or int(significant) > MAX_ID:
        return _refuse(f"too large (ids are 0 .. 2^63-1 = {MAX_ID})")
    return int(significant)


def _refuse(why: str) -> int:
    raise ConfigurationError(why)
