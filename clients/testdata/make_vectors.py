"""Write ``decode-vectors.json``: ids made by the server's own ``IdGenerator``, with
their parts, for the decode helpers of every language to check themselves against.

    .venv/bin/python clients/testdata/make_vectors.py          # rewrite the file
    .venv/bin/python clients/testdata/make_vectors.py --check  # exit 1 if it is stale

The generator runs on a fixed clock, so the file is the same on every run:
``tests/client/test_decode_vectors.py`` renders it again and fails on any difference.
The expected parts are what the generator was given (its clock, datacenter and worker
ids, and the position in a batch started at sequence 0), never what a decoder says,
and the ISO times come from integer arithmetic.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from snowflake_server import GeneratorSettings, IdGenerator, Layout

__all__ = ["LAYOUTS", "VECTORS_FILE", "main", "render"]

VECTORS_FILE = Path(__file__).resolve().with_name("decode-vectors.json")

LAYOUTS: dict[str, Layout] = {
    "default": Layout(),
    # The Unix epoch and 43 timestamp bits reach 2248: past 2^33 s, where a float
    # number of seconds no longer holds every ms, so a decoder must use integers.
    "unix-43-3-7-10": Layout(
        epoch_ms=0, timestamp_bits=43, datacenter_id_bits=3, worker_id_bits=7, sequence_bits=10
    ),
    # 59 bits in all: ids at or past 2^59 fit an int64 but not this layout.
    "2020-39-0-8-12": Layout(
        epoch_ms=1577836800000,
        timestamp_bits=39,
        datacenter_id_bits=0,
        worker_id_bits=8,
        sequence_bits=12,
    ),
    # Two clock-sequence bits between the timestamp and a 3-bit datacenter field.
    "cs-41-2-3-5-12": Layout(datacenter_id_bits=3, clock_sequence_bits=2),
}

_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

ERROR_KINDS = {
    "format": "not a decimal integer (an optional '-', then ASCII digits). "
    "Python: int() raises ValueError; JavaScript: TypeError; Go: errors.Is(err, ErrFormat)",
    "range": "a decimal integer that is no id of the layout: negative, 2^63 or more, or "
    "wider than the layout's bits. Python: ConfigurationError; JavaScript: RangeError; "
    "Go: errors.Is(err, ErrRange)",
}


@dataclass(frozen=True)
class _Batch:
    """One ``next_ids(count)`` call at ``timestamp_ms``; ``keep`` of its ids (by index)."""

    note: str
    layout: str
    timestamp_ms: int
    datacenter_id: int
    worker_id: int
    count: int = 1
    keep: tuple[int, ...] | None = None  # None: every id
    clock_sequence: int = 0


def _max_ms(name: str) -> int:
    return LAYOUTS[name].max_timestamp_ms


def _batches() -> list[_Batch]:
    default_epoch = LAYOUTS["default"].epoch_ms
    return [
        _Batch("seed 003, the worked example", "default", 1505914988849, 17, 25),
        _Batch("the epoch itself: id 0", "default", default_epoch, 0, 0),
        _Batch(
            "2^53 - 1, the largest id a JavaScript Number holds exactly",
            "default",
            default_epoch + 2**31 - 1,
            31,
            31,
            count=4096,
            keep=(4095,),
        ),
        _Batch("2^53: a Number would round it", "default", default_epoch + 2**31, 0, 0),
        _Batch("a batch of three", "default", 1763900000000, 3, 7, count=3),
        _Batch(
            "the layout's last id: 2^63 - 1",
            "default",
            _max_ms("default"),
            31,
            31,
            count=4096,
            keep=(4095,),
        ),
        _Batch(
            "another layout, the same ms as seed 003",
            "unix-43-3-7-10",
            1505914988849,
            5,
            100,
            count=2,
        ),
        _Batch(
            "2243: a float number of seconds is a ms off here",
            "unix-43-3-7-10",
            8615105974748,
            6,
            1,
            count=2,
        ),
        _Batch(
            "the layout's last id: 2^63 - 1",
            "unix-43-3-7-10",
            _max_ms("unix-43-3-7-10"),
            7,
            127,
            count=1024,
            keep=(1023,),
        ),
        _Batch("the epoch, a field of no bits", "2020-39-0-8-12", 1577836800000, 0, 0),
        _Batch("a batch of three", "2020-39-0-8-12", 1763900000000, 0, 255, count=3),
        _Batch(
            "the layout's last id: 2^59 - 1",
            "2020-39-0-8-12",
            _max_ms("2020-39-0-8-12"),
            0,
            255,
            count=4096,
            keep=(4095,),
        ),
        _Batch(
            "clock sequence 2, the same ms as seed 003",
            "cs-41-2-3-5-12",
            1505914988849,
            5,
            25,
            count=2,
            clock_sequence=2,
        ),
        _Batch(
            "the layout's last id: 2^63 - 1",
            "cs-41-2-3-5-12",
            _max_ms("cs-41-2-3-5-12"),
            7,
            31,
            count=4096,
            keep=(4095,),
            clock_sequence=3,
        ),
    ]


# (layout, input, kind, note): inputs every decoder refuses. Python's int() also takes
# " 1", "+1" and "1_0", so those are in the JavaScript and Go tests of their own instead.
_INVALID: list[tuple[str, str, str, str]] = [
    ("default", "", "format", "empty"),
    ("default", "abc", "format", "letters"),
    ("default", "12a", "format", "a trailing letter"),
    ("default", "1.5", "format", "a fraction"),
    ("default", "1e3", "format", "an exponent"),
    ("default", "0x1F", "format", "hexadecimal"),
    ("default", "--1", "format", "two signs"),
    ("default", "-1", "range", "negative"),
    ("default", str(-(2**63)), "range", "the smallest int64"),
    ("default", str(2**63), "range", "2^63: the sign bit"),
    ("default", str(2**64), "range", "2^64: past 64 bits"),
    ("default", "1" + "0" * 30, "range", "10^30: past any int64"),
    ("unix-43-3-7-10", str(2**63), "range", "2^63: the sign bit"),
    ("2020-39-0-8-12", str(2**59), "range", "2^59: wider than the layout's 59 bits"),
    ("2020-39-0-8-12", str(2**63 - 1), "range", "an int64, but wider than the layout"),
    ("cs-41-2-3-5-12", str(2**63), "range", "2^63: the sign bit"),
]


def _iso(timestamp_ms: int) -> str:
    moment = _UNIX_EPOCH + timedelta(milliseconds=timestamp_ms)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _valid() -> list[dict[str, object]]:
    vectors: list[dict[str, object]] = []
    for batch in _batches():
        layout = LAYOUTS[batch.layout]
        settings = GeneratorSettings(
            datacenter_id=batch.datacenter_id,
            worker_id=batch.worker_id,
            layout=layout,
            max_batch=batch.count,
        )
        ms = batch.timestamp_ms
        stopped_clock = itertools.repeat(ms).__next__  # every reading: ms
        generator = IdGenerator(settings, clock=stopped_clock, clock_sequence=batch.clock_sequence)
        ids = generator.next_ids(batch.count)
        for sequence in batch.keep if batch.keep is not None else range(batch.count):
            id_ = ids[sequence]
            # The generator and compose are separate code: both must agree.
            expected = layout.compose(
                ms, batch.datacenter_id, batch.worker_id, sequence, batch.clock_sequence
            )
            if id_ != expected:
                raise RuntimeError(f"{batch}: the generator made {id_}, compose {expected}")
            vectors.append(
                {
                    "layout": batch.layout,
                    "note": batch.note,
                    "id": str(id_),
                    "time": _iso(ms),
                    "timestamp_ms": ms,
                    "datacenter_id": batch.datacenter_id,
                    "worker_id": batch.worker_id,
                    "sequence": sequence,
                    "clock_sequence": batch.clock_sequence,
                }
            )
    return vectors


def _layout_json(layout: Layout) -> dict[str, int]:
    return {
        "epoch_ms": layout.epoch_ms,
        "timestamp_bits": layout.timestamp_bits,
        "datacenter_id_bits": layout.datacenter_id_bits,
        "worker_id_bits": layout.worker_id_bits,
        "sequence_bits": layout.sequence_bits,
        "clock_sequence_bits": layout.clock_sequence_bits,
    }


def render() -> str:
    """The whole file's text: one vector a line, so that a diff shows which changed."""
    invalid = [
        {"layout": layout, "input": text, "error": kind, "note": note}
        for layout, text, kind, note in _INVALID
    ]
    head = {
        "description": "Snowflake ids and their parts, made by the server's IdGenerator "
        "(clients/testdata/make_vectors.py). Ids are strings: they exceed 2^53. time is "
        "ISO-8601 UTC with ms; timestamp_ms is ms since the Unix epoch.",
        "error_kinds": ERROR_KINDS,
        "layouts": {name: _layout_json(layout) for name, layout in LAYOUTS.items()},
    }
    lines = ["{"]
    for key, value in head.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)},")
    for key, rows in (("valid", _valid()), ("invalid", invalid)):
        lines.append(f'  "{key}": [')
        lines.extend(f"    {json.dumps(row, ensure_ascii=False)}," for row in rows)
        lines[-1] = lines[-1].rstrip(",")
        lines.append("  ],")
    lines[-1] = "  ]"
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the file, or with ``--check`` only say whether it is up to date (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = VECTORS_FILE.read_text(encoding="utf-8") if VECTORS_FILE.exists() else ""
        if current != text:
            print(f"{VECTORS_FILE} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    VECTORS_FILE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
