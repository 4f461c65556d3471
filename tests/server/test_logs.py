"""The server's log: UTC times, JSON lines with their fields, a file SIGHUP reopens."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from snowflake_server._config.settings import LogSettings
from snowflake_server._errors import ConfigurationError
from snowflake_server._observability.logs import (
    JsonFormatter,
    LogFile,
    LogLimit,
    TextFormatter,
    configure_logging,
)

UTC_TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def record(message: str = "serving on %s", *args: object, **extra: object) -> logging.LogRecord:
    made = logging.getLogger("snowflake_server").makeRecord(
        "snowflake_server", logging.INFO, __file__, 1, message, args or ("127.0.0.1:7609",),
        None, extra=extra or None,
    )  # fmt: skip
    made.created = 1_800_000_000.25  # 2027-01-15T08:00:00.250Z
    return made


def test_text_lines_carry_a_utc_time() -> None:
    line = TextFormatter().format(record())
    assert line == "2027-01-15T08:00:00.250Z INFO snowflake_server: serving on 127.0.0.1:7609"


def test_json_lines_carry_time_level_logger_message_and_the_fields_logged() -> None:
    entry = json.loads(JsonFormatter().format(record(worker_id=3, thrift="127.0.0.1:7609")))
    assert entry == {
        "time": "2027-01-15T08:00:00.250Z",
        "level": "INFO",
        "logger": "snowflake_server",
        "message": "serving on 127.0.0.1:7609",
        "worker_id": 3,
        "thrift": "127.0.0.1:7609",
    }


def test_json_lines_carry_the_exception() -> None:
    try:
        raise ValueError("bad")
    except ValueError:
        made = record("failed %s", "now")
        made.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter().format(made))
    assert entry["message"] == "failed now"
    assert "ValueError: bad" in str(entry["exception"]) and "\n" not in JsonFormatter().format(made)


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, its handlers and level put back after the test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    for handler in root.handlers[:]:
        root.removeHandler(handler)
        if handler not in handlers:
            handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_the_log_file_is_reopened_after_rotation(
    tmp_path: Path, root_logger: logging.Logger
) -> None:
    path = tmp_path / "server.log"
    log_file = configure_logging(LogSettings("info", "json", str(path)))
    assert isinstance(log_file, LogFile) and root_logger.handlers == [log_file]
    logging.getLogger("snowflake_server").info("before")
    logging.getLogger("snowflake_server").debug("below the level")
    path.rename(tmp_path / "server.log.1")  # what logrotate does
    logging.getLogger("snowflake_server").info("still to the old file")
    log_file.reopen()
    logging.getLogger("snowflake_server").info("after")
    rotated = (tmp_path / "server.log.1").read_text().splitlines()
    assert [json.loads(line)["message"] for line in rotated] == ["before", "still to the old file"]
    assert [json.loads(line)["message"] for line in path.read_text().splitlines()] == ["after"]


def test_a_log_file_that_cannot_be_reopened_keeps_the_old_one(
    tmp_path: Path, root_logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "logs"
    directory.mkdir()
    log_file = LogFile(str(directory / "server.log"))
    root_logger.addHandler(log_file)
    (directory / "server.log").rename(tmp_path / "moved.log")
    directory.rmdir()  # nowhere to open the new file
    with caplog.at_level(logging.ERROR):
        log_file.reopen()
    assert "cannot reopen the log file" in caplog.text
    logging.getLogger("snowflake_server").warning("kept")
    assert "kept" in (tmp_path / "moved.log").read_text()


def test_an_unopenable_log_file_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot open the log file"):
        LogFile(str(tmp_path / "missing" / "server.log"))


def test_text_to_standard_error_by_default(
    root_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    assert configure_logging(LogSettings("warning", "text", "")) is None
    logging.getLogger("snowflake_server.x").info("hidden")
    logging.getLogger("snowflake_server.x").warning("shown")
    assert re.fullmatch(f"{UTC_TIME} WARNING snowflake_server.x: shown\n", capsys.readouterr().err)


def test_limited_lines_pass_in_a_burst_then_one_a_second_per_cause_with_a_summary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    limit = LogLimit(burst=3, per_s=1.0, summary_every_s=10.0, clock=lambda: now[0])
    peer = logging.getLogger("snowflake_server._thrift.connection")
    safety = logging.getLogger("snowflake_server._state.reservation")

    def passed(logger: logging.Logger, *args: object) -> bool:
        made = logger.makeRecord(
            logger.name, logging.INFO, "f", 1, "closing connection from %s", args, None
        )
        return limit.filter(made)

    assert [passed(peer, f"10.0.0.{i}") for i in range(5)] == [True] * 3 + [False] * 2
    assert all(passed(safety, "x") for _ in range(50)), "other loggers are never limited"
    now[0] = 10.0
    with caplog.at_level(logging.WARNING, logger="snowflake_server._observability.logs"):
        assert passed(peer, "10.0.0.9")
    assert "suppressed 2 lines like 'closing connection from %s'" in caplog.text
    assert limit.suppressed["snowflake_server._thrift"] == 2
    samples = {s.labels["logger"]: s.value for f in limit.collect() for s in f.samples}
    assert samples["snowflake_server._thrift"] == 2 and samples["asyncio"] == 0


def test_a_cause_is_its_logging_call_not_its_text() -> None:
    # asyncio's exception handler formats its message first (object ids, addresses):
    # every line's text differs, yet one call site is one cause, and the table stays small.
    limit = LogLimit(burst=2, per_s=1.0, clock=lambda: 0.0)
    loop_log = logging.getLogger("asyncio")

    def passed(text: str, line: int) -> bool:
        return limit.filter(
            loop_log.makeRecord("asyncio", logging.ERROR, "f", line, text, (), None)
        )

    assert [passed(f"Exception in callback <Handle at 0x{i:x}>", 1) for i in range(5)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert passed("another call site", 2), "another logging call is another cause"
    try:
        raise ConnectionResetError
    except ConnectionResetError:
        reset = loop_log.makeRecord(
            "asyncio", logging.ERROR, "f", 1, "Exception in callback", (), sys.exc_info()
        )
    assert limit.filter(reset), "another kind of error from the same line is another cause"
    assert limit.suppressed["asyncio"] == 3
