"""The Thrift protocol plugged into the serving core: binary-protocol calls, framed or
buffered, found whole and answered by the :class:`~.processor.Processor`.

A request is a frame (framed transport) or a message found by the
:class:`~.scanner.MessageScanner` (buffered). A framed ``get_id`` matched from
its bytes takes the fast path; everything else goes through thriftpy2's
processor. A frame longer than ``--max-frame-size`` is refused from its length
alone, a message walking more values than :data:`~.scanner.MAX_VALUES` before
it is decoded. A connection admitted into the port's reserve (the node is full)
serves the peer checks' calls only: ``get_id`` and ``get_ids`` get
``UnavailableError`` there, so that a client moves to another node.
"""

from __future__ import annotations

from collections.abc import Callable

from thriftpy2.thrift import TApplicationException

from .._ids.generator import WouldBlock
from .._observability.metrics import ConnectionStats
from .._serving.refusal import Cause, Refused
from .fastpath import SEQID_AT, SEQID_END, match_get_id
from .processor import Processor, encode_error, frame
from .scanner import Malformed, MessageScanner, TooLarge

__all__ = ["PEER_CHECK_METHODS", "ThriftProtocol", "thrift_protocols"]

PEER_CHECK_METHODS = frozenset(
    {"get_worker_id", "get_datacenter_id", "get_timestamp", "get_layout"}
)
"""What a connection in the reserved slots may call: a joining node's checks, no ids."""


class ThriftProtocol:
    """One connection's Thrift calls; see the module docstring.

    ``framed``: the framed transport (else buffered); ``limit``: the most bytes a
    request may take (``--max-frame-size``); ``peer_check_only``: admitted into the
    reserve.
    """

    closes = False  # a Thrift client never asks to close after a reply

    def __init__(
        self, processor: Processor, *, framed: bool, limit: int, peer_check_only: bool = False
    ) -> None:
        self._processor = processor
        self._framed = framed
        self._limit = limit
        self._scanner: MessageScanner | None = None  # buffered: the message coming in
        self._get_id_frame = processor.get_id_frame
        self._last_head = self._last_tail = self._last_agent = b"\xff"  # no request matches
        self.native_eligible = framed and not peer_check_only
        """A native listener may answer this connection's common ``get_id`` calls."""
        if peer_check_only:
            processor.allow_only(PEER_CHECK_METHODS)
        elif framed:
            self.fast = self._fast  # type: ignore[method-assign]

    def fast(self, data: bytes) -> bytes | None:
        return None  # no fast path: buffered, or the reserve

    def _fast(self, data: bytes) -> bytes | None:
        # The common case first: one whole get_id frame and nothing else, most often
        # the same as this connection's last one but for its seqid.
        if data[SEQID_END:] == self._last_tail and data[:SEQID_AT] == self._last_head:
            seqid, agent = data[SEQID_AT:SEQID_END], self._last_agent
        else:
            call = match_get_id(data, self._limit)
            if call is None:
                return None
            seqid, agent = call
            self._last_head, self._last_tail = data[:SEQID_AT], data[SEQID_END:]
            self._last_agent = agent
        try:
            return self._get_id_frame(seqid, agent)
        except WouldBlock:
            return None  # served as any request that must wait

    def pending(self, buf: bytearray) -> bool:
        return bool(buf)

    def register_agents_with(self, on_agent: Callable[[bytes, str], object]) -> None:
        """Tell ``on_agent(agent_bytes, label)`` of each agent a ``get_id`` validates."""
        self._processor.on_agent = on_agent

    def next_request(self, buf: bytearray, pos: int) -> tuple[bytes | None, int]:
        if self._framed:
            if len(buf) - pos < 4:
                return None, pos
            size = int.from_bytes(buf[pos : pos + 4], "big", signed=True)
            if not 0 < size <= self._limit:
                raise Refused(
                    "frame_too_large",
                    f"frame of {size} bytes refused: --max-frame-size is {self._limit} bytes",
                    Cause.TOO_LARGE,
                )
            end = pos + 4 + size
            return (bytes(buf[pos:end]), end) if end <= len(buf) else (None, pos)
        scanner = self._scanner
        if scanner is None:
            if pos == len(buf):
                return None, pos
            scanner = self._scanner = MessageScanner(self._limit)
        try:
            length = scanner.feed(buf, pos)
        except TooLarge as e:
            raise Refused("frame_too_large", str(e), Cause.TOO_LARGE) from None
        except Malformed as e:
            raise Refused("protocol_error", f"undecodable request: {e}") from None
        if length is None:
            return None, pos
        self._scanner = None
        return bytes(buf[pos : pos + length]), pos + length

    def reply(self, request: bytes) -> bytes:
        """The reply to one whole request. Runs on the loop, or on a worker thread
        when it raised ``WouldBlock`` there."""
        processor = self._processor
        if not self._framed:
            return _generic(processor, request)
        call = None if processor.restricted else match_get_id(request, self._limit)
        if call is not None:
            return processor.get_id_frame(*call)
        message = request[4:]
        try:
            length = MessageScanner(self._limit).feed(message, 0)
        except (Malformed, TooLarge) as e:
            # Anything announced past the frame is malformed: a call never spans frames.
            raise Refused("protocol_error", f"undecodable request: {e}") from None
        if length is None:
            raise Refused("protocol_error", "undecodable request: the frame ends inside its call")
        if length != len(message):
            raise Refused(
                "protocol_error",
                f"undecodable request: {len(message) - length} bytes after the call in its frame",
            )
        return frame(_generic(processor, message))

    def refusal(self, error: Refused) -> bytes:
        kind = (
            TApplicationException.INTERNAL_ERROR
            if error.cause in (Cause.UNAVAILABLE, Cause.INTERNAL)
            else TApplicationException.PROTOCOL_ERROR
        )
        reply = encode_error(kind, str(error))
        return frame(reply) if self._framed else reply


def _generic(processor: Processor, message: bytes) -> bytes:
    try:
        return processor.process_message(message)
    except WouldBlock:
        raise
    except Exception as e:  # noqa: BLE001 - bytes thriftpy2 cannot decode: refuse this client only
        raise Refused("protocol_error", f"undecodable request: {e!r}") from None


def thrift_protocols(
    make_processor: Callable[[ConnectionStats], Processor], *, framed: bool, limit: int
) -> Callable[[ConnectionStats, bool], ThriftProtocol]:
    """What the Thrift endpoint makes each connection's protocol with."""

    def make(stats: ConnectionStats, peer_check_only: bool) -> ThriftProtocol:
        return ThriftProtocol(
            make_processor(stats), framed=framed, limit=limit, peer_check_only=peer_check_only
        )

    return make
