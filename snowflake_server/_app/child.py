"""One server process run by the supervisor (``--processes``), seen from both sides.

The supervisor's side: :class:`Child` starts the process with flags that give it
exactly its settings (:func:`child_argv`), reads its ready line, asks its admin
endpoint (:func:`poll_children`, each request with an absolute deadline), and
stops, kills and reaps it without ever waiting for a process that cannot die (one in
uninterruptible sleep). :func:`start_limit_s` says how long a start may take, and
:func:`start_failure` how the supervisor exits for a process that did not start.

The process's side: :func:`die_with_supervisor` (the kernel's SIGTERM when the
supervisor dies) and :func:`origin_from_supervisor` (where its worker id came from).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import http.client
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .._cluster.peers import refused_retry_s
from .._config.options import OPTIONS, worker_id_text
from .._config.settings import ServerSettings
from .._errors import ConfigurationError, StartupDeferred, StartupInterrupted, StartupRefused
from .exits import ExitCode
from .node_id import WorkerIdOrigin
from .notify import NOTIFY_SOCKET_ENV
from .ready import parse_ready_line

__all__ = [
    "FIRST_DELAY_S",
    "KILL_WAIT_S",
    "NO_ANSWER",
    "POLL_TIMEOUT_S",
    "STOPPED_STATES",
    "SUPERVISOR_PID_ENV",
    "TERM_GRACE_S",
    "WORKER_ID_ORIGIN_ENV",
    "Answer",
    "Child",
    "child_argv",
    "die_with_supervisor",
    "fetch",
    "origin_from_supervisor",
    "poll_children",
    "process_state",
    "start_failure",
    "start_limit_s",
]

log = logging.getLogger(__name__)

FIRST_DELAY_S = 0.5
"""A child's first restart waits this long; the supervisor doubles it from there."""

_START_MARGIN_S = 30.0
"""Beyond a child's own start-up waits: starting Python, ZooKeeper calls (each bounded
by the child), a held worker id's retries."""


TERM_GRACE_S = 10.0
"""A child that did not start in time has this long to stop on SIGTERM (it ends any
start-up wait within about 2 s, then deregisters) before SIGKILL."""


POLL_TIMEOUT_S = 1.0  # a child's answer is due within this, or counts as none


KILL_WAIT_S = 0.5
"""How long a round waits for a child it has just killed to exit; one that has not (in
uninterruptible sleep: a hung fsync) is looked at again each round, never waited for."""


NO_ANSWER = 0
"""The status of a request a child did not answer in HTTP (a timeout, a refused or
closed connection, a garbage answer)."""


STOPPED_STATES = frozenset("Tt")  # /proc/<pid>/stat: stopped by a signal, or by a tracer


# A child that did not start, by its exit code: what the supervisor raises (and so how
# it exits). Anything else (1: a bug; killed by a signal) is "try again", not "starting
# could repeat ids": nothing says it could.
# An exit 0 is a stop only when the supervisor was asked to stop (see start_failure).
_EXITED_AS: dict[int, type[Exception]] = {
    ExitCode.CONFIGURATION: ConfigurationError,
    ExitCode.UNSAFE: StartupRefused,
    ExitCode.TRY_AGAIN: StartupDeferred,
}


SUPERVISOR_PID_ENV = "SNOWFLAKE_SUPERVISOR_PID"
"""Set by the supervisor for its children: the pid they must not outlive."""


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


WORKER_ID_ORIGIN_ENV = "SNOWFLAKE_SUPERVISOR_WORKER_ID_ORIGIN"
"""Set by the supervisor for its children: where their worker ids came from, as JSON
(their flags carry only the ids)."""


def start_limit_s(settings: ServerSettings) -> float | None:
    """How long a process with ``settings`` may take to start before the supervisor
    stops it: the longest its own start-up waits add up to (the first-start wait, the
    clock wait, and in cluster mode ZooKeeper's connect timeout and the peers' check
    bound), and a margin. None (no limit) with an unbounded ``--max-startup-wait``: the
    operator asked it to wait for its clock as long as that takes."""
    if not math.isfinite(settings.max_startup_wait):
        return None
    limit = settings.first_start_window + settings.max_startup_wait + _START_MARGIN_S
    if settings.zookeeper:
        limit += settings.zk_connect_timeout + refused_retry_s(settings.cluster)
    return limit


