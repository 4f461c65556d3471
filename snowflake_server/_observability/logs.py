"""The server's log: text or JSON lines, times in UTC, to standard error or a file
that SIGHUP reopens.

Both formats stamp each line with an ISO-8601 time in UTC (``...Z``), so logs
of nodes in different zones sort together. ``json`` writes one object per
line: ``time``, ``level``, ``logger``, ``message``, the fields the event was
logged with (``extra=``), and ``exception`` when there is one. The standard
library's handlers cover everything but reopening on request (WatchedFileHandler
polls the file on every line instead), which is :class:`LogFile`'s one job.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TextIO

from .._config.settings import LogSettings
from .._errors import ConfigurationError

__all__ = ["JsonFormatter", "LogFile", "TextFormatter", "configure_logging"]

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
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        if isinstance(old, LogFile):
            old.close()
    root.addHandler(handler)
    root.setLevel(settings.level.upper())
    return log_file
