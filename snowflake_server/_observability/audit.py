"""The audit trail: one JSON line per id issued, written off the id path.

Like the original's audit log (sent to scribe), but to a local file: each line
is ``{"id": "<id as a string>", "useragent": "...", "time": "<ISO-8601 UTC>"}``.
Calls hand their ids to a bounded queue and return at once; a writer thread
appends the lines. When the queue is full (a slow disk) the entries are
dropped and counted, never waited for: id generation must not stall.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable
from datetime import UTC, datetime

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._errors import ConfigurationError

__all__ = ["AuditLog"]

log = logging.getLogger(__name__)

_FLUSH_EVERY_S = 0.05


class AuditLog(Collector):
    """Appends audit entries to ``path`` from a background thread.

    At most ``max_pending`` entries wait in memory; more are dropped and counted.
    """

    def __init__(self, path: str, max_pending: int = 100_000) -> None:
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
        self.written = 0
        self.dropped = 0
        self.write_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="audit-log", daemon=True)

    def start(self) -> None:
        """Start writing in the background."""
        self._thread.start()

    def record(self, ids: list[int], agent: str, time_ms: int) -> None:
        """Queue entries for ``ids``; never blocks. Drops them if the queue is full."""
        n = len(ids)
        with self._lock:
            if self._pending + n > self._max_pending:
                self.dropped += n
                return
            self._pending += n
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
        while self._queue:
            ids, agent, time_ms = self._queue.popleft()
            moment = datetime.fromtimestamp(time_ms / 1000, tz=UTC).isoformat(
                timespec="milliseconds"
            )
            stamp = moment.replace("+00:00", "Z")
            # Agents are letters, digits and '-': nothing to escape in JSON.
            lines.extend(
                f'{{"id": "{i}", "useragent": "{agent}", "time": "{stamp}"}}\n' for i in ids
            )
            taken += len(ids)
        if not taken:
            return
        try:
            with self._file_lock:
                self._file.writelines(lines)
                self._file.flush()
            self.written += taken
        except OSError as e:
            self.write_errors += 1
            log.error("cannot write the audit log %s: %s", self.path, e)
            with self._lock:
                self.dropped += taken
        with self._lock:
            self._pending -= taken

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
            self._file.close()

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
            value=self._pending,
        )  # fmt: skip
