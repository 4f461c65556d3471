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
from thriftpy2.protocol.base import TProtocolBase
from thriftpy2.thrift import TApplicationException, TMessageType, TType

from .._errors import InvalidUserAgentError, RequestError
from .._ids.generator import IdSource
from .._observability.audit import AuditLog
from .._observability.metrics import ConnectionStats, ServiceMetrics

__all__ = [
    "MAX_USER_AGENT_LENGTH",
    "Processor",
    "SnowflakeHandler",
    "check_user_agent",
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

    def _label(self, agent: object) -> str:
        label = self._labels.get(agent) if isinstance(agent, str) else None
        if label is None:
            label = self._metrics.agent_label(check_user_agent(agent))
            if len(self._labels) < _AGENT_CACHE_SIZE:
                self._labels[agent] = label  # type: ignore[index]  # checked: a str
        return label

    def get_worker_id(self) -> int:
        return self._generator.settings.worker_id

    def get_datacenter_id(self) -> int:
        return self._generator.settings.datacenter_id

    def get_timestamp(self) -> int:
        return self._clock()

    def get_id(self, useragent: object) -> int:
        label = self._label(useragent)
        id_ = self._generator.next_id()
        self._stats.count_ids(label, 1)
        if self._audit is not None:
            self._audit.record([id_], useragent, self._clock())  # type: ignore[arg-type]
        return id_

    def get_ids(self, useragent: object, count: object) -> list[int]:
        label = self._label(useragent)
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
    """Reads one call at a time from a connection and writes its reply.

    Transport errors (the peer went away, a timeout) and undecodable bytes
    propagate out of :meth:`process`: the connection can no longer be trusted
    and the caller closes it.
    """

    def __init__(self, handler: SnowflakeHandler, stats: ConnectionStats) -> None:
        self._stats = stats
        self._methods = {
            name: (spec, getattr(handler, name)) for name, spec in _method_specs().items()
        }

    def process(self, iprot: TProtocolBase, oprot: TProtocolBase) -> None:
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
                self._stats.count_exception("protocol_error")
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
        except RequestError as e:
            # The most specific declared base: ReservationError is an UnavailableError.
            declared = next((spec.errors[c] for c in type(e).__mro__ if c in spec.errors), None)
            if declared is None:
                reply, mtype = self._internal_error(name, e), TMessageType.EXCEPTION
            else:
                field, idl_cls, kind = declared
                setattr(result, field, idl_cls(message=str(e)))
                self._stats.count_exception(kind)
        except Exception as e:  # noqa: BLE001 - any bug must still reach the client as a reply
            reply, mtype = self._internal_error(name, e), TMessageType.EXCEPTION
        # Counted before the reply goes out: a client that scrapes right after its
        # call sees the call counted.
        self._stats.observe(name, time.perf_counter() - start)
        _write(oprot, name, mtype, seqid, reply)

    def _internal_error(self, name: str, error: Exception) -> TApplicationException:
        log.exception("internal error in %s", name, exc_info=error)
        self._stats.count_exception("internal_error")
        return TApplicationException(
            TApplicationException.INTERNAL_ERROR,
            f"internal error in {name}: {type(error).__name__}: {error}",
        )


def _write(oprot: TProtocolBase, name: str, mtype: int, seqid: int, payload: Any) -> None:
    oprot.write_message_begin(name, mtype, seqid)
    payload.write(oprot)
    oprot.write_message_end()
    oprot.trans.flush()
