"""The Thrift face of the generator: the service's methods, and the dispatch
that turns every outcome into a reply.

Each connection gets its own :class:`Processor` and :class:`SnowflakeHandler`,
so per-call counting needs no lock. Errors the client can act on are the IDL's
declared exceptions; anything unexpected becomes a Thrift application error
(INTERNAL_ERROR) on a connection that stays usable, never a dropped connection.
"""

from __future__ import annotations

import functools
import logging
import operator
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

from .._errors import InvalidUserAgentError, RequestError, WouldBlock
from .._ids.generator import GeneratorSettings, IdSource
from .._observability.audit import AuditLog
from .._observability.metrics import ConnectionStats, ServiceMetrics
from .fastpath import get_id_reply

__all__ = [
    "MAX_USER_AGENT_LENGTH",
    "Processor",
    "SnowflakeHandler",
    "check_user_agent",
    "encode_error",
    "frame",
    "service_methods",
]

log = logging.getLogger(__name__)

MAX_USER_AGENT_LENGTH = 128
_USER_AGENT = re.compile(r"[a-zA-Z][a-zA-Z\-0-9]*")
_AGENT_CACHE_SIZE = 64  # per connection; a client cycling agents gets no cache, not more memory

# The metric kind of each IDL exception a call can end with.
_KINDS = {
    "InvalidSystemClock": "invalid_system_clock",
    "InvalidUserAgentError": "invalid_user_agent",
    "InvalidCountError": "invalid_count",
    "UnavailableError": "unavailable",
}


def check_user_agent(agent: object) -> str:
    """``agent`` if it is a letter followed by letters, digits and dashes (Twitter's
    rule), at most ``MAX_USER_AGENT_LENGTH`` long; else ``InvalidUserAgentError``."""
    if agent is None:
        raise InvalidUserAgentError("user agent missing (field 1 must be a string)")
    if isinstance(agent, bytes):
        raise InvalidUserAgentError("user agent is not valid UTF-8")
    if not isinstance(agent, str):
        raise InvalidUserAgentError(
            "user agent must be a string matching [a-zA-Z][a-zA-Z\\-0-9]*, "
            f"got {type(agent).__name__}"
        )
    if len(agent) > MAX_USER_AGENT_LENGTH or not _USER_AGENT.fullmatch(agent):
        shown = agent if len(agent) <= 40 else agent[:40] + "..."
        raise InvalidUserAgentError(
            f"invalid user agent {shown!r} ({len(agent)} chars): it must be a letter followed "
            f"by letters, digits or '-', at most {MAX_USER_AGENT_LENGTH} characters"
        )
    return agent


class SnowflakeHandler:
    """The service's methods for one connection; ids are counted per agent into ``stats``."""

    def __init__(
        self,
        generator: IdSource,
        metrics: ServiceMetrics,
        stats: ConnectionStats,
        clock: Callable[[], int],
        audit: AuditLog | None = None,
    ) -> None:
        self._generator = generator
        self._metrics = metrics
        self._stats = stats
        self._clock = clock
        self._audit = audit
        self._labels: dict[str, str] = {}

    def label(self, agent: object) -> str:
        """The metrics label of ``agent``; ``InvalidUserAgentError`` if it is not valid."""
        label = self._labels.get(agent) if isinstance(agent, str) else None
        if label is None:
            label = self._metrics.agent_label(check_user_agent(agent))
            if len(self._labels) < _AGENT_CACHE_SIZE:
                self._labels[agent] = label  # type: ignore[index]  # checked: a str
        return label

    @property
    def settings(self) -> GeneratorSettings:
        """The ids' settings now (in cluster mode the worker id can change while serving)."""
        return self._generator.settings

    def get_worker_id(self) -> int:
        return self._generator.settings.worker_id

    def get_datacenter_id(self) -> int:
        return self._generator.settings.datacenter_id

    def get_timestamp(self) -> int:
        return self._clock()

    def get_id(self, useragent: object) -> int:
        return self.issue_id(self.label(useragent), useragent)

    def issue_id(self, label: str, useragent: object) -> int:
        """``get_id`` for an agent already checked and labelled by :meth:`label`."""
        id_ = self._generator.next_id()
        self._stats.count_ids(label, 1)
        if self._audit is not None:
            self._audit.record([id_], useragent, self._clock())  # type: ignore[arg-type]
        return id_

    def get_ids(self, useragent: object, count: object) -> list[int]:
        label = self.label(useragent)
        ids = self._generator.next_ids(count)  # type: ignore[arg-type]  # it checks
        self._stats.count_ids(label, len(ids))
        if self._audit is not None:
            self._audit.record(ids, useragent, self._clock())  # type: ignore[arg-type]
        return ids

    def get_layout(self) -> Any:
        # Built per call: in cluster mode the worker id can change while serving.
        settings = self._generator.settings
        return layout_to_thrift(settings.layout, settings.datacenter_id, settings.worker_id)


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
        self._methods = {
            name: (spec, getattr(handler, name)) for name, spec in _method_specs().items()
        }
        self._label = handler.label
        self._issue_id = handler.issue_id
        self._get_id_spec = self._methods["get_id"][0]
        # Raw agent bytes -> (label, agent) for agents found valid on this connection:
        # its next calls skip decoding and checking. Bounded as the handler's cache is.
        self._agents: dict[bytes, tuple[str, str]] = {}

    def process_message(self, message: bytes) -> bytes:
        """The reply to the one whole binary-protocol call in ``message``, unframed."""
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
