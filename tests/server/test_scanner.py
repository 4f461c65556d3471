"""The message scanner against thriftpy2: where a message ends, however its bytes
arrive, and refusals before anything is decoded."""

from __future__ import annotations

import io
import struct
from typing import Any

import pytest
import thriftpy2
from hypothesis import given, settings
from hypothesis import strategies as st
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.thrift import TType
from thriftpy2.transport import TMemoryBuffer

from snowflake_server._thrift.scanner import (
    MAX_DEPTH,
    MAX_VALUES,
    Malformed,
    MessageScanner,
    TooLarge,
)
from tests.support.endpoints import BytesReader

_IDL = """
struct Inner { 1: i64 a, 2: string b, 3: list<i32> c }
struct Everything {
  1: bool flag, 2: byte small, 3: i16 short_, 4: i32 int_, 5: i64 long_, 6: double real,
  7: string text, 8: binary blob, 9: list<i64> longs, 10: list<string> texts,
  11: set<i32> ints, 12: map<string, list<i64>> table, 13: Inner inner,
  14: list<Inner> inners, 15: map<i32, Inner> by_id,
}
"""
shapes = thriftpy2.load_fp(io.StringIO(_IDL), module_name="scanner_shapes_thrift")

inner = st.builds(
    shapes.Inner,
    a=st.none() | st.integers(-(2**63), 2**63 - 1),
    b=st.none() | st.text(max_size=20),
    c=st.none() | st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5),
)
everything = st.builds(
    shapes.Everything,
    flag=st.none() | st.booleans(),
    small=st.none() | st.integers(-128, 127),
    short_=st.none() | st.integers(-(2**15), 2**15 - 1),
    int_=st.none() | st.integers(-(2**31), 2**31 - 1),
    long_=st.none() | st.integers(-(2**63), 2**63 - 1),
    real=st.none() | st.floats(allow_nan=False),
    text=st.none() | st.text(max_size=30),
    blob=st.none() | st.binary(max_size=30),
    longs=st.none() | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6),
    texts=st.none() | st.lists(st.text(max_size=8), max_size=4),
    ints=st.none() | st.sets(st.integers(-(2**31), 2**31 - 1), max_size=4),
    table=st.none() | st.dictionaries(st.text(max_size=6), st.lists(st.integers(0, 9)), max_size=3),
    inner=st.none() | inner,
    inners=st.none() | st.lists(inner, max_size=3),
    by_id=st.none() | st.dictionaries(st.integers(-5, 5), inner, max_size=3),
)


def message(payload: Any, name: str = "get_id", strict: bool = True) -> bytes:
    out: Any = TMemoryBuffer()  # type: ignore[no-untyped-call]
    protocol: Any = TBinaryProtocol(out, strict_write=strict)  # type: ignore[no-untyped-call]
    protocol.write_message_begin(name, 1, 42)
    payload.write(protocol)
    protocol.write_message_end()
    return bytes(out.getvalue())


def feed_in_chunks(data: bytes, cuts: list[int], limit: int = 1 << 20) -> int | None:
    """Feed ``data`` as a growing buffer cut at ``cuts``; the scanner's last answer."""
    scanner = MessageScanner(limit)
    buf = bytearray()
    result = None
    for end in [*sorted(set(cuts)), len(data)]:
        buf += data[len(buf) : end]
        result = scanner.feed(buf, 0)
        if result is not None:
            return result
    return result


@given(payload=everything, strict=st.booleans(), data=st.data())
@settings(max_examples=200, deadline=None)
def test_the_end_of_any_message_is_found_however_its_bytes_arrive(
    payload: Any, strict: bool, data: st.DataObject
) -> None:
    encoded = message(payload, strict=strict)
    cuts = data.draw(st.lists(st.integers(0, len(encoded)), max_size=10))
    assert feed_in_chunks(encoded + b"next call", cuts) == len(encoded)
    assert MessageScanner(1 << 20).feed(encoded[:-1], 0) is None