def start_failure(
    code: int | None, *, timed_out: bool = False, stopping: bool = False
) -> type[Exception]:
    """What the supervisor raises (so how it exits) for a process that did not start:
    as the process exited if that was a considered answer (2 configuration, 3 unsafe,
    75 try again; 0 stopped, if the supervisor is ``stopping`` too); "try again" for a
    bug, a kill, no start in time, or an exit 0 the supervisor did not ask for (a stray
    SIGTERM to the process: exiting 0 would leave systemd's Restart=on-failure idle)."""
    if timed_out or code is None:
        return StartupDeferred
    if code in (ExitCode.STOPPED, -signal.SIGTERM):
        # -SIGTERM: ours, before the process could act on it (it had just started).
        return StartupInterrupted if stopping else StartupDeferred
    return _EXITED_AS.get(code, StartupDeferred)


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (R, S, D, T, t, Z...), or "" if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # The name in parentheses may hold spaces and parentheses: the state follows the last.
    return stat.rsplit(")", 1)[1].split()[0]


def die_with_supervisor(environ: Mapping[str, str]) -> None:
    """In a child of the supervisor: have the kernel send SIGTERM when the supervisor
    dies, even by SIGKILL, so that no child serves on (holding its worker id and lock)
    unsupervised; SIGTERM is the clean stop, with the exact final marks written.

    Raises ``StartupRefused`` if the supervisor died before this call took effect.
    A process not started by the supervisor is left alone.
    """
    parent = environ.get(SUPERVISOR_PID_ENV)
    if not parent:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise StartupRefused(f"prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")
    if os.getppid() != int(parent):  # it died before the kernel knew to tell us
        raise StartupRefused(f"the supervisor (pid {parent}) is gone; not starting")


def origin_from_supervisor(environ: Mapping[str, str]) -> WorkerIdOrigin | None:
    """In a child of the supervisor: where its worker id came from, as the supervisor
    read it from the machine (the child's own flags give only the number). None in a
    process not started by the supervisor."""
    given = environ.get(WORKER_ID_ORIGIN_ENV)
    if not given or not environ.get(SUPERVISOR_PID_ENV):
        return None
    origin = json.loads(given)
    return WorkerIdOrigin(str(origin["source"]), str(origin["detail"]))


def child_argv(settings: ServerSettings) -> list[str]:
    """Flags that give a child exactly ``settings`` (flags beat environment and file)."""
    argv: list[str] = []
    for option in OPTIONS:
        value = getattr(settings, option.name)
        if option.is_switch:
            if value:
                argv.append(option.flag)
        elif value != "" and value is not None:  # None: derived, as the child will too
            argv += [
                option.flag,
                worker_id_text(value) if option.name == "worker_id" else str(value),
            ]
    return argv


Answer = tuple[int, str, float]
"""A child's answer to a request: status (``NO_ANSWER``: none), body, and the
supervisor's clock when it was had."""


