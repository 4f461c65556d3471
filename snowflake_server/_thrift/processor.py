"""The Thrift dispatch onto the service: a whole call's bytes in, its reply out,
every outcome turned into a reply.

Each connection gets its own :class:`Processor` and
:class:`~snowflake_server._service.SnowflakeHandler`, so per-call counting needs
no lock. Errors the client can act on are the IDL's
declared exceptions; anything unexpected becomes a Thrift application error
(INTERNAL_ERROR) on a connection that stays usable, never a dropped connection.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, NoReturn

from snowflake_thrift_client._idl import (
    DECLARED_ERRORS,
    declared_exceptions,
    layout_to_thrift,
    snowflake_thrift,
)
from thriftpy2.protocol import TCyBinaryProtocol
from thriftpy2.protocol.base import TProtocolBase
from thriftpy2.thrift import TApplicationException, TMessageType, TType
from thriftpy2.transport import TCyMemoryBuffer

from .._errors import RequestError, UnavailableError
from .._ids.generator import WouldBlock
from .._observability.metrics import ConnectionStats
from .._service import SnowflakeHandler
from .fastpath import get_id_reply

__all__ = ["Processor", "encode_error", "frame", "service_methods"]

log = logging.getLogger(__name__)

_AGENT_CACHE_SIZE = 64  # per connection, as the handler's

# The metric kind of each IDL exception a call can end with.
_KINDS = {
    "InvalidSystemClock": "invalid_system_clock",
    "InvalidUserAgentError": "invalid_user_agent",
    "InvalidCountError": "invalid_count",
    "UnavailableError": "unavailable",
}


@dataclass(frozen=True, slots=True)
class _MethodSpec:
    args_cls: Any
    result_cls: Any
    arguments: Callable[[Any], tuple[Any, ...]]  # the call's arguments, in IDL order
    # request error type -> (result field that declares it, IDL exception class, metric kind)
    errors: dict[type[RequestError], tuple[str, Any, str]]


@functools.cache
def _method_specs() -> dict[str, _MethodSpec]:
    service = snowflake_thrift().Snowflake
    specs = {}
    for name in service.thrift_services:
        args_cls = getattr(service, f"{name}_args")
        result_cls = getattr(service, f"{name}_result")
        declared = declared_exceptions(name)
        errors = {
            err: (*declared[idl_name], _KINDS[idl_name])
            for err, idl_name in DECLARED_ERRORS.items()
            if idl_name in declared
        }
        arg_names = tuple(spec[1] for _, spec in sorted(args_cls.thrift_spec.items()))
        specs[name] = _MethodSpec(args_cls, result_cls, _getter(arg_names), errors)
    return specs


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if not names:
        return lambda _: ()
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda args: (one(args),)
    return operator.attrgetter(*names)


def service_methods() -> tuple[str, ...]:
    """The names of the service's methods, in IDL order."""
    return tuple(_method_specs())