@given(payload=everything, data=st.data())
@settings(max_examples=200, deadline=None)
def test_what_the_scanner_accepts_thriftpy2_reads_to_the_same_byte(
    payload: Any, data: st.DataObject
) -> None:
    encoded = bytearray(message(payload))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(encoded) - 1))
        encoded[at] = data.draw(st.integers(0, 255))
    try:
        length = MessageScanner(1 << 20).feed(bytes(encoded), 0)
    except (Malformed, TooLarge):
        return
    if length is None:
        return
    reader = BytesReader(bytes(encoded))
    # Strings as bytes: a changed byte may leave a string that is not UTF-8.
    protocol: Any = TBinaryProtocol(reader, decode_response=False)  # type: ignore[no-untyped-call]
    try:
        protocol.read_message_begin()
    except UnicodeDecodeError:
        return  # a method name that is not UTF-8: thriftpy2 refuses what the scanner passed
    protocol.skip(TType.STRUCT)
    assert reader.position == length


def test_a_huge_container_is_refused_from_its_header() -> None:
    head = struct.pack(">iI", -2147418111, 6) + b"get_id" + struct.pack(">i", 1)
    # field 9, list of 2^31-1 i64: 16 GiB announced in 5 bytes
    with pytest.raises(TooLarge):
        MessageScanner(65536).feed(head + b"\x0f\x00\x09\x0a\x7f\xff\xff\xff", 0)
    # a list of an element type that does not exist, which thriftpy2 would loop over
    with pytest.raises(Malformed, match="element type code 99"):
        MessageScanner(65536).feed(head + b"\x0f\x00\x09\x63\x7f\xff\xff\xff", 0)
    with pytest.raises(Malformed, match="unknown type code 1"):
        MessageScanner(65536).feed(head + b"\x01\x00\x09", 0)
    with pytest.raises(TooLarge):  # a string longer than the limit, before its bytes
        MessageScanner(100).feed(head + b"\x0b\x00\x01\x00\x01\x00\x00", 0)
    with pytest.raises(Malformed, match="negative string length"):
        MessageScanner(100).feed(head + b"\x0b\x00\x01\xff\xff\xff\xff", 0)
    with pytest.raises(Malformed, match="protocol version"):
        MessageScanner(100).feed(b"\x80\x02\x00\x01" + head[4:], 0)


def test_nesting_is_bounded() -> None:
    head = struct.pack(">iI", -2147418111, 6) + b"get_id" + struct.pack(">i", 1)
    deep = head + b"\x0c\x00\x01" * (MAX_DEPTH + 1)
    with pytest.raises(Malformed, match="nested deeper"):
        MessageScanner(65536).feed(deep, 0)
    lists = head + b"\x0f\x00\x01\x0f\x00\x00\x00\x01" + b"\x0f\x00\x00\x00\x01" * MAX_DEPTH
    with pytest.raises(Malformed, match="nested deeper"):
        MessageScanner(65536).feed(lists, 0)


@pytest.mark.parametrize("depth", [0, MAX_DEPTH - 3])
def test_the_values_walked_one_by_one_are_bounded_per_message(depth: int) -> None:
    head = struct.pack(">iI", -2147418111, 6) + b"get_id" + struct.pack(">i", 1)
    nest = b"\x0c\x00\x02" * depth  # structs in structs around the list (each a value)
    end = b"\x00" * (depth + 1)

    def empty_structs(n: int, announced: int | None = None) -> bytes:
        count = struct.pack(">i", n if announced is None else announced)
        return head + nest + b"\x0f\x00\x02\x0c" + count + b"\x00" * n

    most = MAX_VALUES - 1 - depth  # the list and the structs around it are values too
    whole = empty_structs(most) + end
    assert MessageScanner(65536).feed(whole, 0) == len(whole)
    # 64 KiB of empty structs: each a step for the scanner and for thriftpy2's decoder.
    # Refused at the first value past the bound, before the rest of the message arrives.
    bomb = empty_structs(most + 1, announced=60_000)
    with pytest.raises(Malformed, match=f"more than {MAX_VALUES} values"):
        MessageScanner(65536).feed(bomb, 0)
    # A list of fixed-size elements is one value, skipped in one step.
    longs = head + b"\x0f\x00\x02\x0a" + struct.pack(">i", 5000) + bytes(40_000) + b"\x00"
    assert MessageScanner(65536).feed(longs, 0) == len(longs)


def test_a_message_trickled_a_byte_at_a_time_is_walked_once() -> None:
    encoded = message(shapes.Everything(texts=["x"] * 50))
    scanner = MessageScanner(1 << 20)
    buf = bytearray()
    for byte in encoded[:-1]:
        buf.append(byte)
        assert scanner.feed(buf, 0) is None
    buf.append(encoded[-1])
    assert scanner.feed(buf, 0) == len(encoded)
