"""How ids are packed, and how to take them apart: pure functions, no I/O.

Layout of an id with the default :class:`Layout` (Twitter's)::

     63 62                                 22 21     17 16     12 11           0
    +--+-------------------------------------+---------+---------+-------------+
    |0 |  41 bits: ms since epoch            | 5: dc   | 5: wkr  | 12: sequence|
    +--+-------------------------------------+---------+---------+-------------+

A layout may carve a clock sequence (``clock_sequence_bits``, 0 by default) out of
the node id: it sits between the timestamp and the datacenter id, so the timestamp
stays in the top bits and ``id >> timestamp_shift`` still gives the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from ._errors import ConfigurationError

__all__ = [
    "DEFAULT_LAYOUT",
    "ID_BITS",
    "TWITTER_EPOCH_MS",
    "DecodedId",
    "Layout",
    "check_int",
    "compose",
    "decompose",
]

TWITTER_EPOCH_MS = 1288834974657
"""2010-11-04T01:42:54.657Z, the epoch of Twitter's ids."""

ID_BITS = 63
"""Bits an id may use: the sign bit stays 0 so ids are positive in every language's i64."""


def check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` if it is an int in ``low..high``; else ``ConfigurationError`` naming ``name``."""
    # bool is an int subclass; True as a worker id is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigurationError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ConfigurationError(f"{name} must be in {low}..{high}, got {value}")
    return value


_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class DecodedId:
    """The parts of an id. ``timestamp_ms`` is ms since the Unix epoch."""

    id: int
    timestamp_ms: int
    datacenter_id: int
    worker_id: int
    sequence: int
    clock_sequence: int = 0
    """Which clock-sequence value made the id (always 0 in a layout without one)."""

    @property
    def datetime(self) -> datetime:
        """When the id was made, as an aware UTC datetime."""
        # Integer ms: past 2^32 s a float of seconds no longer holds every µs.
        return _UNIX_EPOCH + timedelta(milliseconds=self.timestamp_ms)

    def to_json(self) -> dict[str, object]:
        """The parts as JSON-ready values; the id as a string (it exceeds 2^53)."""
        moment = self.datetime.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return {
            "id": str(self.id),
            "time": moment,
            "timestamp_ms": self.timestamp_ms,
            "datacenter_id": self.datacenter_id,
            "worker_id": self.worker_id,
            "sequence": self.sequence,
            "clock_sequence": self.clock_sequence,
        }


@dataclass(frozen=True)
class Layout:
    """How ids are packed: an epoch and the width of each field.

    Defaults are Twitter's. All widths together must fit 63 bits, so ids stay
    positive signed 64-bit integers. Raises ``ConfigurationError`` otherwise.

    ``clock_sequence_bits`` (0 by default: none) makes room for a clock sequence,
    a value a server moves to when its clock steps back, so that its ids stay
    unique at times it already used (see the server's ``--clock-sequence-bits``).
    """

    epoch_ms: int = TWITTER_EPOCH_MS
    timestamp_bits: int = 41
    datacenter_id_bits: int = 5
    worker_id_bits: int = 5
    sequence_bits: int = 12
    clock_sequence_bits: int = 0

    def __post_init__(self) -> None:
        check_int("epoch_ms", self.epoch_ms, 0, 2**63 - 1)
        check_int("timestamp_bits", self.timestamp_bits, 1, ID_BITS)
        check_int("datacenter_id_bits", self.datacenter_id_bits, 0, ID_BITS)
        check_int("worker_id_bits", self.worker_id_bits, 0, ID_BITS)
        check_int("sequence_bits", self.sequence_bits, 1, ID_BITS)
        check_int("clock_sequence_bits", self.clock_sequence_bits, 0, ID_BITS)
        total = self.timestamp_shift + self.timestamp_bits
        if total > ID_BITS:
            clock = (
                f" + clock_sequence_bits {self.clock_sequence_bits}"
                if self.clock_sequence_bits
                else ""
            )
            hint = (
                "; take the clock sequence's bits from the node id (fewer datacenter_id_bits "
                "or worker_id_bits)"
                if self.clock_sequence_bits
                else ""
            )
            raise ConfigurationError(
                f"layout needs {total} bits (timestamp_bits {self.timestamp_bits}{clock} + "
                f"datacenter_id_bits {self.datacenter_id_bits} + worker_id_bits "
                f"{self.worker_id_bits} + sequence_bits {self.sequence_bits}) but an id has "
                f"{ID_BITS}{hint}"
            )

    @property
    def max_sequence(self) -> int:
        return (1 << self.sequence_bits) - 1

    @property
    def max_worker_id(self) -> int:
        return (1 << self.worker_id_bits) - 1

    @property
    def max_datacenter_id(self) -> int:
        return (1 << self.datacenter_id_bits) - 1

    @property
    def max_clock_sequence(self) -> int:
        return (1 << self.clock_sequence_bits) - 1

    @property
    def max_timestamp_ms(self) -> int:
        """The last ms since the Unix epoch that this layout can encode."""
        return self.epoch_ms + (1 << self.timestamp_bits) - 1

    @property
    def worker_id_shift(self) -> int:
        return self.sequence_bits

    @property
    def datacenter_id_shift(self) -> int:
        return self.sequence_bits + self.worker_id_bits

    @property
    def clock_sequence_shift(self) -> int:
        return self.sequence_bits + self.worker_id_bits + self.datacenter_id_bits

    @property
    def timestamp_shift(self) -> int:
        return self.clock_sequence_shift + self.clock_sequence_bits

    def node_bits(self, datacenter_id: int, worker_id: int, clock_sequence: int = 0) -> int:
        """The clock-sequence, datacenter and worker fields of an id, shifted into place."""
        check_int("datacenter_id", datacenter_id, 0, self.max_datacenter_id)
        check_int("worker_id", worker_id, 0, self.max_worker_id)
        check_int("clock_sequence", clock_sequence, 0, self.max_clock_sequence)
        return (
            (clock_sequence << self.clock_sequence_shift)
            | (datacenter_id << self.datacenter_id_shift)
            | (worker_id << self.worker_id_shift)
        )

    def compose(
        self,
        timestamp_ms: int,
        datacenter_id: int,
        worker_id: int,
        sequence: int,
        clock_sequence: int = 0,
    ) -> int:
        """The id for these parts; ``timestamp_ms`` is ms since the Unix epoch.

        Raises ``ConfigurationError`` for a part that does not fit its field.
        """
        check_int("timestamp_ms", timestamp_ms, self.epoch_ms, self.max_timestamp_ms)
        check_int("sequence", sequence, 0, self.max_sequence)
        return (
            ((timestamp_ms - self.epoch_ms) << self.timestamp_shift)
            | self.node_bits(datacenter_id, worker_id, clock_sequence)
            | sequence
        )

    def decompose(self, id_: int) -> DecodedId:
        """Split an id back into its parts. Raises ``ConfigurationError`` for a negative
        id or one wider than the layout."""
        width = self.timestamp_shift + self.timestamp_bits
        check_int("id", id_, 0, (1 << width) - 1)
        return DecodedId(
            id=id_,
            timestamp_ms=(id_ >> self.timestamp_shift) + self.epoch_ms,
            datacenter_id=(id_ >> self.datacenter_id_shift) & self.max_datacenter_id,
            worker_id=(id_ >> self.worker_id_shift) & self.max_worker_id,
            sequence=id_ & self.max_sequence,
            clock_sequence=(id_ >> self.clock_sequence_shift) & self.max_clock_sequence,
        )


DEFAULT_LAYOUT = Layout()


def compose(
    timestamp_ms: int,
    datacenter_id: int,
    worker_id: int,
    sequence: int,
    layout: Layout = DEFAULT_LAYOUT,
    clock_sequence: int = 0,
) -> int:
    """The id for these parts under ``layout`` (Twitter's by default)."""
    return layout.compose(timestamp_ms, datacenter_id, worker_id, sequence, clock_sequence)


def decompose(id_: int, layout: Layout = DEFAULT_LAYOUT) -> DecodedId:
    """The parts of ``id_`` under ``layout`` (Twitter's by default)."""
    return layout.decompose(id_)