class Child:
    """One child process, as the supervision loop sees it: starting (no admin address
    yet), serving, or down and due to start again at ``restart_at``."""

    def __init__(self, index: int, settings: ServerSettings, origin: WorkerIdOrigin) -> None:
        self.index = index
        self.settings = settings
        self.origin = origin
        self.start_limit = start_limit_s(settings)
        self.process: subprocess.Popen[str] | None = None
        self.metrics = ""  # host:port of its admin endpoint, once it printed its ready line
        # Its answers of the latest round, by path; replaced whole (read on another thread).
        self.answers: dict[str, Answer] = {}
        self.scraped: Answer | None = None  # its /metrics, as the metrics thread last had it
        self.restarts = 0
        self.started_at = 0.0  # the supervisor's clock
        self.terminated_at: float | None = None  # SIGTERM sent: it did not start in time
        self.serving_since: float | None = None
        self.failed_polls = 0
        self.failing_since: float | None = None
        self.restart_at: float | None = None
        self.killed_at: float | None = None  # SIGKILL sent; it has not exited yet
        self.killed_delay = 0.0  # its restart's delay, counted once it has exited
        self.delay_s = FIRST_DELAY_S  # of its next restart: doubled by the supervisor
        # The request still running for each path (at most one: see poll_children).
        self.asking: dict[str, concurrent.futures.Future[tuple[int, str]]] = {}
        self.why_down = ""
        self._spawned = 0.0  # time.monotonic(): the start limit of the first start
        self._reader: threading.Thread | None = None

    def spawn(self, now: float = 0.0) -> None:
        """Start the process; its ready line is read by a thread of its own (so that the
        supervision of the others goes on meanwhile). Raises ``OSError`` if it cannot
        be started (out of memory or processes), ``RuntimeError`` while its previous
        process has not been reaped (two of one worker id must never run: and the old
        one would be lost to ``_stop_children``)."""
        if self.process is not None:
            raise RuntimeError(
                f"process {self.index} (pid {self.process.pid}) has not been reaped yet"
            )
        command = [sys.executable, "-m", "snowflake_server", *child_argv(self.settings)]
        # The child asks the kernel to end it with us (see die_with_supervisor); only
        # the supervisor talks to systemd.
        env = {k: v for k, v in os.environ.items() if k != NOTIFY_SOCKET_ENV}
        env[SUPERVISOR_PID_ENV] = str(os.getpid())
        env[WORKER_ID_ORIGIN_ENV] = json.dumps(
            {"source": self.origin.source, "detail": self.origin.detail}
        )
        self.metrics = ""
        self.answers = {}
        self.scraped = None
        self.serving_since = None
        self.terminated_at = None
        self.failed_polls, self.failing_since = 0, None
        self.started_at = now
        self._spawned = time.monotonic()
        # A group of its own: a terminal's Ctrl-C reaches the supervisor only, which
        # passes it on (so a drain is the supervisor's decision, as with SIGTERM).
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True, env=env, process_group=0
        )
        self.process = process
        self._reader = threading.Thread(
            target=self._read_ready, args=(process,), name=f"child-{self.index}", daemon=True
        )
        self._reader.start()

    def _read_ready(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            ready = parse_ready_line(line)
            if ready is not None:
                if self.process is process:
                    self.metrics = "{}:{}".format(*ready.metrics)
                return

    def wait_ready(
        self, limit: float | None = None, stopping: threading.Event | None = None
    ) -> None:
        """Wait for the ready line of the process just spawned, at most ``limit``
        seconds from its spawn (None: ``start_limit``). If it exits first, raise as
        :func:`start_failure` says (``stopping``: set when the supervisor was asked to
        stop); if it is not ready in time, stop it (SIGTERM, then SIGKILL after a
        grace) and raise ``StartupDeferred``."""
        assert self.process is not None and self._reader is not None
        limit = self.start_limit if limit is None else limit
        left = None if limit is None else max(0.0, self._spawned + limit - time.monotonic())
        self._reader.join(left)
        if self.metrics:
            return
        timed_out = self._reader.is_alive()
        if timed_out:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(TERM_GRACE_S)
        code: int | None = None
        try:
            code = self.reap(TERM_GRACE_S)
        except subprocess.TimeoutExpired:  # killed, not dead (a hung fsync): try again
            log.error("process %d did not exit within %g s of SIGKILL", self.index,
                      TERM_GRACE_S)  # fmt: skip
        # The supervisor exits as its child did: a bad setting is not a danger, a
        # stop is not a failure (see ExitCode).
        error = start_failure(
            code, timed_out=timed_out, stopping=stopping is not None and stopping.is_set()
        )
        why = f"not ready within {limit:g} s: stopped" if timed_out else "did not start"
        raise error(
            f"process {self.index} (worker {self.settings.worker_id}) {why} "
            f"(exit code {code}); its error is above"
        )

    def terminate(self, now: float = 0.0) -> None:
        """Ask the process to stop (SIGTERM): it ends its start-up waits and
        deregisters."""
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        self.terminated_at = now

    def alive(self) -> bool:
        process = self.process
        return process is not None and process.poll() is None

    def kill(self) -> None:
        """SIGKILL what is left of the process: its whole group (it may have threads),
        and SIGKILL because a stopped process cannot act on SIGTERM. It is asked
        nothing more. It may live on a while: in uninterruptible sleep (a hung fsync
        on a network volume) it dies when that I/O completes."""
        process = self.process
        self.metrics = ""
        self.answers = {}
        self.scraped = None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

    def reap(self, timeout: float | None = None) -> int | None:
        """Kill what is left of the process (see :meth:`kill`), wait for it at most
        ``timeout`` seconds (None: as long as it takes), and close its pipe; its exit
        code. Raises ``subprocess.TimeoutExpired`` if it has not exited by then (it is
        kept, to be reaped later)."""
        process = self.process
        if process is None:
            return None
        self.kill()
        code = process.wait(timeout)
        if self._reader is not None:
            self._reader.join(1.0)  # the pipe's end came with the process's
        if process.stdout is not None:
            process.stdout.close()
        self.metrics = ""
        self.answers = {}
        self.terminated_at = None
        self.process = None
        return code

    def get(self, path: str, timeout: float = POLL_TIMEOUT_S) -> tuple[int, str]:
        """``path`` of its admin endpoint: the status and body, or ``NO_ANSWER`` and
        why. Never raises for what the child (or its death) may cause."""
        try:
            return fetch(self.metrics, path, timeout)
        except TimeoutError:
            return NO_ANSWER, _NO_ANSWER
        except (OSError, http.client.HTTPException) as e:
            # A garbage status line (BadStatusLine), a body cut short (IncompleteRead:
            # the child died mid-answer), a connection closed unanswered.
            return NO_ANSWER, f"no answer ({type(e).__name__}: {e})"


def fetch(address: str, path: str, timeout: float) -> tuple[int, str]:
    """GET ``path`` of ``address`` (host:port): its status and body, all of it within
    ``timeout`` seconds or ``TimeoutError``. A socket's timeout bounds each read, not
    the request: an answer dripping a byte at a time held a thread for ever (and
    starved the requests of the healthy children of threads)."""
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return remaining

    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.connect()
        sock = connection.sock
        assert sock is not None
        sock.settimeout(left())
        connection.request("GET", path)
        sock.settimeout(left())  # the status line and headers: a few hundred bytes
        response = connection.getresponse()
        chunks: list[bytes] = []
        while True:
            sock.settimeout(left())
            chunk = response.read1(65536)
            if not chunk:
                break
            chunks.append(chunk)
        # http.client checks the body against Content-Length only when read whole.
        if response.length:
            raise http.client.IncompleteRead(b"".join(chunks), response.length)
        return response.status, b"".join(chunks).decode(errors="replace")
    finally:
        connection.close()


_NO_ANSWER = f"did not answer within {POLL_TIMEOUT_S:g} s"


_STILL_ASKING = f"did not answer within {POLL_TIMEOUT_S:g} s (still asking)"


def poll_children(
    children: Sequence[Child], paths: Sequence[str], pool: ThreadPoolExecutor | None = None
) -> dict[int, dict[str, tuple[int, str]]]:
    """Ask each child with an admin address for each of ``paths``, all at once; the
    answers by child index and path, one not had within the deadline as
    ``(NO_ANSWER, "did not answer ...")``. Returns within about ``POLL_TIMEOUT_S``.

    A path whose request from an earlier call still runs is not asked again (it counts
    as no answer now): so each child holds at most one thread per path, and a child
    answering slowly cannot take the threads the others' requests need."""
    asking = [child for child in children if child.metrics]
    if not asking:
        return {}
    own = pool is None
    executor = pool or ThreadPoolExecutor(len(asking) * len(paths), thread_name_prefix="poll")
    try:
        answers: dict[int, dict[str, tuple[int, str]]] = {}
        futures: dict[concurrent.futures.Future[tuple[int, str]], tuple[int, str]] = {}
        for child in asking:
            for path in paths:
                running = child.asking.get(path)
                if running is not None and not running.done():
                    answers.setdefault(child.index, {})[path] = (NO_ANSWER, _STILL_ASKING)
                    continue
                future = executor.submit(child.get, path)
                child.asking[path] = future
                futures[future] = (child.index, path)
        done, _ = concurrent.futures.wait(futures, timeout=POLL_TIMEOUT_S + 0.25)
        for future, (index, path) in futures.items():
            answer = (NO_ANSWER, _NO_ANSWER)
            if future in done:
                error = future.exception()
                answer = future.result() if error is None else (NO_ANSWER, repr(error))
            answers.setdefault(index, {})[path] = answer
        return answers
    finally:
        if own:
            executor.shutdown(wait=False, cancel_futures=True)
