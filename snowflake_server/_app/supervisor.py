"""``--processes N``: N server processes on one port, one worker id each.

Python serves on one core per process, and one worker id makes at most 4,096
ids per ms. So a host scales by processes, not threads: the supervisor starts
N children that bind the same Thrift port with SO_REUSEPORT (the kernel
spreads connections over them), each with its own worker id (consecutive from
``--worker-id``, or from the host name's ordinal x N with ``ordinal``, or leased
from ZooKeeper with ``auto``) and therefore its own generator, state file and
lock: nothing is shared between them. The supervisor serves the metrics of all
children on the one metrics port (each sample labelled ``process``), answers
``/readyz`` for all of them (ready when every child is), and passes SIGTERM,
SIGINT and SIGHUP on (each child drains, or reloads, on its own).

It supervises: every half second it asks every serving child's ``/livez`` at
once, each answer due within a second. A child that exits, or whose ``/livez``
fails (no answer: stopped, or its admin thread stuck; 503: its serving loop has
not turned for 30 s) for ``UNRESPONSIVE_POLLS`` polls in a row spanning at least
``UNRESPONSIVE_S``, is killed with SIGKILL (a stopped process cannot act on SIGTERM)
and started again, after a delay that doubles from 0.5 s up to 30 s and starts
over once a child has served for a minute. SIGKILL skips the final marks, which is
safe: the mark on disk is always ahead of every id issued (see
``_state.reservation``), and the next start waits for the clock to pass it. The
supervisor's own ``/livez`` fails once no supervision round has completed for
``LIVE_BOUND_S``; its ``/readyz`` answers within about a second, whatever the
children do.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from .._config.options import OPTIONS, worker_id_text
from .._config.settings import ServerSettings
from .._errors import ConfigurationError, StartupDeferred, StartupInterrupted, StartupRefused
from .._observability.admin import AdminServer
from .._observability.logs import LogFile
from .._observability.metrics import counter_by
from .._observability.probes import Readiness
from .._thrift.server import check_open_files, listen_socket, started_threads
from .node import on_signal
from .node_id import WorkerIdOrigin, configured_origin
from .notify import NOTIFY_SOCKET_ENV, Notifier
from .ready import parse_ready_line, ready_line

__all__ = [
    "LIVE_BOUND_S",
    "SUPERVISOR_PID_ENV",
    "UNRESPONSIVE_POLLS",
    "UNRESPONSIVE_S",
    "WORKER_ID_ORIGIN_ENV",
    "Supervisor",
    "child_argv",
    "die_with_supervisor",
    "origin_from_supervisor",
]

log = logging.getLogger(__name__)
_START_TIMEOUT_S = 60.0  # a child may wait for its clock (--max-startup-wait) and ZooKeeper
# A process that did not start, by its exit code: what the supervisor raises (and so
# how it exits). Anything else (a crash, a refusal) is a refusal.
_EXITED_AS: dict[int | None, type[Exception]] = {
    0: StartupInterrupted,
    2: ConfigurationError,
    75: StartupDeferred,
}
_STOP_TIMEOUT_S = 10.0
_POLL_EVERY_S = 0.5  # a supervision round
_POLL_TIMEOUT_S = (
    1.0  # a child's /livez, /readyz or /metrics answers within this, or counts as down
)
UNRESPONSIVE_POLLS = 3
"""Failed ``/livez`` polls in a row (spanning ``UNRESPONSIVE_S``) after which a child is
killed and replaced."""
UNRESPONSIVE_S = 3.0
LIVE_BOUND_S = 10.0
"""The supervisor's ``/livez`` fails when no supervision round completed for this long."""
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 30.0
_BACKOFF_RESET_S = 60.0  # a child that served this long restarts after the first delay again
RESTART_REASONS = ("exited", "unresponsive")


