"""The server's log: text or JSON lines, times in UTC, to standard error or a file
that SIGHUP reopens.

Both formats stamp each line with an ISO-8601 time in UTC (``...Z``), so logs
of nodes in different zones sort together. ``json`` writes one object per
line: ``time``, ``level``, ``logger``, ``message``, the fields the event was
logged with (``extra=``), and ``exception`` when there is one. The standard
library's handlers cover everything but reopening on request (WatchedFileHandler
polls the file on every line instead), which is :class:`LogFile`'s one job.

Lines that a client can cause (one per connection or request: the Thrift, HTTP and
admin endpoints, asyncio's accept errors) are rate limited per cause, the logging
call (logger and message template, so every peer counts as one cause): 10 lines at
once, then 1 a second. The rest are counted (``snowflake_log_lines_suppressed_total``)
and summarised in one line per cause at most every 10 s, so a flood of garbage
connections cannot fill the disk the state directory may share. Everything else, the
safety messages among it (clock, high-water marks, ZooKeeper, start-up), is never
limited.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TextIO

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from .._config.settings import LogSettings
from .._errors import ConfigurationError

__all__ = [
    "LIMITED_LOGGERS",
    "LOG_LIMIT",
    "JsonFormatter",
    "LogFile",
    "LogLimit",
    "TextFormatter",
    "configure_logging",
]

LIMITED_LOGGERS = (
    "snowflake_server._serving",
    "snowflake_server._thrift",
    "snowflake_server._http",
    "asyncio",
)
"""The loggers (and their children) whose lines are rate limited: those a client's
connections and requests can make it write."""

# Attributes every LogRecord has: anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}


def _utc(record: logging.LogRecord) -> str:
    return (
        datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")[:-6] + "Z"
    )


class TextFormatter(logging.Formatter):
    """``2026-11-23T15:05:01.123Z INFO snowflake_server: message``."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return f"{_utc(record)} {super().format(record)}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _utc(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        return json.dumps(entry, default=str)


class LogFile(logging.StreamHandler[TextIO]):
    """Appends to ``path``; :meth:`reopen` starts a new file of that name (after log
    rotation moved the old one away). Raises ``ConfigurationError`` if it cannot open."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            stream = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held until close()
        except OSError as e:
            raise ConfigurationError(f"cannot open the log file {path}: {e.strerror}") from None
        super().__init__(stream)

    def reopen(self) -> None:
        """Switch to a fresh open of ``path``; if that fails, keep the old file and say why."""
        try:
            stream = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held until close()
        except OSError as e:
            logging.getLogger(__name__).error(
                "cannot reopen the log file %s: %s; still writing the old one", self.path, e
            )
            return
        old = self.setStream(stream)
        if old is not None:
            old.close()

    def close(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # always set by Handler.__init__
            self.stream.close()
        super().close()


_TEMPLATE_CHARS = 200


class _Cause:
    __slots__ = ("since", "stamp", "suppressed", "template", "tokens")

    def __init__(self, tokens: float, now: float, template: str) -> None:
        self.template = template  # the first line's, for the summary
        self.tokens = tokens
        self.stamp = now  # when the tokens were counted
        self.suppressed = 0  # since the last summary
        self.since = now  # the last summary, or the first line


class LogLimit(logging.Filter, Collector):
    """A handler filter: per cause (the logging call: logger, file and line) of the limited
    loggers, ``burst`` lines at once, then ``per_s`` a second; the rest are dropped,
    counted by logger, and summarised in a WARNING at most every ``summary_every_s``
    (written before the next line of that cause that gets through). ``clock`` is
    monotonic seconds. As a collector it exports the count.
    """

    def __init__(
        self,
        *,
        burst: int = 10,
        per_s: float = 1.0,
        summary_every_s: float = 10.0,
        loggers: Iterable[str] = LIMITED_LOGGERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._burst = burst
        self._per_s = per_s
        self._summary_every_s = summary_every_s
        self._loggers = tuple(loggers)
        self._clock = clock
        self._lock = threading.Lock()
        self._causes: dict[tuple[str, str, int, int, str], _Cause] = {}
        self.suppressed = dict.fromkeys(self._loggers, 0)  # by limited logger, since the start

    def _limited(self, name: str) -> str | None:
        for limited in self._loggers:
            if name == limited or name.startswith(limited + "."):
                return limited
        return None

    def filter(self, record: logging.LogRecord) -> bool:
        limited = self._limited(record.name)
        if limited is None:
            return True
        # The call site, not the message: a message formatted before logging (asyncio's
        # handler puts object ids and addresses in it) would make every line a new cause,
        # never limited, and the table would grow with every client.
        # Level and exception type too: asyncio logs every error from one line, and a
        # flood of one kind must not hide an unrelated traceback.
        error = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        key = (record.name, record.pathname, record.lineno, record.levelno, error)
        now = self._clock()
        with self._lock:
            cause = self._causes.get(key)
            if cause is None:
                template = str(record.msg)[:_TEMPLATE_CHARS]
                cause = self._causes[key] = _Cause(self._burst, now, template)
            cause.tokens = min(self._burst, cause.tokens + (now - cause.stamp) * self._per_s)
            cause.stamp = now
            if cause.tokens < 1:
                cause.suppressed += 1
                self.suppressed[limited] += 1
                return False
            cause.tokens -= 1
            summary = None
            if cause.suppressed and now - cause.since >= self._summary_every_s:
                summary = (cause.suppressed, now - cause.since, cause.template)
                cause.suppressed, cause.since = 0, now
        if summary is not None:
            # Through the same handlers: this module's logger is not limited.
            logging.getLogger(__name__).warning(
                "suppressed %d lines like %r from %s in the last %.0f s",
                summary[0], summary[2], key[0], summary[1],
            )  # fmt: skip
        return True

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "snowflake_log_lines_suppressed",
            "Log lines not written, by logger (and its children): past the rate limit of "
            "their cause (10 at once, then 1 a second); each cause's count is summarised in "
            "the log every 10 s.",
            labels=["logger"],
        )
        with self._lock:
            counts = sorted(self.suppressed.items())
        for name, count in counts:
            family.add_metric([name], count)
        yield family


LOG_LIMIT = LogLimit()
"""The process's limiter: on the handler :func:`configure_logging` installs."""


def configure_logging(settings: LogSettings) -> LogFile | None:
    """Send the root logger's records where ``settings`` say, as they say; return the
    log file, if any, for SIGHUP to reopen."""
    handler: logging.Handler
    log_file = None
    if settings.file:
        handler = log_file = LogFile(settings.file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.format == "json" else TextFormatter())
    handler.addFilter(LOG_LIMIT)
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        if isinstance(old, LogFile):
            old.close()
    root.addHandler(handler)
    root.setLevel(settings.level.upper())
    return log_file