class Processor:
    """Serves the calls of one connection: a whole request's bytes in, its reply out.

    :meth:`process_message` is the reference path (thriftpy2's decoder, any
    method, any field order); :meth:`get_id_frame` answers the common ``get_id``
    request already matched from its bytes, with exactly the bytes the reference
    path would write. Both count, time and audit each call the same way.
    Undecodable bytes propagate out of :meth:`process_message` (the caller closes
    the connection); ``WouldBlock`` propagates having issued and counted nothing
    (the caller makes the same call again on a thread that may wait).
    """

    def __init__(self, handler: SnowflakeHandler, stats: ConnectionStats) -> None:
        self.handler = handler
        self._stats = stats

        def get_layout() -> Any:
            # Built per call: in cluster mode the worker id can change while serving.
            settings = handler.settings
            return layout_to_thrift(settings.layout, settings.datacenter_id, settings.worker_id)

        own = {"get_layout": get_layout}  # the Thrift struct is the Thrift side's to build
        self._methods = {
            name: (spec, own.get(name) or getattr(handler, name))
            for name, spec in _method_specs().items()
        }
        self._label = handler.label
        self._issue_id = handler.issue_id
        self._get_id_spec = self._methods["get_id"][0]
        # Raw agent bytes -> (label, agent) for agents found valid on this connection:
        # its next calls skip decoding and checking. Bounded as the handler's cache is.
        self._agents: dict[bytes, tuple[str, str]] = {}
        self.restricted = False
        # Told of each agent get_id_frame validates (a native listener serves it from then on).
        self.on_agent: Callable[[bytes, str], object] | None = None

    def allow_only(self, methods: Collection[str]) -> None:
        """Serve only ``methods``: any other call gets ``UnavailableError`` (a
        connection in the reserved slots of a full node: peer checks only)."""

        def full(*_args: object) -> NoReturn:
            raise UnavailableError(
                "this node serves all the connections it may (--max-connections): this "
                "connection may only check the node's ids; try another node"
            )

        self.restricted = True
        self._methods = {
            name: (spec, method if name in methods else full)
            for name, (spec, method) in self._methods.items()
        }

    def process_message(self, message: bytes) -> bytes:
        """The reply to the one whole binary-protocol call in ``message``, unframed.

        Whole, as the scanner has checked it: thriftpy2's Cython decoder reads past the end
        of a truncated message rather than failing (found by the processor's tests)."""
        out: Any = TCyMemoryBuffer()  # thriftpy2 is untyped
        self.process(
            TCyBinaryProtocol(TCyMemoryBuffer(message)),  # type: ignore[no-untyped-call]
            TCyBinaryProtocol(out),  # type: ignore[no-untyped-call]
        )
        return out.getvalue()  # type: ignore[no-any-return]

    def get_id_frame(self, seqid: bytes, agent: bytes) -> bytes:
        """The framed reply to ``get_id(agent)`` called with ``seqid`` (its 4 raw bytes):
        what :meth:`process_message` would write for that request, framed."""
        known = self._agents.get(agent)
        if known is None:
            try:
                useragent: str | bytes = agent.decode()
            except UnicodeDecodeError:
                useragent = agent  # what thriftpy2 hands over for a string that is not UTF-8
        else:
            label, useragent = known
        start = time.perf_counter()
        try:
            if known is None:
                label = self._label(useragent)
                if len(self._agents) < _AGENT_CACHE_SIZE:
                    self._agents[agent] = (label, useragent)  # type: ignore[assignment]  # valid: a str
                if self.on_agent is not None:
                    self.on_agent(agent, label)
            id_ = self._issue_id(label, useragent)
        except WouldBlock:
            raise
        except Exception as e:  # noqa: BLE001 - mapped exactly as the reference path maps it
            spec = self._get_id_spec
            mtype, reply = self._failure("get_id", spec, spec.result_cls(), e)
            self._stats.observe("get_id", time.perf_counter() - start)
            return frame(encode("get_id", mtype, int.from_bytes(seqid, "big", signed=True), reply))
        self._stats.observe("get_id", time.perf_counter() - start)
        return get_id_reply(seqid, id_)

    def process(self, iprot: TProtocolBase, oprot: TProtocolBase) -> None:
        """Read one call from ``iprot`` and write its reply to ``oprot``."""
        name, mtype, seqid = iprot.read_message_begin()
        entry = self._methods.get(name)
        if entry is None or mtype != TMessageType.CALL:
            iprot.skip(TType.STRUCT)
            iprot.read_message_end()
            if entry is None:
                self._stats.count_exception("unknown_method")
                error = TApplicationException(
                    TApplicationException.UNKNOWN_METHOD, f"unknown method {name!r}"
                )
            else:
                self._stats.count_exception("protocol_error", name)
                error = TApplicationException(
                    TApplicationException.INVALID_MESSAGE_TYPE,
                    f"message type {mtype} for {name!r}; only CALL is served",
                )
            _write(oprot, name, TMessageType.EXCEPTION, seqid, error)
            return
        spec, method = entry
        args = spec.args_cls()
        args.read(iprot)
        iprot.read_message_end()

        start = time.perf_counter()
        result = spec.result_cls()
        reply: Any = result
        mtype = TMessageType.REPLY
        try:
            result.success = method(*spec.arguments(args))
        except WouldBlock:
            raise
        except Exception as e:  # noqa: BLE001 - any bug must still reach the client as a reply
            mtype, reply = self._failure(name, spec, result, e)
        # Counted before the reply goes out: a client that scrapes right after its
        # call sees the call counted.
        self._stats.observe(name, time.perf_counter() - start)
        _write(oprot, name, mtype, seqid, reply)

    def _failure(
        self, name: str, spec: _MethodSpec, result: Any, error: Exception
    ) -> tuple[int, Any]:
        """The reply to a call that raised ``error``: its declared exception in
        ``result``, or an application error (INTERNAL_ERROR); counted by kind."""
        if isinstance(error, RequestError):
            # The most specific declared base: ReservationError is an UnavailableError.
            mro = type(error).__mro__
            declared = next((spec.errors[c] for c in mro if c in spec.errors), None)
            if declared is not None:
                field, idl_cls, kind = declared
                setattr(result, field, idl_cls(message=str(error)))
                self._stats.count_exception(kind, name)
                return TMessageType.REPLY, result
        log.exception("internal error in %s", name, exc_info=error)
        self._stats.count_exception("internal_error", name)
        return TMessageType.EXCEPTION, TApplicationException(
            TApplicationException.INTERNAL_ERROR,
            f"internal error in {name}: {type(error).__name__}: {error}",
        )


def encode(name: str, mtype: int, seqid: int, payload: Any) -> bytes:
    """One binary-protocol message, unframed, as thriftpy2 writes it."""
    out: Any = TCyMemoryBuffer()  # thriftpy2 is untyped
    _write(TCyBinaryProtocol(out), name, mtype, seqid, payload)  # type: ignore[no-untyped-call]
    return out.getvalue()  # type: ignore[no-any-return]


def encode_error(kind: int, message: str) -> bytes:
    """An application error not tied to any call (the request could not be read), unframed."""
    return encode("", TMessageType.EXCEPTION, 0, TApplicationException(kind, message))


def frame(message: bytes) -> bytes:
    """``message`` with its framed transport's 4-byte length in front."""
    return len(message).to_bytes(4, "big") + message


def _write(oprot: TProtocolBase, name: str, mtype: int, seqid: int, payload: Any) -> None:
    oprot.write_message_begin(name, mtype, seqid)
    payload.write(oprot)
    oprot.write_message_end()
    oprot.trans.flush()
