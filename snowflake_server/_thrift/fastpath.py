"""The ``get_id`` fast path: the service's common request recognised from its bytes,
and its reply packed directly.

A framed, strict binary-protocol ``get_id`` call with its one string field and
nothing else is the request nearly every client sends, millions of times. Going
through thriftpy2's generic processor costs objects, attribute lookups and
dispatch per call; matching the request's fixed bytes and packing the reply
with one ``struct`` call costs a fraction of that. Anything else (another
method, another field order, an unknown field, the old non-strict header, the
buffered transport) is left to the generic processor, which stays the
reference: the fast path's replies are byte for byte the ones it writes
(tests/server/test_fastpath.py proves it on generated requests).

A framed ``get_id`` request, ``L`` bytes of user agent::

    frame length (26 + L) | 80 01 00 01 | 00 00 00 06 "get_id" | seqid (4)
    | 0b 00 01 (field 1, string) | L (4) | agent (L) | 00 (stop)
"""

from __future__ import annotations

import struct

__all__ = ["SEQID_AT", "SEQID_END", "get_id_reply", "match_get_id"]

# Strict binary protocol: version 1 in the high half of the first word, the
# message type (CALL 1, REPLY 2) in its low byte.
_VERSION_1 = 0x80010000
_CALL, _REPLY = 1, 2
_NAME = b"get_id"

_REQUEST_HEAD = struct.pack(">II", _VERSION_1 | _CALL, len(_NAME)) + _NAME  # frame bytes 4..18
_AGENT_FIELD = b"\x0b\x00\x01"  # type STRING (11), field id 1
_HEAD_END = 4 + len(_REQUEST_HEAD)  # where the seqid starts
SEQID_AT, SEQID_END = _HEAD_END, _HEAD_END + 4
"""Where a matched request's seqid lies: the only bytes in which two requests of the same
agent differ."""
_AGENT_AT = _HEAD_END + 4 + len(_AGENT_FIELD) + 4  # where the agent's bytes start
_OVERHEAD = _AGENT_AT + 1  # every byte but the agent's: 30

_REPLY_HEAD = struct.pack(">III", 30, _VERSION_1 | _REPLY, len(_NAME)) + _NAME
# frame length + head, seqid, field 0 of type I64 (10), the id, the stop byte
_PACK_REPLY = struct.Struct(f">{len(_REPLY_HEAD)}s4s3sqx").pack


def match_get_id(frame: bytes, limit: int) -> tuple[bytes, bytes] | None:
    """``(seqid, agent)``, their raw bytes, if ``frame`` (a whole frame with its
    4-byte length) is exactly one common ``get_id`` request no longer than
    ``limit``; else ``None`` (the generic processor decides)."""
    n = len(frame)
    if (
        frame[4:_HEAD_END] == _REQUEST_HEAD
        and frame[_HEAD_END + 4 : _HEAD_END + 7] == _AGENT_FIELD
        and frame[-1] == 0
        and int.from_bytes(frame[:4], "big") == n - 4 <= limit
        and int.from_bytes(frame[_AGENT_AT - 4 : _AGENT_AT], "big") == n - _OVERHEAD
    ):
        return frame[_HEAD_END : _HEAD_END + 4], frame[_AGENT_AT:-1]
    return None


def get_id_reply(seqid: bytes, id_: int) -> bytes:
    """The framed reply to a ``get_id`` call with ``seqid`` (4 raw bytes) returning ``id_``."""
    return _PACK_REPLY(_REPLY_HEAD, seqid, b"\x0a\x00\x00", id_)
