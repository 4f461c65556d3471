"""The audit trail: one JSON line per id issued, written off the id path.

Like the original's audit log (sent to scribe), but to a local file: each line
is ``{"id": "<id as a string>", "useragent": "...", "time": "<ISO-8601 UTC>"}``.
Calls hand their ids to a bounded queue and return at once; a writer thread
appends the lines. When the queue is full (a slow disk) the entries are
dropped and counted, never waited for: id generation must not stall.

With the native listener, its threads queue their ids in C under the same bound
(an ``AuditBudget`` shared with :meth:`AuditLog.record`), and the writer takes
them with :meth:`AuditLog.add_source`'s callable each round: the same lines,
the same drops and counts as on the pure-Python path.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from operator import itemgetter
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._errors import ConfigurationError

if TYPE_CHECKING:
    from .._native._core import AuditBudget

__all__ = ["AuditLog", "NativeEntries"]

log = logging.getLogger(__name__)

_FLUSH_EVERY_S = 0.05

NativeEntries = Callable[[], list[tuple[int, int, int]]]
"""Takes the entries queued natively since its last call: ``(id, time_ms, agent_index)``,
each holding one entry of the shared budget (the writer releases it)."""


class AuditLog(Collector):
    """Appends audit entries to ``path`` from a background thread.

    At most ``max_pending`` entries wait in memory; more are dropped and counted.
    ``budget`` (an ``AuditBudget`` of ``max_pending``) keeps that bound in C instead,
    so that native threads can share it: pass it to the native listener, and the
    listener's entries to :meth:`add_source`.
    """

    def __init__(
        self, path: str, max_pending: int = 100_000, *, budget: AuditBudget | None = None
    ) -> None:
        try:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        except OSError as e:
            raise ConfigurationError(f"--audit-log {path}: {e.strerror}") from None
        self.path = path
        self._file_lock = threading.Lock()  # the file is swapped by reopen()
        self._max_pending = max_pending
        self._queue: collections.deque[tuple[list[int], str, int]] = collections.deque()
        self._lock = threading.Lock()
        self._pending = 0
        self._dropped = 0
        self._budget = budget
        self._sources: list[tuple[NativeEntries, Callable[[int], str]]] = []
        self.written = 0
        self.write_errors = 0
        # Chosen once, so that a call pays for one way of counting and no test of which.
        self.record: Callable[[list[int], str, int], None] = (
            self._record if budget is None else self._record_shared
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="audit-log", daemon=True)

    def start(self) -> None:
        """Start writing in the background."""
        self._thread.start()

    @property
    def budget(self) -> AuditBudget | None:
        """The bound shared with native threads, if this log was given one."""
        return self._budget

    @property
    def dropped(self) -> int:
        """Entries dropped: the queue was full, or their write failed."""
        return self._dropped if self._budget is None else self._budget.dropped

    @property
    def pending(self) -> int:
        """Entries waiting in memory (native ones included)."""
        return self._pending if self._budget is None else self._budget.pending

    def add_source(self, take: NativeEntries, agent_of: Callable[[int], str]) -> None:
        """Write, each round and at :meth:`close`, the entries ``take`` returns, each
        with ``agent_of(agent_index)`` as its user agent (the agent, as :meth:`record`
        would have been given it). Needs ``budget``: each entry holds one of its places,
        released once written (or dropped and counted if the write fails)."""
        if self._budget is None:
            raise ValueError("native entries need the shared budget (AuditLog(budget=...))")
        with self._lock:
            self._sources.append((take, agent_of))

    def _record(self, ids: list[int], agent: str, time_ms: int) -> None:
        """Queue entries for ``ids``; never blocks. Drops them if the queue is full."""
        n = len(ids)
        with self._lock:
            if self._pending + n > self._max_pending:
                self._dropped += n
                return
            self._pending += n
        self._queue.append((ids, agent, time_ms))

    def _record_shared(self, ids: list[int], agent: str, time_ms: int) -> None:
        """:meth:`_record` under the shared budget (it counts what it refuses)."""
        assert self._budget is not None
        if self._budget.reserve(len(ids)):
            self._queue.append((ids, agent, time_ms))

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(_FLUSH_EVERY_S)
            self._write_all()
            if stopping:
                return

    def _write_all(self) -> None:
        lines: list[str] = []
        taken = 0
        sources = self._sources
        keyed: list[tuple[int, str]] = []  # with native sources: each line by its id
        while self._queue:
            ids, agent, time_ms = self._queue.popleft()
            stamp = _stamp(time_ms)
            if sources:
                keyed.extend((i, _line(i, agent, stamp)) for i in ids)
            else:
                lines.extend(_line(i, agent, stamp) for i in ids)
            taken += len(ids)
        for take, agent_of in sources:
            taken += self._take_native(take, agent_of, keyed)
        if not taken:
            return
        if sources:
            # Python's and each native thread's entries come in separate queues: in id
            # order, the round's lines read as one server's (ids rise with time).
            keyed.sort(key=itemgetter(0))
            lines = [line for _, line in keyed]
        try:
            with self._file_lock:
                self._file.writelines(lines)
                self._file.flush()
            self.written += taken
        except OSError as e:
            self.write_errors += 1
            log.error("cannot write the audit log %s: %s", self.path, e)
            self._count_dropped(taken)
        self._release(taken)

    def _take_native(
        self, take: NativeEntries, agent_of: Callable[[int], str], lines: list[tuple[int, str]]
    ) -> int:
        """Adds the lines of ``take``'s entries, each with its id, to ``lines``; returns
        how many it took."""
        # The writer must go on for every other entry: a source that fails (a listener
        # gone, an agent it cannot name) loses only its own, counted as dropped.
        try:
            entries = take()
        except Exception:
            log.exception("cannot take the native audit entries")
            return 0
        agents: dict[int, str] = {}
        last_ms, stamp = -1, ""
        mine: list[tuple[int, str]] = []
        try:
            for id_, time_ms, index in entries:
                agent = agents.get(index)
                if agent is None:
                    agent = agents[index] = agent_of(index)
                if time_ms != last_ms:  # native ids come by the thousand per ms
                    last_ms, stamp = time_ms, _stamp(time_ms)
                mine.append((id_, _line(id_, agent, stamp)))
        except Exception:
            log.exception("cannot write %d native audit entries", len(entries))
            self._count_dropped(len(entries))
            self._release(len(entries))
            return 0
        lines.extend(mine)
        return len(entries)

    def _count_dropped(self, n: int) -> None:
        if self._budget is not None:
            self._budget.drop(n)
            return
        with self._lock:
            self._dropped += n

    def _release(self, n: int) -> None:
        if self._budget is not None:
            self._budget.release(n)
            return
        with self._lock:
            self._pending -= n

    def reopen(self) -> bool:
        """Write to a fresh open of the path from now on (log rotation moved the old
        file away). If it cannot be opened, keep the old file, log why, return False."""
        try:
            new = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        except OSError as e:
            log.error("cannot reopen the audit log %s: %s; still writing the old one", self.path, e)
            return False
        with self._file_lock:
            if self._file.closed:  # closed meanwhile: the server is stopping
                new.close()
                return False
            old, self._file = self._file, new
        old.close()
        return True

    def close(self) -> None:
        """Write what is queued, then close the file."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        else:
            self._write_all()
        with self._file_lock:
            try:
                self._file.close()
            except OSError as e:
                # A failed write's lines stay in the file's buffer and fail again here;
                # they were counted as dropped then, and a stop must not fail for them.
                log.error("cannot close the audit log %s: %s", self.path, e)

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(
            "snowflake_audit_entries_written", "Audit log entries written.", value=self.written
        )
        yield CounterMetricFamily(
            "snowflake_audit_entries_dropped",
            "Audit log entries dropped because the queue was full or the write failed.",
            value=self.dropped,
        )
        yield GaugeMetricFamily(
            "snowflake_audit_queue_entries", "Audit log entries waiting to be written.",
            value=self.pending,
        )  # fmt: skip


def _stamp(time_ms: int) -> str:
    moment = datetime.fromtimestamp(time_ms / 1000, tz=UTC).isoformat(timespec="milliseconds")
    return moment.replace("+00:00", "Z")


def _line(id_: int, agent: str, stamp: str) -> str:
    # Agents are letters, digits and '-': nothing to escape in JSON.
    return f'{{"id": "{id_}", "useragent": "{agent}", "time": "{stamp}"}}\n'
