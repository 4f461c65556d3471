"""Signals acted on in order, on the process's one signal thread: what a node and the
supervisor both do with SIGTERM, SIGINT and SIGHUP."""

from __future__ import annotations

import logging
import queue
import signal
import threading
from collections.abc import Callable

__all__ = ["on_signal"]

log = logging.getLogger("snowflake_server")

_signalled: queue.SimpleQueue[tuple[Callable[[str], None], str]] = queue.SimpleQueue()
_signal_thread: list[threading.Thread] = []


def on_signal(signum: signal.Signals, action: Callable[[str], None]) -> None:
    """Run ``action(signal name)`` each time ``signum`` arrives, on the process's one
    signal thread (started by the first call), in the order the signals came.

    Never in the handler itself: the handler interrupts the main thread anywhere, maybe
    holding a lock (logging's, the lifecycle's) that the action needs. Nor on a
    thread started by the handler: on a host out of threads that start raised in
    whatever the main thread was running (a client's call) and the SIGTERM was lost."""
    if not _signal_thread:
        thread = threading.Thread(target=_act_on_signals, name="signals", daemon=True)
        thread.start()
        _signal_thread.append(thread)

    def handler(received: int, _frame: object) -> None:
        _signalled.put((action, signal.Signals(received).name))  # reentrant: safe here

    signal.signal(signum, handler)


def _act_on_signals() -> None:
    while True:
        action, name = _signalled.get()
        try:
            action(name)
        except Exception:  # logged: the next signal must still be acted on
            log.exception("acting on %s failed", name)