SUPERVISOR_PID_ENV = "SNOWFLAKE_SUPERVISOR_PID"
"""Set by the supervisor for its children: the pid they must not outlive."""
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WORKER_ID_ORIGIN_ENV = "SNOWFLAKE_SUPERVISOR_WORKER_ID_ORIGIN"
"""Set by the supervisor for its children: where their worker ids came from, as JSON
(their flags carry only the ids)."""


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


class _Child:
    """One child process, as the supervision loop sees it: starting (no admin address
    yet), serving, or down and due to start again at ``restart_at``."""

    def __init__(self, index: int, settings: ServerSettings, origin: WorkerIdOrigin) -> None:
        self.index = index
        self.settings = settings
        self.origin = origin
        self.process: subprocess.Popen[str] | None = None
        self.metrics = ""  # host:port of its admin endpoint, once it printed its ready line
        self.restarts = 0
        self.started_at = 0.0  # the supervisor's clock
        self.serving_since: float | None = None
        self.failed_polls = 0
        self.failing_since: float | None = None
        self.restart_at: float | None = None
        self.delay_s = _BACKOFF_FIRST_S
        self.why_down = ""
        self._reader: threading.Thread | None = None

    def spawn(self, now: float = 0.0) -> None:
        """Start the process; its ready line is read by a thread of its own (so that the
        supervision of the others goes on meanwhile)."""
        command = [sys.executable, "-m", "snowflake_server", *child_argv(self.settings)]
        # The child asks the kernel to end it with us (see die_with_supervisor); only
        # the supervisor talks to systemd.
        env = {k: v for k, v in os.environ.items() if k != NOTIFY_SOCKET_ENV}
        env[SUPERVISOR_PID_ENV] = str(os.getpid())
        env[WORKER_ID_ORIGIN_ENV] = json.dumps(
            {"source": self.origin.source, "detail": self.origin.detail}
        )
        self.metrics = ""
        self.serving_since = None
        self.failed_polls, self.failing_since = 0, None
        self.started_at = now
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

    def start(self) -> None:
        """Spawn it and wait for its ready line; ``StartupRefused`` if it exits first
        or does not get there within the start time limit (it is killed then)."""
        self.spawn()
        self.wait_ready()

    def wait_ready(self) -> None:
        assert self.process is not None and self._reader is not None
        self._reader.join(_START_TIMEOUT_S)
        if self.metrics:
            return
        code = self.reap()
        # The supervisor exits as its child did: a bad setting is not a danger, a
        # stop is not a failure (see ExitCode).
        error = _EXITED_AS.get(code, StartupRefused)
        raise error(
            f"process {self.index} (worker {self.settings.worker_id}) did not start "
            f"(exit code {code}); its error is above"
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def reap(self) -> int | None:
        """Kill what is left of the process (its whole group: it may have threads, and
        SIGKILL because a stopped process cannot act on SIGTERM), wait for it, and close
        its pipe; its exit code."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        code = process.wait()
        if self._reader is not None:
            self._reader.join(1.0)  # the pipe's end came with the process's
        if process.stdout is not None:
            process.stdout.close()
        self.metrics = ""
        self.process = None
        return code

    def get(self, path: str, timeout: float = _POLL_TIMEOUT_S) -> tuple[int, str]:
        url = f"http://{self.metrics}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read().decode()
        except urllib.error.URLError as e:  # what a connect's failure is wrapped in
            return 503, _NO_ANSWER if isinstance(e.reason, TimeoutError) else str(e.reason)
        except TimeoutError:
            return 503, _NO_ANSWER
        except OSError as e:
            return 503, str(e)


_NO_ANSWER = f"did not answer within {_POLL_TIMEOUT_S:g} s"


def poll_children(
    children: Sequence[_Child], path: str, pool: ThreadPoolExecutor | None = None
) -> dict[int, tuple[int, str]]:
    """Ask each child with an admin address for ``path``, all at once; each answer by
    child index, a child that did not answer within the deadline as
    ``(503, "did not answer ...")``. Returns within about ``_POLL_TIMEOUT_S``."""
    asking = [child for child in children if child.metrics]
    if not asking:
        return {}
    own = pool is None
    executor = pool or ThreadPoolExecutor(len(asking), thread_name_prefix="poll")
    try:
        futures = {executor.submit(child.get, path): child.index for child in asking}
        done, _ = concurrent.futures.wait(futures, timeout=_POLL_TIMEOUT_S + 0.25)
        return {
            index: future.result() if future in done else (503, _NO_ANSWER)
            for future, index in futures.items()
        }
    finally:
        if own:
            executor.shutdown(wait=False, cancel_futures=True)


class _ChildrenMetrics(Collector):
    """Every child's metrics, each sample labelled with its process index."""

    def __init__(self, children: list[_Child], pool: ThreadPoolExecutor | None = None) -> None:
        self._children = children
        self._pool = pool

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        answers = poll_children(self._children, "/metrics", self._pool)
        for child in self._children:
            status, text = answers.get(child.index, (503, "down"))
            if status != 200:
                # A child that cannot be scraped (dead, restarting) cannot serve either:
                # say so, rather than let its series vanish.
                ready = merged.setdefault(
                    "snowflake_ready",
                    Metric("snowflake_ready", "1 while /readyz answers 200.", "gauge"),
                )
                ready.add_sample("snowflake_ready", {"process": str(child.index)}, 0)
                continue
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    labels = {**sample.labels, "process": str(child.index)}
                    into.samples.append(sample._replace(labels=labels))
        yield from merged.values()


class Supervisor(Collector):
    """Runs ``settings.processes`` children; see the module docstring. ``origin`` says
    where the first worker id came from (see ``resolve_worker_id``). ``clock`` is
    monotonic seconds (the supervision loop's timing: restarts, bounds).

    As a collector it reports the restarts, by reason (exited, unresponsive).
    """

    def __init__(
        self,
        settings: ServerSettings,
        log_file: LogFile | None = None,
        *,
        origin: WorkerIdOrigin | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._origin = configured_origin(settings) if origin is None else origin
        self._log_file = log_file
        self._clock = clock
        self._stop = threading.Event()
        self._serving = threading.Event()  # every process started: a stop drains now
        self._children: list[_Child] = []
        self._readiness = Readiness()  # its phase; the children's own checks are theirs
        self._notifier = Notifier(os.environ)
        self.restarts = dict.fromkeys(RESTART_REASONS, 0)
        self._last_round: float | None = None  # the clock when a round last completed
        self._watch_pool: ThreadPoolExecutor | None = None
        self._probe_pool: ThreadPoolExecutor | None = None

    def _child_settings(self, index: int, port: int, http_port: int) -> ServerSettings:
        settings = self._settings
        first = settings.worker_number
        worker_id = first if settings.auto_worker_id else first + index
        # Checked as it is made: the consecutive worker id must fit the layout.
        return replace(
            settings,
            port=port,
            http_port=http_port,
            processes=1,
            reuse_port=True,
            worker_id=worker_id,
            metrics_host="127.0.0.1",
            metrics_port=0,
        )

    def run(self) -> int:
        settings = self._settings
        # Each child raises its own limit; a limit too low for any of them is found here,
        # before anything starts.
        check_open_files(settings.thrift.max_connections)
        # Threads started now, not when a poll needs one (a host out of threads must not
        # read as children not answering). Two per child: a stuck poll may still hold one.
        count = 2 * settings.processes
        self._watch_pool = started_threads(count, "supervise")
        self._probe_pool = started_threads(count, "probe")
        try:
            return self._run()
        finally:
            self._watch_pool.shutdown(wait=False, cancel_futures=True)
            self._probe_pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> int:
        settings = self._settings
        # Hold the port (SO_REUSEPORT, not listening) so that port 0 means one port for all.
        holders = [listen_socket(settings.host, settings.port, reuse_port=True)]
        if settings.thrift.http:
            holders.append(listen_socket(settings.http_host, settings.http_port, reuse_port=True))
        port = holders[0].getsockname()[1]
        http_port = holders[1].getsockname()[1] if len(holders) > 1 else settings.http_port
        # From the start: a SIGTERM while the processes start stops them cleanly.
        on_signal(signal.SIGTERM, self._on_stop)
        on_signal(signal.SIGINT, self._on_stop)
        on_signal(signal.SIGHUP, lambda _name: self._reload())
        try:
            for index in range(settings.processes):
                if self._stop.is_set():
                    break
                child = _Child(index, self._child_settings(index, port, http_port), self._origin)
                self._children.append(child)
                child.spawn(self._clock())
            for child in self._children:
                child.wait_ready()
            if self._stop.is_set():
                raise StartupInterrupted("asked to stop while the processes were starting")
        except BaseException:
            self._stop_children()
            raise
        finally:
            for holder in holders:
                holder.close()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_ChildrenMetrics(self._children, self._probe_pool))
        registry.register(self)
        try:
            admin = AdminServer(registry, settings.admin, ready=self._ready, live=self.live)
        except ConfigurationError:
            self._stop_children()
            raise
        admin.start()
        self._readiness.serving()
        self._serving.set()
        metrics_host, metrics_port = admin.address
        log.info("%d processes serving on %s:%d", settings.processes, settings.host, port)
        http = (settings.http_host, http_port) if settings.thrift.http else None
        print(ready_line((settings.host, port), (metrics_host, metrics_port), http), flush=True)
        self._notifier.ready(f"{settings.processes} processes serving")
        try:
            self._watch()
        finally:
            code = self._stop_children()
            admin.stop()
        return code

    def collect(self) -> Iterable[Metric]:
        yield counter_by(
            "snowflake_supervisor_restarts",
            "With --processes: processes restarted by the supervisor, by reason: exited "
            "(it died, or never got to serve), or unresponsive (its /livez failed "
            f"{UNRESPONSIVE_POLLS} times in a row over {UNRESPONSIVE_S:g} s: killed).",
            "reason",
            self.restarts,
        )

    def live(self) -> str | None:
        """Why the supervisor cannot supervise (no round completed for ``LIVE_BOUND_S``),
        or None. Alive until its first round: starting has its own time limits."""
        last = self._last_round
        if last is None:
            return None
        stalled = self._clock() - last
        if stalled <= LIVE_BOUND_S:
            return None
        return f"the supervision loop has not completed a round for {stalled:.1f} s"

    def _on_stop(self, name: str) -> None:
        if not self._serving.is_set():
            # Nothing to drain: each process ends its start-up waits and exits 0.
            log.info("received %s while starting: stopping the processes", name)
            self._stop.set()
            self._signal_children(signal.SIGTERM)
            return
        if self._stop.is_set():
            # Again: pass it on, so that each process skips the rest of its drain.
            log.info("received %s again: stopping %d processes now", name, len(self._children))
            self._signal_children(signal.SIGTERM)
            return
        log.info("received %s: stopping %d processes", name, len(self._children))
        self._readiness.draining()
        self._notifier.stopping(f"draining for {self._settings.drain_seconds:g} s")
        self._stop.set()

    def _reload(self) -> None:
        if self._log_file is not None:
            self._log_file.reopen()
        self._signal_children(signal.SIGHUP)

    def _signal_children(self, signum: signal.Signals) -> None:
        for child in self._children:
            if child.alive():
                assert child.process is not None
                child.process.send_signal(signum)

    def _watch(self) -> None:
        self._last_round = self._clock()
        while not self._stop.wait(_POLL_EVERY_S):
            self.supervise_once()

    def supervise_once(self) -> None:
        """One round: every serving child's ``/livez`` asked at once; a child that
        exited, did not start in time, or failed its polls too long is put down and
        its restart scheduled; a child whose delay is over is started again."""
        answers = poll_children(self._children, "/livez", self._watch_pool)
        now = self._clock()
        for child in self._children:
            if self._stop.is_set():
                return
            self._supervise(child, answers.get(child.index), now)
        self._last_round = self._clock()

    def _supervise(self, child: _Child, answer: tuple[int, str] | None, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.restart_at = None
                log.info("starting process %d (worker %s) again", child.index,
                         child.settings.worker_id)  # fmt: skip
                child.spawn(now)
            return
        process = child.process
        if process is None:
            return
        code = process.poll()
        if code is not None:
            self._down(child, "exited", f"exited (code {code})", now)
            return
        if not child.metrics:
            if now - child.started_at > _START_TIMEOUT_S:
                self._down(child, "exited", f"did not start within {_START_TIMEOUT_S:g} s", now)
            return
        if child.serving_since is None:
            child.serving_since = now
        if answer is None:
            return  # became ready after this round's polls went out
        status, body = answer
        if status == 200:
            child.failed_polls, child.failing_since = 0, None
            return
        child.failed_polls += 1
        if child.failing_since is None:
            child.failing_since = now
        failing = now - child.failing_since
        if child.failed_polls >= UNRESPONSIVE_POLLS and failing >= UNRESPONSIVE_S:
            why = _reason(body)
            self._down(
                child, "unresponsive", f"failed /livez {child.failed_polls} times in "
                f"{failing:.1f} s ({why}): killed", now,
            )  # fmt: skip

    def _down(self, child: _Child, reason: str, why: str, now: float) -> None:
        pid = child.process.pid if child.process is not None else None
        child.reap()
        self.restarts[reason] += 1
        child.restarts += 1
        if child.serving_since is not None and now - child.serving_since >= _BACKOFF_RESET_S:
            child.delay_s = _BACKOFF_FIRST_S
        delay = child.delay_s
        child.delay_s = min(2 * delay, _BACKOFF_MAX_S)
        child.restart_at = now + delay
        child.serving_since = None
        child.why_down = f"{why}; restarting in {delay:g} s"
        log.error("process %d (worker %s, pid %s) %s: restarting it in %g s",
                  child.index, child.settings.worker_id, pid, why, delay)  # fmt: skip

    def _stop_children(self) -> int:
        code = 0
        self._signal_children(signal.SIGTERM)
        deadline = time.monotonic() + self._settings.drain_seconds + _STOP_TIMEOUT_S
        for child in self._children:
            if child.process is None:
                continue
            try:
                if child.process.wait(max(0.1, deadline - time.monotonic())) != 0:
                    code = 1
            except subprocess.TimeoutExpired:
                code = 1
            child.reap()
        return code

    def _ready(self) -> tuple[str | None, dict[str, object]]:
        """Ready when every child is (and we are not stopping): all are asked at once,
        and one that does not answer within the deadline is not ready."""
        answers = poll_children(self._children, "/readyz", self._probe_pool)
        unready: dict[str, str] = {}
        for child in self._children:
            status, body = answers.get(child.index, (503, child.why_down or "starting"))
            if status != 200:
                unready[str(child.index)] = _reason(body)
        why = self._readiness.reason() or "; ".join(
            f"process {index}: {reason}" for index, reason in unready.items()
        )
        return why or None, {
            "phase": self._readiness.phase.value,
            "worker_id_source": self._origin.source,
            "worker_id_from": self._origin.detail,
            "processes": {
                str(child.index): "unavailable" if str(child.index) in unready else "ok"
                for child in self._children
            },
        }


def _reason(body: str) -> str:
    """The ``reason`` of a probe's JSON answer, or the body itself."""
    try:
        return str(json.loads(body).get("reason", body))
    except (ValueError, AttributeError):
        return body
