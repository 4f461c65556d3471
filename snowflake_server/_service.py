"""The service, whatever the protocol: ids issued, counted per agent, audited.

Both protocols call one :class:`SnowflakeHandler` per connection (so per-call
counting needs no lock): the Thrift processor decodes a call and the HTTP API a
route onto the same methods, the same user-agent rule and the same counters.
Errors a client can act on are the ``RequestError`` subclasses each protocol
renders (the IDL's declared exceptions; HTTP 400/503).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ._errors import InvalidUserAgentError
from ._ids.generator import GeneratorSettings, IdSource
from ._observability.audit import AuditLog
from ._observability.metrics import ConnectionStats, ServiceMetrics

__all__ = ["MAX_USER_AGENT_LENGTH", "SnowflakeHandler", "check_user_agent"]

MAX_USER_AGENT_LENGTH = 128
_USER_AGENT = re.compile(r"[a-zA-Z][a-zA-Z\-0-9]*")
_AGENT_CACHE_SIZE = 64  # per connection; a client cycling agents gets no cache, not more memory


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
