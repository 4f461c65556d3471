"""A forked child that reports back: what the native core does in a process forked from one
that used it (its states and listeners refuse to serve there)."""

from __future__ import annotations

import json
import os
import select
import signal
from collections.abc import Callable

__all__ = ["in_a_child"]

CHILD_REPORTS_S = 10.0


def in_a_child(run: Callable[[], dict[str, object]]) -> dict[str, object]:
    """What ``run()`` returns in a forked child (a JSON report over a pipe), bounded in
    time; the child never returns into pytest."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        code = 0
        try:
            os.close(read_end)
            os.write(write_end, json.dumps(run()).encode())
        except BaseException:  # noqa: BLE001 - any failure is the child's exit code
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], CHILD_REPORTS_S)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        report = b""
        while ready and (chunk := os.read(read_end, 65536)):
            report += chunk
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    assert ready, "the child hung"
    assert os.waitstatus_to_exitcode(status) == 0
    result: dict[str, object] = json.loads(report)
    return result
