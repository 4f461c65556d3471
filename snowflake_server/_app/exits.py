"""The process's exit codes: what each one tells a supervisor (systemd, Kubernetes).

One table, mirrored in ``docs/operations.md#exit-codes`` (a docs test checks it) and
in the systemd unit's ``RestartPreventExitStatus``: a code that means "an operator
must act" must not be restarted in a loop, a code that means "try again" must be.
"""

from __future__ import annotations

import enum

__all__ = ["ExitCode"]


class ExitCode(enum.IntEnum):
    """Why ``snowflake-server`` ended."""

    STOPPED = 0
    """Stopped by SIGTERM or SIGINT (while serving or while starting)."""
    FAILED = 1
    """An unexpected error (a bug): the traceback is logged; restarting may help."""
    CONFIGURATION = 2
    """A bad setting, a port in use, an unusable state directory, a file-descriptor
    limit too low: the operator must fix the configuration; restarting cannot help."""
    UNSAFE = 3
    """Starting could hand out ids already issued (clock far behind a mark, an unusable
    state file, the worker id held by another process on this host, another layout):
    the operator must act; restarting in a loop cannot help."""
    TRY_AGAIN = 75
    """``EX_TEMPFAIL``: starting cannot complete now but nothing is unsafe (a peer that
    cannot be checked yet, ZooKeeper failing mid-start): try again after a delay."""
